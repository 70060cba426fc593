"""Model FLOPs per token for the configured variant, peak device FLOP/s, and MFU.

Convention (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, App. B; nanoGPT's ``estimate_mfu``):

- only matrix multiplications count, 2 FLOPs per multiply-add; norms, activations, rotary,
  softmax / tanh gains and the embedding lookup are left out;
- a forward pass costs ``2 N`` per token for the ``N`` weights used in matmuls (every linear
  layer of every block plus the LM head, which is a matmul even when tied to the embedding);
- plus the attention mixing, which has no weights (below);
- training (forward + backward) costs 3x the forward: the backward pass computes the gradients
  of both the activations and the weights, each as large as the forward matmul.

Attention mixing, per token and layer, with H query heads, K KV heads, head width D, length T:

- ``softmax``: scores ``q.k`` and the weighted sum of values, ``2 * 2 * D`` per (query, key) pair
  and head. We count the *visible* keys only, ``(T + 1) / 2`` on average over positions (causal
  halving, which is what a causal FlashAttention kernel does); PaLM and nanoGPT count all T keys
  (their ``12 L H Q T``), so their attention term is about twice ours.
- ``iso_tanh`` (chunked, chunk C = min(iso_tanh_chunk_size, T); isotropic-deep-learning eq. 28): the exact
  scores and weighted values inside the chunk over ``(C + 1) / 2`` visible keys on average,
  ``2 * D * (C + 1)`` per query head; ``q^T [S | G]`` against the carried state, ``2 * D * 2D``
  per query head (the ``q^T G q`` dot that follows is elementwise); the state update
  ``[S | G] += k [v | k]^T``, ``2 * D * 2D`` per KV head.

MFU = achieved model FLOP/s over the peak FLOP/s of the same hardware (PaLM's definition).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from llm.model.config import ModelConfig
from llm.model.modeling_isollm import IsoLLMDecoderLayer


def matmul_weights(config: ModelConfig) -> int:
    """Weights used in matmuls for one token: every block's projections plus the LM head.

    A block's are every 2-D ``weight`` of one decoder layer built on the meta device (the fused qkv and
    FFN input projections, ``o_proj``, ``down_proj``, isogmlp's alpha gate), so a new variant needs
    no formula here. Parameters that only scale or shift channels (the RMSNorms, isogmlp's
    gamma/beta, iso_ln's LayerNorm, affine_like's bias) are elementwise and do not count; ``focus``
    builds its effective weight W * Phi once per forward, a per-step cost the tokens share.
    """
    with torch.device("meta"):
        layer = IsoLLMDecoderLayer(config)
    per_layer = sum(p.numel() for name, p in layer.named_parameters() if name.endswith("weight") and p.dim() == 2)
    return config.num_hidden_layers * per_layer + config.hidden_size * config.vocab_size


def _softmax_mixing_flops(c: ModelConfig, seq_len: int) -> float:
    # per head: (q.k and w.v) x 2 FLOPs x D for each of the (T + 1) / 2 visible keys on average
    return c.num_attention_heads * 2 * 2 * c.resolved_head_dim * (seq_len + 1) / 2


def _iso_tanh_mixing_flops(c: ModelConfig, seq_len: int) -> float:
    d = c.resolved_head_dim
    chunk = min(c.iso_tanh_chunk_size, seq_len)
    # exact part inside the chunk, as softmax over (C + 1) / 2 keys; then q^T [S | G], D x 2D
    per_query_head = 2 * 2 * d * (chunk + 1) / 2 + 2 * d * 2 * d
    per_kv_head = 2 * d * 2 * d  # [S | G] += k [v | k]^T
    return c.num_attention_heads * per_query_head + c.num_key_value_heads * per_kv_head


# Forward FLOPs of the weight-free attention mixing, per token and layer (see the module docstring).
ATTN_MIXING_FLOPS: dict[str, Callable[[ModelConfig, int], float]] = {
    "softmax": _softmax_mixing_flops, "iso_tanh": _iso_tanh_mixing_flops}


def flops_per_token(config: ModelConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token at sequence length ``seq_len``: ``2 N`` + attention mixing, x3 to train."""
    if seq_len <= 0:
        raise ValueError(f"seq_len: expected a positive integer, got {seq_len}")
    mixing = config.num_hidden_layers * ATTN_MIXING_FLOPS[config.attn_scoring](config, seq_len)
    forward = 2.0 * matmul_weights(config) + mixing
    return 3.0 * forward if training else forward


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation, ``tokens_per_s * flops_per_token / peak_flops``, with ``tokens_per_s`` and
    ``peak_flops`` over the same devices (global throughput, and one device's peak times the processes)."""
    if not peak_flops > 0:
        raise ValueError(f"peak_flops: expected a positive number, got {peak_flops}")
    return tokens_per_s * flops_per_token / peak_flops


# Dense (no 2:4 sparsity) peak FLOP/s from NVIDIA's datasheets. "fp32" is the CUDA-core rate that
# fp32 matmuls run at under torch's default ``float32_matmul_precision("highest")``; "tf32" applies
# when that is "high" or "medium". Keys are matched as substrings of ``torch.cuda.get_device_name``
# in this order, so the specific names come before the plain "H100" (SXM) entry.
_H100_SXM = {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378.0e12, "fp32": 51.2e12},
    "H100 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60.0e12},
    "H100": _H100_SXM,
    "H200": _H100_SXM,  # same GH100 compute as the H100 SXM, more and faster memory
    "A100": {"bf16": 312.0e12, "fp16": 312.0e12, "tf32": 156.0e12, "fp32": 19.5e12},
}

_DTYPE_KEYS: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def measure_matmul_flops(n: int = 1024, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu", repeats: int = 5) -> float:
    """Best FLOP/s of ``repeats`` timed ``[n, n] @ [n, n]`` matmuls (after one warm-up) on ``device``."""
    device = torch.device(device)
    a, b = torch.randn(2, n, n, device=device).to(dtype)
    synchronize = torch.get_device_module(device).synchronize  # a GPU's matmul returns before it is done
    torch.mm(a, b)
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


@functools.cache
def _measured_peak(device: str, dtype: torch.dtype) -> float:
    return measure_matmul_flops(dtype=dtype, device=device)


def peak_flops(device: str | torch.device, dtype: torch.dtype) -> float:
    """Peak matmul FLOP/s of one ``device`` computing in ``dtype``: a known GPU's from ``GPU_PEAK_FLOPS``, anything
    else's (CPU, other GPUs) measured once per process (``measure_matmul_flops``), a practical, not datasheet, peak."""
    device = torch.device(device)
    if dtype not in _DTYPE_KEYS:
        raise ValueError(f"dtype: expected one of {list(_DTYPE_KEYS)}, got {dtype}")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = _DTYPE_KEYS[dtype]
        if key == "fp32" and torch.get_float32_matmul_precision() != "highest":
            key = "tf32"
        for pattern, table in GPU_PEAK_FLOPS.items():
            if pattern in name:
                return table[key]
    return _measured_peak(str(device), dtype)
