"""Isotropic activations (isotropic-deep-learning eq. 13, 16-20): equivariance, paper formulas, f(0)."""

from __future__ import annotations

import math

import pytest
import torch

from llm.model.config import ModelConfig
from llm.model.isotropic import (
    ISO_ACTIVATIONS,
    IsoCappedReLU,
    IsoLeakyReLU,
    IsoReLU,
    IsoTanh,
    make_iso_activation,
    tanh_ratio,
)

R0, R_CAP, SLOPE = 1.0, 3.0, 0.1
CONFIG = ModelConfig(iso_r0=R0, iso_r_cap=R_CAP, iso_leaky_slope=SLOPE)

# The paper's sigma(r) for each activation, written independently of the implementation.
PAPER_SIGMA = {
    "tanh": math.tanh,  # eq. 16
    "relu": lambda r: max(r - R0, 0.0),  # eq. 17
    "capped_relu": lambda r: min(max(r - R0, 0.0), R_CAP),  # eq. 18
    "leaky_relu": lambda r: SLOPE * r if r < R0 else r - (1 - SLOPE) * R0,  # eq. 20
}
# sigma'(0) = the Jacobian of f at 0 divided by the identity.
SLOPE_AT_ZERO = {"tanh": 1.0, "relu": 0.0, "capped_relu": 0.0, "leaky_relu": SLOPE}
# Inside R0, just outside, far outside, beyond the cap (R0 + R_CAP = 4), and tiny radii.
RADII = [1e-9, 1e-4, 2e-3, 0.3, 0.999, 1.0, 1.5, 2.5, 3.99, 4.0, 4.5, 10.0, 100.0]


def random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))  # Haar-distributed


def test_registry_keys_are_the_config_choices():
    assert set(ISO_ACTIVATIONS) == {"tanh", "relu", "capped_relu", "leaky_relu"}


@pytest.mark.parametrize("init", ["paper", "matched"])
@pytest.mark.parametrize("name", sorted(ISO_ACTIVATIONS))
def test_rotation_equivariance(name, init):
    gen = torch.Generator().manual_seed(0)
    n = 48
    radii = {"iso_r0": 0.5} if init == "matched" else {}  # matched radii are fractions of the initial one
    act = make_iso_activation(ModelConfig(**{**vars(CONFIG), "iso_activation": name, "ffn_init": init, **radii}), n)
    directions = torch.randn(len(RADII), n, generator=gen, dtype=torch.float64)
    x = directions / directions.norm(dim=-1, keepdim=True) * torch.tensor(RADII, dtype=torch.float64)[:, None]
    for _ in range(3):
        rot = random_orthogonal(n, gen)
        torch.testing.assert_close(act(x @ rot.T), act(x) @ rot.T, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(ISO_ACTIVATIONS))
def test_sigma_matches_the_paper_formula(name):
    act = ISO_ACTIVATIONS[name].from_config(CONFIG)
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(16, generator=gen, dtype=torch.float64)
    u = u / u.norm()
    for r in RADII:
        expected = PAPER_SIGMA[name](r) * u  # f(r u) = sigma(r) u: same direction, paper's magnitude
        torch.testing.assert_close(act(r * u), expected, rtol=1e-13, atol=1e-15, msg=f"{name} at r={r}")


@pytest.mark.parametrize("name", sorted(ISO_ACTIVATIONS))
def test_zero_maps_to_zero_with_finite_jacobian(name):
    act = ISO_ACTIVATIONS[name].from_config(CONFIG)
    zero = torch.zeros(2, 8, dtype=torch.float64, requires_grad=True)
    out = act(zero)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.isfinite(zero.grad).all()
    jac = torch.autograd.functional.jacobian(act, torch.zeros(8, dtype=torch.float64))
    torch.testing.assert_close(jac, SLOPE_AT_ZERO[name] * torch.eye(8, dtype=torch.float64))


@pytest.mark.parametrize("act", [IsoReLU(0.0), IsoLeakyReLU(0.0, 0.3), IsoCappedReLU(0.0, 2.0)])
def test_zero_threshold_is_identity_near_zero(act):
    """R0 = 0 makes iso-ReLU the identity (up to the cap): no 0/0 at the origin."""
    x = torch.tensor([[0.0, 0.0], [0.3, -0.4]], dtype=torch.float64, requires_grad=True)
    out = act(x)
    torch.testing.assert_close(out, x.detach())
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def test_tanh_ratio_values_and_gradients():
    r = torch.cat([torch.zeros(1), torch.logspace(-8, 2, 200)]).double().requires_grad_()
    g = tanh_ratio(r)
    exact = torch.where(r > 0, torch.tanh(r) / r, torch.ones_like(r))
    torch.testing.assert_close(g, exact.detach(), rtol=4e-16, atol=0)
    (grad,) = torch.autograd.grad(g.sum(), r)
    assert torch.isfinite(grad).all() and grad[0] == 0
    # d/dr tanh(r)/r = (r sech^2 r - tanh r) / r^2, whose Taylor series is -2r/3 + 8r^3/15 - 34r^5/105.
    rd = r.detach()
    analytic = torch.where(rd > 1e-3, (rd / torch.cosh(rd) ** 2 - torch.tanh(rd)) / rd**2,
                           -2 * rd / 3 + 8 * rd**3 / 15 - 34 * rd**5 / 105)
    torch.testing.assert_close(grad, analytic, rtol=1e-9, atol=1e-12)


def test_tanh_ratio_continuous_at_series_switch():
    r = torch.tensor([1e-3 * (1 - 1e-12), 1e-3, 1e-3 * (1 + 1e-12)], dtype=torch.float64)
    g = tanh_ratio(r)
    assert (g.max() - g.min()).item() < 1e-15


def test_iso_tanh_bounded_and_bf16():
    """Radii from 0.1 to 50, through tanh's curved range (a plain normaliser v/|v| would fail there)."""
    direction = torch.nn.functional.normalize(torch.randn(64, 64, dtype=torch.float64), dim=-1)
    radii = torch.logspace(-1, math.log10(50), 64, dtype=torch.float64)[:, None]
    x = direction * radii
    expected = torch.tanh(radii) * direction  # eq. 16: |f(v)| = tanh(|v|) along v
    torch.testing.assert_close(IsoTanh()(x), expected, rtol=1e-12, atol=1e-15)
    assert (IsoTanh()(x.float()).norm(dim=-1) <= 1 + 1e-6).all()
    out_bf16 = IsoTanh()(x.bfloat16())
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16.double(), expected, rtol=2**-7, atol=2**-9)  # bf16's rounding


def test_make_iso_activation_reads_the_config():
    paper = ModelConfig(iso_activation="capped_relu", iso_r0=0.5, iso_r_cap=2.0, ffn_init="paper")
    act = make_iso_activation(paper, 64)
    assert isinstance(act, IsoCappedReLU) and (act.r0, act.r_cap) == (0.5, 2.0)
    assert (act.radius_unit, act.gain) == (1.0, 1.0)
    leaky = make_iso_activation(ModelConfig(iso_activation="leaky_relu", iso_r0=2.0, iso_leaky_slope=0.25,
                                            ffn_init="paper"), 64)
    assert isinstance(leaky, IsoLeakyReLU) and (leaky.r0, leaky.slope) == (2.0, 0.25)


@pytest.mark.parametrize("name", sorted(ISO_ACTIVATIONS))
def test_matched_form_measures_radii_in_the_initial_norm_and_keeps_it(name):
    """matched: f(v) = (r_init / sigma(1)) sigma(|v| / r_init) v/|v|, r_init = initializer_range sqrt(d h)."""
    config = ModelConfig(**{**vars(CONFIG), "iso_activation": name, "iso_r0": 0.5, "iso_r_cap": 1.0,
                            "hidden_size": 64, "initializer_range": 0.02})
    h = 96
    act = make_iso_activation(config, h)
    r_init = 0.02 * math.sqrt(64 * h)
    sigma = {"tanh": math.tanh, "relu": lambda r: max(r - 0.5, 0.0),
             "capped_relu": lambda r: min(max(r - 0.5, 0.0), 1.0),
             "leaky_relu": lambda r: SLOPE * r if r < 0.5 else r - (1 - SLOPE) * 0.5}[name]
    gen = torch.Generator().manual_seed(3)
    direction = torch.randn(h, generator=gen, dtype=torch.float64)
    direction /= direction.norm()
    for radius in (0.1, 0.7, 1.0, 1.3, 4.0):
        out = act(direction * radius * r_init)
        expected = r_init / sigma(1.0) * sigma(radius) * direction
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(act(direction * r_init).norm().item(), r_init)  # the initial radius is kept
