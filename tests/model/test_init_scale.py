"""Matched initial scale: at initialisation every ``ffn_linear`` choice gives ``linear``'s pre-activation
RMS, and every isotropic activation keeps the RMS of the pre-activation it receives (the scale SwiGLU's
projections give), at each model size; ``ffn_init=paper`` keeps the raw forms, whose scale differs."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from llm.config import load_config
from llm.model.config import ModelConfig
from llm.model.ffn import IsoMLP, resolve_intermediate_size
from llm.model.isotropic import ISO_ACTIVATIONS, initial_radius
from llm.model.linear import LINEAR_REGISTRY, make_linear
from llm.model.modeling_isollm import RMSNorm

SIZES = Path(__file__).resolve().parents[2] / "configs" / "sizes"
TOKENS = 64


def size_config(size: str, **overrides: object) -> ModelConfig:
    """A size preset, parameter-matched as in configs/experiments (the iso_mlp h is 1.5x SwiGLU's)."""
    config = load_config([str(SIZES / f"{size}.yaml")], ["train.max_steps=1", "model.ffn_param_match=true"]).model
    return dataclasses.replace(config, **overrides).validate()


def normalized_inputs(d: int) -> torch.Tensor:
    """Token vectors as an FFN receives them at initialisation: after an RMSNorm with gain 1 (|x|^2 = d)."""
    x = torch.randn(TOKENS, d, generator=torch.Generator().manual_seed(12345))  # independent of the weights
    return RMSNorm(d, 1e-6)(x).detach()


def rms(t: torch.Tensor) -> float:
    return t.pow(2).mean().sqrt().item()


@torch.no_grad()
@pytest.mark.parametrize("size", ["tiny", "83m", "134m", "250m"])
def test_pre_activation_rms_matches_linear_and_swiglu(size: str) -> None:
    base = size_config(size)
    d, h = base.hidden_size, base.intermediate_size
    x = normalized_inputs(d)
    torch.manual_seed(0)
    reference = make_linear(base, d, 2 * h, groups=2)  # SwiGLU's fused [gate; up] projection
    swiglu_rms = rms(reference(x))
    assert swiglu_rms == pytest.approx(base.initializer_range * math.sqrt(d), rel=0.05)

    for name in LINEAR_REGISTRY:  # the same weights under every projection form
        config = dataclasses.replace(base, ffn_linear=name)
        projection = make_linear(config, d, 2 * h, groups=2)
        projection.weight.copy_(reference.weight)
        exact = name != "focus"  # focus matches in expectation (eq. 7: rows of Phi have mean square 1)
        assert rms(projection(x)) == pytest.approx(swiglu_rms, rel=1e-5 if exact else 0.05), name
    paper = make_linear(dataclasses.replace(base, ffn_linear="affine_like", ffn_init="paper"), d, 2 * h, groups=2)
    paper.weight.copy_(reference.weight)
    assert rms(paper(x)) == pytest.approx(swiglu_rms / math.sqrt(d + 1), rel=1e-5)  # eq. 19 as written

    for activation in ISO_ACTIVATIONS:
        config = size_config(size, ffn="iso_mlp", iso_activation=activation)
        torch.manual_seed(0)
        block = IsoMLP(config)
        pre = block.in_proj(x)
        assert rms(pre) == pytest.approx(swiglu_rms, rel=0.05)  # W_up x at SwiGLU's scale
        radius = pre.norm(dim=-1) / initial_radius(config, resolve_intermediate_size(config))
        assert radius.mean().item() == pytest.approx(1.0, rel=0.05)  # radial functions see |v| ~ r_init
        assert rms(block.act(pre)) == pytest.approx(rms(pre), rel=0.05), activation
    paper_tanh = IsoMLP(size_config(size, ffn="iso_mlp", ffn_init="paper"))
    pre = paper_tanh.in_proj(x)
    assert paper_tanh.act(pre).norm(dim=-1).max() <= 1.0 + 1e-6  # raw iso-tanh: a unit-norm normaliser

