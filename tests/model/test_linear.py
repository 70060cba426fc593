"""FFN input projections: linear | affine_like (affine-divergence eq. 19) | focus (focusing-neuron eq. 5-7)"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from llm.model.config import ModelConfig
from llm.model.linear import FOCUS_MU_RANGE, FOCUS_SIGMA_RANGE, LINEAR_REGISTRY, AffineLike, Focus, Linear, make_linear

CONFIG = ModelConfig(hidden_size=32, intermediate_size=64, focus_sigma_init=0.1, initializer_range=0.02)


def test_registry_keys_are_the_config_choices():
    assert set(LINEAR_REGISTRY) == {"linear", "affine_like", "focus"}
    for name, cls in LINEAR_REGISTRY.items():
        proj = make_linear(ModelConfig(ffn_linear=name), 16, 24)
        assert type(proj) is cls


@pytest.mark.parametrize("name", sorted(LINEAR_REGISTRY))
def test_shapes_layout_and_init(name):
    torch.manual_seed(0)
    proj = LINEAR_REGISTRY[name](256, 384, CONFIG, groups=3)
    assert proj.weight.shape == (384, 256)  # nn.Linear's [out, in] layout: fused blocks are row slices
    assert abs(proj.weight.std().item() - CONFIG.initializer_range) < 1e-3
    out = proj(torch.randn(2, 5, 256))
    assert out.shape == (2, 5, 384)
    with pytest.raises(ValueError, match="groups=5"):
        LINEAR_REGISTRY[name](16, 24, CONFIG, groups=5)


def test_linear_is_a_bias_free_matmul():
    proj = Linear(16, 24, CONFIG).double()
    assert [n for n, _ in proj.named_parameters()] == ["weight"]
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(proj(x), x @ proj.weight.T, rtol=0, atol=0)


@pytest.mark.parametrize("init", ["paper", "matched"])
def test_affine_like_equals_eq_19(init):
    """paper: eq. 19 as written; matched: eq. 19 times sqrt(d + 1), the augmented input's norm at init."""
    proj = AffineLike(16, 24, dataclasses.replace(CONFIG, ffn_init=init)).double()
    scale = 1.0 if init == "paper" else math.sqrt(17)
    assert torch.equal(proj.bias, torch.zeros(24, dtype=torch.float64))  # bias starts at 0
    with torch.no_grad():
        proj.bias.normal_()
    scales = torch.tensor([[0.0], [0.1], [1.0], [30.0]], dtype=torch.float64)  # includes x = 0
    x = torch.randn(4, 16, dtype=torch.float64) * scales
    expected = torch.stack([scale * (proj.weight @ xi + proj.bias) / math.sqrt(xi.dot(xi).item() + 1)
                            for xi in x])
    torch.testing.assert_close(proj(x), expected, rtol=1e-14, atol=1e-15)


def randomize_focus(proj: Focus, generator: torch.Generator) -> None:
    with torch.no_grad():
        proj.focus_mu.uniform_(-0.5, 1.5, generator=generator)
        proj.focus_sigma.uniform_(FOCUS_SIGMA_RANGE[0], 0.5, generator=generator)


def test_focus_coefficients_have_norm_sqrt_m():
    """eq. 7: every neuron's coefficient vector has the norm of a dense neuron's, sqrt(m)."""
    gen = torch.Generator().manual_seed(0)
    m = 96
    proj = Focus(m, 60, CONFIG).double()
    randomize_focus(proj, gen)
    with torch.no_grad():
        proj.focus_mu[:3] = torch.tensor([7.0, -5.0, 0.5], dtype=torch.float64)  # far outside: all underflow
        proj.focus_sigma[:3] = FOCUS_SIGMA_RANGE[0]
    phi = proj.focus_coefficients()
    assert phi.shape == (60, m) and (phi >= 0).all()
    torch.testing.assert_close(phi.norm(dim=1), torch.full((60,), math.sqrt(m), dtype=torch.float64),
                               rtol=0, atol=1e-10)


def test_focus_coefficients_equal_eq_6_7():
    gen = torch.Generator().manual_seed(1)
    m, n = 40, 12
    proj = Focus(m, n, CONFIG).double()
    with torch.no_grad():  # windows that do not underflow, so the literal formula is exact
        proj.focus_mu.uniform_(0.0, 1.0, generator=gen)
        proj.focus_sigma.uniform_(0.05, 0.5, generator=gen)
    expected = torch.empty(n, m, dtype=torch.float64)
    for j in range(n):
        mu, sigma = proj.focus_mu[j].item(), proj.focus_sigma[j].item()
        window = [math.exp(-((i / m - mu) ** 2) / (2 * sigma**2)) for i in range(1, m + 1)]  # eq. 6, s=1
        s = math.sqrt(m) / math.sqrt(sum(w * w for w in window))  # eq. 7
        expected[j] = torch.tensor([s * w for w in window], dtype=torch.float64)
    torch.testing.assert_close(proj.focus_coefficients(), expected, rtol=1e-13, atol=1e-15)
    x = torch.randn(5, m, dtype=torch.float64)
    torch.testing.assert_close(proj(x), x @ (proj.weight * expected).T, rtol=1e-13, atol=1e-15)


def test_focus_init_spreads_centres_per_group():
    proj = Focus(32, 3 * 8, CONFIG, groups=3)
    block = (torch.arange(8) + 0.5) / 8  # midpoints of 8 equal cells of [0, 1]
    torch.testing.assert_close(proj.focus_mu.detach(), block.repeat(3))
    assert torch.equal(proj.focus_sigma.detach(), torch.full((24,), CONFIG.focus_sigma_init))
    names = [n for n, _ in proj.named_parameters()]
    assert any(n.endswith("focus_mu") for n in names) and any(n.endswith("focus_sigma") for n in names)


def test_focus_parameters_get_finite_gradients():
    gen = torch.Generator().manual_seed(2)
    proj = Focus(32, 24, CONFIG)
    randomize_focus(proj, gen)
    with torch.no_grad():
        proj.focus_mu[0] = 9.0  # a centre far from every input must not produce NaN gradients
    x = torch.randn(4, 32, generator=gen)
    proj(x).pow(2).sum().backward()
    for p in (proj.weight, proj.focus_mu, proj.focus_sigma):
        assert p.grad is not None and torch.isfinite(p.grad).all()
    assert proj.focus_mu.grad.abs().sum() > 0 and proj.focus_sigma.grad.abs().sum() > 0


def test_focus_clips_mu_and_sigma_after_a_step_not_in_forward():
    """Algorithm 3: clip(sigma, 0.01, 1.0) and clip(mu, 0, 1) after each update. The forward pass does not
    clamp, so a sigma below 0.01 still has a gradient that can move it back."""
    proj = Focus(256, 4, CONFIG).double()
    with torch.no_grad():
        proj.focus_mu.copy_(torch.tensor([0.5, -0.3, 1.7, 0.2], dtype=torch.float64))
        proj.focus_sigma.copy_(torch.tensor([0.005, 0.3, 2.0, 0.05], dtype=torch.float64))
    proj(torch.randn(3, 256, dtype=torch.float64)).pow(2).sum().backward()
    assert proj.focus_sigma.grad[0] != 0
    proj.clip_parameters_()
    assert proj.focus_sigma.tolist() == [FOCUS_SIGMA_RANGE[0], 0.3, FOCUS_SIGMA_RANGE[1], 0.05]
    assert proj.focus_mu.tolist() == [0.5, FOCUS_MU_RANGE[0], FOCUS_MU_RANGE[1], 0.2]
