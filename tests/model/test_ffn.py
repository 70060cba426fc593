"""FFN blocks: formulas against hand-written references (fp64), ablations, causality, cache, matching."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from reference import ffn_param_count
from torch.fx.experimental.proxy_tensor import make_fx

from llm.model.config import ConfigError, ModelConfig
from llm.model.ffn import (
    FFN_REGISTRY,
    ISOGMLP_GATES,
    IsoLN,
    resolve_intermediate_size,
    swiglu_param_count,
)
from llm.model.linear import LINEAR_REGISTRY

D, H = 32, 64
TINY = ModelConfig(vocab_size=256, hidden_size=D, intermediate_size=H, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


def build(seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = replace(TINY, **overrides)
    return FFN_REGISTRY[config.ffn](config).double()


def inputs(seed: int = 0, batch: int = 2, seq: int = 7) -> torch.Tensor:
    return torch.randn(batch, seq, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def blocks(weight: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Row blocks of a fused projection weight: the documented pathway order."""
    return list(weight.detach().chunk(k, dim=0))


def test_registry_keys_are_the_config_choices():
    assert set(FFN_REGISTRY) == {"swiglu", "isogmlp", "iso_ln", "iso_mlp"}
    assert set(ISOGMLP_GATES) == {"token", "causal_mean", "feature_mean"}


@pytest.mark.parametrize("param_match", [False, True])
@pytest.mark.parametrize("linear", sorted(LINEAR_REGISTRY))
@pytest.mark.parametrize("ffn", sorted(FFN_REGISTRY))
def test_every_variant_builds_runs_and_trains_all_parameters(ffn, linear, param_match):
    block = build(ffn=ffn, ffn_linear=linear, ffn_param_match=param_match)
    x = inputs()
    out = block(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    out.pow(2).sum().backward()
    unused = [n for n, p in block.named_parameters() if p.grad is None]
    assert not unused  # DDP fails on parameters that get no gradient
    assert sum(p.numel() for p in block.parameters()) == ffn_param_count(replace(
        TINY, ffn=ffn, ffn_linear=linear, ffn_param_match=param_match))


@pytest.mark.parametrize("ffn", sorted(FFN_REGISTRY))
def test_bf16_keeps_the_dtype(ffn):
    config = replace(TINY, ffn=ffn, isogmlp_gate="causal_mean")
    block = FFN_REGISTRY[ffn](config).to(torch.bfloat16)
    out = block(torch.randn(2, 5, D, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_swiglu_equals_reference_and_fuses_gate_then_up():
    block = build(ffn="swiglu")
    w_gate, w_up = blocks(block.in_proj.weight, 2)
    x = inputs()
    expected = (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ block.down_proj.weight.T
    torch.testing.assert_close(block(x), expected, rtol=1e-13, atol=1e-15)


def test_isogmlp_equals_eq_1_4_for_one_token():
    block = build(ffn="isogmlp", isogmlp_gate="token")
    with torch.no_grad():
        block.gamma.uniform_(0.5, 1.5)
        block.beta.normal_()
        block.alpha_gate.proj.bias.fill_(0.3)
    w_g, w_u, w_i = blocks(block.in_proj.weight, 3)
    w_a, b_a = block.alpha_gate.proj.weight.detach()[0], block.alpha_gate.proj.bias.item()
    x = inputs(seq=1)[0, 0]
    gated = F.silu(w_g @ x) * (w_u @ x)  # eq. 1
    iso = block.gamma.detach() * (w_i @ x) + block.beta.detach()  # eq. 2
    alpha = 1 / (1 + math.exp(-(w_a.dot(x).item() + b_a)))  # eq. 3 (per token)
    expected = block.down_proj.weight.detach() @ (alpha * gated + (1 - alpha) * iso)  # eq. 4
    torch.testing.assert_close(block(x[None, None])[0, 0], expected, rtol=1e-13, atol=1e-15)


def test_isogmlp_gates_follow_their_definitions():
    x = inputs()
    counts = torch.arange(1, x.shape[1] + 1, dtype=torch.float64)[None, :, None]
    for gate, summary in {
        "token": x,
        "causal_mean": x.cumsum(dim=1) / counts,  # mean over positions <= t
    }.items():
        proj = build(ffn="isogmlp", isogmlp_gate=gate).alpha_gate
        torch.testing.assert_close(proj(x), torch.sigmoid(summary @ proj.proj.weight.T + proj.proj.bias))
    feature = build(ffn="isogmlp", isogmlp_gate="feature_mean").alpha_gate
    w, b = feature.proj.weight.item(), feature.proj.bias.item()
    torch.testing.assert_close(feature(x), torch.sigmoid(w * x.mean(dim=-1, keepdim=True) + b))


@pytest.mark.parametrize("gate", ["token", "causal_mean"])
def test_isogmlp_gate_is_one_reduction_not_a_gemm(gate):
    """The d -> 1 logit is a multiply and a sum over d (one reduction compiled), equal to the affine map in fp64."""
    proj = build(ffn="isogmlp", isogmlp_gate=gate).alpha_gate
    x = inputs()
    graph = make_fx(lambda t: proj.logit(t, None))(x).graph
    assert not {str(n.target) for n in graph.nodes} & {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}
    if gate == "token":
        torch.testing.assert_close(proj.logit(x, None), F.linear(x, proj.proj.weight, proj.proj.bias),
                                   rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("gate", sorted(ISOGMLP_GATES))
def test_isogmlp_output_at_t_ignores_later_positions(gate):
    block = build(ffn="isogmlp", isogmlp_gate=gate)
    x = inputs()
    changed = x.clone()
    changed[:, 4:] += torch.randn_like(changed[:, 4:])
    out, out_changed = block(x), block(changed)
    torch.testing.assert_close(out[:, :4], out_changed[:, :4], rtol=0, atol=1e-14)
    assert (out[:, 4:] - out_changed[:, 4:]).abs().min() > 0


@pytest.mark.parametrize("gate", sorted(ISOGMLP_GATES))
@pytest.mark.parametrize("ffn", sorted(FFN_REGISTRY))
def test_incremental_with_cache_equals_full_sequence(ffn, gate):
    block = build(ffn=ffn, isogmlp_gate=gate)
    x = inputs(seq=9)
    full = block(x)
    cache: dict = {}
    steps = [block(x[:, :4], cache)]  # a prefill chunk, then one token at a time
    steps += [block(x[:, t : t + 1], cache) for t in range(4, x.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-13, atol=1e-14)


def iso_ln_reference_pathways(block: IsoLN, x: torch.Tensor, layernorm: bool, pathway: bool):
    """The unweighted pathways ``SiLU(W_g x) * (W_u x)`` and ``LayerNorm(W_i x)`` (None when ablated)."""
    w = blocks(block.in_proj.weight, 3 if pathway else 2)
    gated = F.silu(x @ w[0].T) * (x @ w[1].T)
    if not pathway:
        return gated, None
    v = x @ w[2].T
    if layernorm:
        ln = block.iso_norm
        v = (v - v.mean(-1, keepdim=True)) / torch.sqrt(v.var(-1, unbiased=False, keepdim=True) + ln.eps)
        v = v * ln.weight.detach() + ln.bias.detach()
    return gated, v


def iso_ln_reference(block: IsoLN, x: torch.Tensor, alpha: float, layernorm: bool, pathway: bool):
    gated, iso = iso_ln_reference_pathways(block, x, layernorm, pathway)
    beta = 0.1 * math.tanh(block.beta_raw.item())
    hidden = alpha * gated + beta
    if pathway:
        hidden = hidden + (2 - alpha) * iso
    return hidden @ block.down_proj.weight.detach().T


def set_iso_ln_mixing(block: IsoLN) -> float:
    """Move alpha, beta and the LayerNorm's affine off their initial values; return alpha."""
    with torch.no_grad():
        block.alpha_raw.fill_(0.7)
        block.beta_raw.fill_(-0.4)
        if block.has_iso_pathway and isinstance(block.iso_norm, torch.nn.LayerNorm):
            block.iso_norm.weight.uniform_(0.5, 1.5)
            block.iso_norm.bias.normal_()
    return 0.5 + 1.5 / (1 + math.exp(-0.7))


@pytest.mark.parametrize(("layernorm", "pathway"), [(True, True), (False, True), (True, False)])
def test_iso_ln_equals_reference(layernorm, pathway):
    block = build(ffn="iso_ln", iso_ln_layernorm=layernorm, iso_ln_pathway=pathway)
    alpha = set_iso_ln_mixing(block)
    x = inputs()
    expected = iso_ln_reference(block, x, alpha, layernorm, pathway)
    torch.testing.assert_close(block(x), expected, rtol=1e-12, atol=1e-14)
    assert block.in_proj.weight.shape[0] == (3 if pathway else 2) * H
    has_ln = any(isinstance(m, torch.nn.LayerNorm) for m in block.modules())
    assert has_ln == (pathway and layernorm)


def test_iso_ln_initial_mixing():
    block = build(ffn="iso_ln")
    assert block.alpha().item() == 1.25 and block.beta().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_iso_ln_alpha_beta_stay_in_range_for_extreme_parameters(dtype):
    block = build(ffn="iso_ln").to(dtype)
    for raw, alpha, beta in [(1e4, 2.0, 0.1), (-1e4, 0.5, -0.1), (0.0, 1.25, 0.0)]:
        with torch.no_grad():
            block.alpha_raw.fill_(raw)
            block.beta_raw.fill_(raw)
        # Exactly the bounds, as represented in the parameter dtype (0.1 is not a binary fraction).
        assert block.alpha() == torch.tensor(alpha, dtype=dtype)
        assert block.beta() == torch.tensor(beta, dtype=dtype)
        stats = block.diagnostics(inputs().to(dtype))
        beta_bound = torch.tensor(0.1, dtype=dtype).item()
        assert 0.5 <= stats["alpha"] <= 2.0 and -beta_bound <= stats["beta"] <= beta_bound


def test_iso_ln_fixed_alpha_ablation():
    block = build(ffn="iso_ln", iso_ln_alpha=1.5)
    assert "alpha_raw" not in dict(block.named_parameters())
    with torch.no_grad():
        block.beta_raw.fill_(0.2)
    x = inputs()
    torch.testing.assert_close(block(x), iso_ln_reference(block, x, 1.5, True, True), rtol=1e-12, atol=1e-14)
    assert block.diagnostics(x)["alpha"] == 1.5


@pytest.mark.parametrize("init", ["paper", "matched"])
def test_iso_mlp_equals_reference(init):
    block = build(ffn="iso_mlp", iso_activation="tanh", ffn_init=init)
    x = inputs() * 20  # radii around 1, where paper iso-tanh is far from linear
    v = x @ block.in_proj.weight.detach().T
    r = v.norm(dim=-1, keepdim=True)
    # matched: radii in units of the initial norm initializer_range * sqrt(d h), gain 1 / tanh(1)
    unit = TINY.initializer_range * math.sqrt(D * block.intermediate_size) if init == "matched" else 1.0
    gain = 1 / math.tanh(1.0) if init == "matched" else 1.0
    expected = (gain * unit * torch.tanh(r / unit) * v / r) @ block.down_proj.weight.detach().T  # eq. 16
    torch.testing.assert_close(block(x), expected, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("ffn", sorted(FFN_REGISTRY))
def test_diagnostics_keys_and_ranges(ffn):
    x = inputs()
    for overrides in ({}, {"iso_ln_pathway": False}, {"isogmlp_gate": "causal_mean"}):
        block = build(ffn=ffn, **overrides)
        stats = block.diagnostics(x)
        assert all(isinstance(v, float) and math.isfinite(v) for v in stats.values())
        if ffn in ("swiglu", "iso_mlp"):
            assert stats == {}
        elif ffn == "isogmlp":
            assert set(stats) == {"alpha", "beta", "pathway_ratio"}
            assert 0 < stats["alpha"] < 1 and stats["beta"] == 0.0 and stats["pathway_ratio"] > 0
        elif overrides.get("iso_ln_pathway") is False:
            assert set(stats) == {"alpha", "beta"}
        else:
            assert set(stats) == {"alpha", "beta", "pathway_ratio"}


@pytest.mark.parametrize("gate", sorted(ISOGMLP_GATES))
def test_diagnostics_values_match_a_hand_computation(gate):
    block = build(ffn="isogmlp", isogmlp_gate=gate)
    x = inputs()
    w_g, w_u, w_i = blocks(block.in_proj.weight, 3)
    alpha = block.alpha_gate(x)
    gated = alpha * F.silu(x @ w_g.T) * (x @ w_u.T)
    iso = (1 - alpha) * (block.gamma.detach() * (x @ w_i.T) + block.beta.detach())
    stats = block.diagnostics(x)
    assert stats["alpha"] == pytest.approx(alpha.mean().item(), rel=1e-12)
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    assert stats["pathway_ratio"] == pytest.approx(rms(gated) / rms(iso), rel=1e-12)


@pytest.mark.parametrize(("layernorm", "pathway"), [(True, True), (False, True), (True, False)])
def test_iso_ln_diagnostics_match_a_hand_computation(layernorm, pathway):
    """isotropy-ln-pathway: the weighted contributions alpha*Gated and (2-alpha)*LayerNorm(W_i x)."""
    block = build(ffn="iso_ln", iso_ln_layernorm=layernorm, iso_ln_pathway=pathway)
    alpha = set_iso_ln_mixing(block)
    x = inputs()
    gated, iso = iso_ln_reference_pathways(block, x, layernorm, pathway)
    stats = block.diagnostics(x)
    assert stats["alpha"] == pytest.approx(alpha, rel=1e-12)
    assert stats["beta"] == pytest.approx(0.1 * math.tanh(-0.4), rel=1e-12)
    if not pathway:
        assert "pathway_ratio" not in stats
        return
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    assert stats["pathway_ratio"] == pytest.approx(rms(alpha * gated) / rms((2 - alpha) * iso), rel=1e-12)


REALISTIC = ModelConfig(hidden_size=768, intermediate_size=2048)


@pytest.mark.parametrize("linear", sorted(LINEAR_REGISTRY))
@pytest.mark.parametrize("ffn", sorted(FFN_REGISTRY))
def test_param_matched_counts_equal_swiglu(ffn, linear):
    for d, h in [(64, 256), (256, 688), (768, 2048)]:  # the last is the 134M preset's shape
        config = replace(REALISTIC, hidden_size=d, intermediate_size=h, ffn=ffn, ffn_linear=linear,
                         ffn_param_match=True)
        target = swiglu_param_count(config)
        assert abs(ffn_param_count(config) / target - 1) < 0.01, (d, h)
        if (ffn, linear) == ("swiglu", "linear"):
            assert resolve_intermediate_size(config) == h and ffn_param_count(config) == target


def test_param_matching_sizes_and_rounding():
    iso_mlp = replace(REALISTIC, ffn="iso_mlp", ffn_param_match=True)
    assert resolve_intermediate_size(iso_mlp) == 3072  # 2*d*h' = 3*d*h exactly
    isogmlp = replace(REALISTIC, ffn="isogmlp", ffn_param_match=True)
    assert resolve_intermediate_size(isogmlp) % 8 == 0  # a multiple of 8 is within 0.5% here
    assert resolve_intermediate_size(replace(isogmlp, ffn_param_match=False)) == 2048
    with torch.device("meta"):
        block = FFN_REGISTRY["isogmlp"](isogmlp)
    assert block.intermediate_size == resolve_intermediate_size(isogmlp)


def test_param_matching_impossible_size_names_the_field():
    config = replace(TINY, hidden_size=4, intermediate_size=1, num_attention_heads=2,
                     ffn="isogmlp", ffn_param_match=True)
    with pytest.raises(ConfigError, match="intermediate_size"):
        resolve_intermediate_size(config)


@pytest.mark.parametrize("linear", sorted(LINEAR_REGISTRY))
@pytest.mark.parametrize("ffn", sorted(FFN_REGISTRY))
def test_reset_parameters_after_meta_init(ffn, linear):
    """Building on the meta device then ``reset_parameters`` gives the constructor's initialisation."""
    config = replace(TINY, ffn=ffn, ffn_linear=linear)
    fresh = [FFN_REGISTRY[ffn](config) for _ in range(2)]
    with torch.device("meta"):
        block = FFN_REGISTRY[ffn](config)
    block.to_empty(device="cpu")
    block.reset_parameters()
    for name, p in block.named_parameters():
        a, b = dict(fresh[0].named_parameters())[name], dict(fresh[1].named_parameters())[name]
        if torch.equal(a, b):  # deterministic init (gains, biases, focus centres): identical values
            assert torch.equal(p, a), name
        else:  # random weights: the same distribution (the sample std's relative error is ~1/sqrt(2n))
            std = config.initializer_range
            assert p.dim() == 2 and abs(p.std().item() - std) < 5 * std / math.sqrt(2 * p.numel()), name
