"""FLOPs per token from hand-computed tiny configs, against the built model's weights, and MFU / peaks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llm.metrics import flops as flops_module
from llm.metrics.flops import flops_per_token, matmul_weights, mfu, peak_flops
from llm.model.config import ModelConfig
from llm.model.configuration_isollm import IsoLLMConfig
from llm.model.modeling_isollm import IsoLLMForCausalLM

# d = 32, 4 query heads and 2 KV heads of width 8, h = 64, 2 layers, V = 256.
TINY = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, iso_tanh_chunk_size=4)
T = 16


def test_swiglu_softmax_by_hand() -> None:
    attention = 32 * (4 * 8 + 2 * 2 * 8) + 4 * 8 * 32  # qkv_proj 32 -> 64, o_proj 32 -> 32: 3072
    ffn = 3 * 32 * 64  # gate, up, down: 6144
    n = 2 * (attention + ffn) + 32 * 256  # + LM head: 26624
    assert matmul_weights(TINY) == n == 26_624
    # softmax: 2 (q.k and w.v) x 2 FLOPs x D per visible key, (T + 1) / 2 visible keys on average
    mixing = 2 * 4 * (2 * 2 * 8 * (T + 1) / 2)  # layers x heads x ...: 2176
    assert flops_per_token(TINY, T, training=False) == 2 * n + mixing == 55_424
    assert flops_per_token(TINY, T) == 3 * (2 * n + mixing) == 166_272


def test_iso_tanh_by_hand() -> None:
    config = replace(TINY, attn_scoring="iso_tanh")
    chunk = 4
    per_query_head = 2 * 8 * (chunk + 1) + 2 * 8 * (2 * 8)  # scores+values in the chunk, q^T [S | G]
    per_kv_head = 2 * 8 * (2 * 8)  # [S | G] += k [v | k]^T
    mixing = 2 * (4 * per_query_head + 2 * per_kv_head)  # 2 * 1856
    assert flops_per_token(config, T, training=False) == 2 * 26_624 + mixing == 2 * 26_624 + 3712
    # a chunk longer than the sequence is the sequence: the same as chunk = T
    assert flops_per_token(replace(config, iso_tanh_chunk_size=1024), T) == \
        flops_per_token(replace(config, iso_tanh_chunk_size=T), T)


def test_ffn_variants_differ_by_their_projections() -> None:
    d, h, layers = 32, 64, 2

    def forward(**fields: object) -> float:
        return flops_per_token(replace(TINY, **fields), T, training=False)

    swiglu = forward()
    assert forward(ffn="isogmlp") - swiglu == 2 * layers * (d * h + d)  # W_i and the alpha gate w_a
    assert forward(ffn="isogmlp", isogmlp_gate="feature_mean") - swiglu == 2 * layers * (d * h + 1)
    assert forward(ffn="iso_ln") - swiglu == 2 * layers * d * h  # W_i
    assert forward(ffn="iso_ln", iso_ln_pathway=False) == swiglu
    assert swiglu - forward(ffn="iso_mlp") == 2 * layers * d * h  # no gate projection
    # parameter matching gives every variant SwiGLU's FFN matmul weights (up to rounding of h)
    for ffn in ("isogmlp", "iso_ln", "iso_mlp"):
        assert forward(ffn=ffn, ffn_param_match=True) == pytest.approx(swiglu, rel=0.02)


VARIANTS = [
    {},
    {"ffn": "isogmlp"},
    {"ffn": "isogmlp", "isogmlp_gate": "feature_mean"},
    {"ffn": "iso_ln", "ffn_param_match": True},
    {"ffn": "iso_ln", "iso_ln_pathway": False},
    {"ffn": "iso_mlp", "ffn_param_match": True},
    {"ffn": "isogmlp", "ffn_linear": "affine_like"},
    {"ffn": "swiglu", "ffn_linear": "focus", "tie_word_embeddings": False},
]


@pytest.mark.parametrize("fields", VARIANTS, ids=lambda f: "-".join(map(str, f.values())) or "swiglu")
def test_matmul_weights_match_the_built_model(fields: dict[str, object]) -> None:
    """``matmul_weights`` counts one meta-built decoder layer: times the layers, plus the LM head (a matmul
    even when tied), it must equal every matrix of the whole model except the embedding lookup, so no
    matrix outside the layers is missed and none is counted twice. (The swiglu total is checked by hand
    in the test above.)"""
    config = replace(TINY, **fields)
    with torch.device("meta"):
        model = IsoLLMForCausalLM(IsoLLMConfig.from_model_config(config))
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.dim() == 2 and name not in ("model.embed_tokens.weight", "lm_head.weight"))
    assert matmul_weights(config) == matrices + config.hidden_size * config.vocab_size


def test_training_is_three_forwards_and_bad_length() -> None:
    config = replace(TINY, attn_scoring="iso_tanh", ffn="iso_ln")
    assert flops_per_token(config, 128) == 3 * flops_per_token(config, 128, training=False)
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(config, 0)


def test_mfu_arithmetic() -> None:
    assert mfu(tokens_per_s=1000.0, flops_per_token=6e9, peak_flops=1e13) == pytest.approx(0.6, rel=1e-15)
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1.0, 1.0, 0.0)


@pytest.mark.parametrize(("name", "dtype", "expected"), [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.5e12),
    ("NVIDIA H200", torch.bfloat16, 989.4e12),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
    ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5e12),
])
def test_gpu_peak_table(monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype,
                        expected: float) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops("cuda:0", dtype) == expected


def test_tf32_peak_when_fp32_matmuls_use_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert peak_flops("cuda", torch.float32) == 494.7e12
    finally:
        torch.set_float32_matmul_precision(previous)


def test_cpu_peak_is_measured_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, torch.dtype]] = []

    def fake_measure(n: int = 1024, dtype: torch.dtype = torch.float32, device: str = "cpu",
                     repeats: int = 5) -> float:
        calls.append((str(device), dtype))
        return 5e10

    monkeypatch.setattr(flops_module, "measure_matmul_flops", fake_measure)
    flops_module._measured_peak.cache_clear()
    try:
        assert peak_flops("cpu", torch.float32) == peak_flops(torch.device("cpu"), torch.float32) == 5e10
        assert calls == [("cpu", torch.float32)]
    finally:
        flops_module._measured_peak.cache_clear()
    with pytest.raises(ValueError, match="dtype"):
        peak_flops("cpu", torch.int8)


def test_measure_matmul_flops_on_cpu() -> None:
    measured = flops_module.measure_matmul_flops(n=256, repeats=2)
    assert 1e8 < measured < 1e13  # a plausible CPU fp32 rate; the timing itself is not deterministic


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measured_gpu_matmul_stays_below_the_table_peak() -> None:
    if not any(pattern in torch.cuda.get_device_name() for pattern in flops_module.GPU_PEAK_FLOPS):
        pytest.skip(f"{torch.cuda.get_device_name()} is not in GPU_PEAK_FLOPS")
    table = peak_flops("cuda", torch.bfloat16)
    measured = flops_module.measure_matmul_flops(n=8192, dtype=torch.bfloat16, device="cuda", repeats=10)
    assert 0.3 * table < measured < table
