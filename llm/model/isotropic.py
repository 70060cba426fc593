"""Isotropic activation functions (isotropic-deep-learning eq. 13, 16-20).

An isotropic activation acts on the whole vector, not on its coordinates:

    f(v) = sigma(|v|) * v / |v|,   f(0) = 0            (eq. 13)

so it rescales v along its own direction and commutes with every rotation, ``f(Rv) = R f(v)``: no basis
is privileged. Each activation here is written as ``f(v) = v * g(|v|)`` with the ratio
``g(r) = sigma(r) / r`` computed in a form that is finite, and has finite derivatives, at ``r = 0``
(``sigma(r)/r`` itself is 0/0 there). The radius is taken in at least fp32: under bf16 autocast the
norm of an h-vector would otherwise lose most of its digits.

Matched initial scale (``ModelConfig.ffn_init = "matched"``, the default). The activation's input
``v = W_up x`` has, at initialisation, the radius ``r_init = initializer_range * sqrt(d h)``: x follows an
RMSNorm (|x|^2 = d) and each of the h rows of W_up is normal(0, initializer_range^2) (15 at 83m, 31 at
250m). Raw eq. 16 at that radius is a pure L2 normaliser (tanh(15) = 1, sech^2 ~ 1e-12) and an iso-ReLU
with R0 = 1 a 3-7% shrink, so the papers' forms start in a regime that depends on the model size. The
matched form measures radii in units of r_init and rescales the output so that a vector of the initial
radius keeps its norm:

    f(v) = (r_init / sigma(1)) * sigma(|v| / r_init) * v / |v|

i.e. the radial function sees |v|/r_init ~ 1 at every size (tanh(1) = 0.76, sech^2(1) = 0.42: neither
linear nor saturated), R0 and R_cap are fractions of the initial radius, and the activation's output
has the RMS of its input at initialisation, the scale ``linear`` gives. ``paper`` keeps eq. 13-20 as
written (``r_init = 1``, gain 1). Both are isotropic: they differ from eq. 13 by constants only.

``tanh_ratio`` is public because iso-tanh attention (``attention.py``) weights scores by
``tanh(|s|) s/|s| = s * tanh_ratio(|s|)``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .config import ModelConfig


# Below this radius tanh(r)/r is evaluated by its Taylor series 1 - r^2/3 + 2 r^4/15, whose first
# omitted term (17 r^6 / 315 ~ 5e-20) is below fp64 resolution; above it tanh(r)/r is already accurate
# to relative precision because torch.tanh is.
_TANH_SERIES_RADIUS = 1e-3


def tanh_ratio(r: Tensor) -> Tensor:
    """``tanh(r) / r`` for ``r >= 0``, equal to its limit 1 at ``r = 0``, with finite gradients there."""
    small = r < _TANH_SERIES_RADIUS
    # The discarded branch of torch.where still gets a gradient (times 0): keep it away from 0/0.
    r_safe = torch.where(small, torch.ones_like(r), r)
    r2 = r * r
    return torch.where(small, 1 - r2 / 3 + 2 * r2 * r2 / 15, torch.tanh(r_safe) / r_safe)


class RadialActivation(nn.Module):
    """``f(v) = gain * v * ratio(|v| / radius_unit)`` over the last dimension; subclasses define
    ``ratio(r) = sigma(r)/r``. ``radius_unit`` and ``gain`` are 1 for the paper's form; ``scale_to``
    sets them for the matched form (module docstring)."""

    OPTIONS: ClassVar[tuple[str, ...]] = ()
    """The ``ModelConfig`` fields this activation reads (``ModelConfig.validate`` refuses them elsewhere), in the
    order its constructor takes them."""

    radius_unit: float = 1.0
    gain: float = 1.0

    def scale_to(self, initial_radius: float) -> None:
        """Measure radii in units of ``initial_radius`` and preserve the norm of a vector of that radius."""
        self.radius_unit = initial_radius
        self.gain = 1.0 / float(self.ratio(torch.ones((), dtype=torch.float64, device="cpu")))

    def ratio(self, r: Tensor) -> Tensor:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: ModelConfig) -> RadialActivation:
        """Build the activation with its radii from ``config`` (its ``OPTIONS``)."""
        return cls(*(getattr(config, name) for name in cls.OPTIONS))

    def forward(self, v: Tensor) -> Tensor:
        radius_dtype = torch.promote_types(v.dtype, torch.float32)
        r = torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=radius_dtype)
        return v * (self.gain * self.ratio(r / self.radius_unit)).to(v.dtype)


class IsoTanh(RadialActivation):
    """Isotropic tanh (eq. 16): ``sigma(r) = tanh(r)``; bounded by 1 in norm, identity-like near 0."""

    def ratio(self, r: Tensor) -> Tensor:
        return tanh_ratio(r)


class IsoLeakyReLU(RadialActivation):
    """Isotropic leaky ReLU (eq. 20): ``sigma(r) = slope*r`` for ``r < R0``, ``r - (1-slope) R0`` beyond.

    Both pieces are one expression, ``g(r) = 1 - (1-slope) R0 / max(r, R0)``: inside the ball it is
    ``slope``, outside ``1 - (1-slope) R0/r``. The denominator never drops below R0 (or a tiny floor when
    R0 = 0, where the map is the identity), so ``g`` is finite with finite gradients at ``r = 0``.
    """

    OPTIONS = ("iso_r0", "iso_leaky_slope")

    def __init__(self, r0: float, slope: float) -> None:
        super().__init__()
        self.r0 = r0
        self.slope = slope
        self._radius_floor = max(r0, torch.finfo(torch.float32).tiny)

    def ratio(self, r: Tensor) -> Tensor:
        return 1 - (1 - self.slope) * self.r0 / r.clamp_min(self._radius_floor)

    def extra_repr(self) -> str:
        return f"r0={self.r0}, slope={self.slope}"


class IsoReLU(IsoLeakyReLU):
    """Isotropic ReLU (eq. 17): ``sigma(r) = max(r - R0, 0)``, i.e. the leaky form with slope 0."""

    OPTIONS = ("iso_r0",)

    def __init__(self, r0: float) -> None:
        super().__init__(r0, slope=0.0)

    def extra_repr(self) -> str:
        return f"r0={self.r0}"


class IsoCappedReLU(IsoReLU):
    """Capped isotropic ReLU (eq. 18): ``sigma(r) = min(max(r - R0, 0), R_cap)``.

    ``R_cap`` bounds the output norm (the paper's R_inf); the cap is reached at ``r = R0 + R_cap``.
    ``g = min(iso-ReLU ratio, R_cap / max(r, R0 + R_cap))``: clamping the second denominator changes
    nothing (below ``R0 + R_cap`` the first term is the smaller one) but keeps it away from 0.
    """

    OPTIONS = ("iso_r0", "iso_r_cap")

    def __init__(self, r0: float, r_cap: float) -> None:
        super().__init__(r0)
        self.r_cap = r_cap

    def ratio(self, r: Tensor) -> Tensor:
        return torch.minimum(super().ratio(r), self.r_cap / r.clamp_min(self.r0 + self.r_cap))

    def extra_repr(self) -> str:
        return f"r0={self.r0}, r_cap={self.r_cap}"


# ``ModelConfig.iso_activation`` -> radial activation class (each has ``from_config``).
ISO_ACTIVATIONS: dict[str, type[RadialActivation]] = {
    "tanh": IsoTanh, "relu": IsoReLU, "capped_relu": IsoCappedReLU, "leaky_relu": IsoLeakyReLU}


def initial_radius(config: ModelConfig, width: int) -> float:
    """``r_init``: the norm of ``W x`` at initialisation for a ``[width, hidden_size]`` W with entries
    normal(0, hidden_init_std^2) (``initializer_range``, or less under muP) and an RMS-normalised x
    (|x|^2 = hidden_size)."""
    return config.hidden_init_std * math.sqrt(config.hidden_size * width)


def make_iso_activation(config: ModelConfig, width: int) -> RadialActivation:
    """The isotropic activation named by ``config.iso_activation`` for ``width``-vectors, with its radii
    from the config, scale-matched unless ``config.ffn_init == "paper"``."""
    activation = ISO_ACTIVATIONS[config.iso_activation].from_config(config)
    if config.ffn_init == "matched":
        activation.scale_to(initial_radius(config, width))
    return activation
