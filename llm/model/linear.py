"""Input projections of the FFN blocks (``ModelConfig.ffn_linear``): linear | affine_like | focus.

Every projection keeps nn.Linear's layout (``weight`` is ``[out_features, in_features]``), so a fused
``in_proj`` is split into per-pathway matrices by slicing rows (the stock-Qwen3 export relies on it).
``groups`` says how many equal output blocks the projection fuses; only ``focus`` uses it.

Initialisation: every weight is normal(0, ``initializer_range``), like every other projection of the
model, so that variants differ only in their functional form. For ``focus`` this keeps the effective
weight ``W * Phi`` at the dense neuron's scale because eq. 7 normalises each row of Phi to norm
sqrt(m), i.e. mean square 1; the paper's eq. 10 (uniform with bound sqrt(6)/|phi_j| = sqrt(6/m), a
He-uniform init) would give focus layers a different, width-dependent scale from the baseline's
projections and break the like-for-like comparison.

``affine_like`` divides by the norm of its input, which follows an RMSNorm and so has norm sqrt(d) at
initialisation; under ``ffn_init=matched`` it is multiplied by the constant sqrt(d + 1), the norm of the
augmented input ``[x, 1]`` at initialisation, so that its pre-activations (and the change an update of W
makes to them) start at ``linear``'s scale instead of sqrt(d + 1) times smaller (20x at d = 384).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import initialization as init

if TYPE_CHECKING:
    from .config import ModelConfig


# focusing-neuron Algorithm 3 clips the apertures to [0.01, 1.0] and the centres to [0, 1] after every
# update (``Focus.clip_parameters_``, called by the optimizer's step hook in llm/train/optim.py, or after
# DeepSpeed's step by llm/train/deepspeed_step.py).
FOCUS_SIGMA_RANGE = (0.01, 1.0)
FOCUS_MU_RANGE = (0.0, 1.0)


class Projection(nn.Module):
    """A bias-free ``[out, in]`` weight, normal(0, ``initializer_range``); subclasses add their form."""

    OPTIONS: ClassVar[tuple[str, ...]] = ()
    """The ``ModelConfig`` fields this projection reads besides those of ``LR_MULTIPLIERS``
    (``ModelConfig.validate`` refuses both elsewhere)."""
    LR_MULTIPLIERS: ClassVar[dict[str, str]] = {}
    """Parameter name -> the ``ModelConfig`` field of its learning-rate multiplier (llm/train/optim.py)."""
    NOT_LORA: ClassVar[str] = ""
    """Why LoRA's ``W + B A`` cannot adapt the projection (empty: it can). It is in the repr, which PEFT's refusal of
    a module it cannot adapt prints: "Target module AffineLike(..., no LoRA: ...) is not supported"."""

    def __init__(self, in_features: int, out_features: int, config: ModelConfig, groups: int = 1) -> None:
        nn.Module.__init__(self)  # not nn.Linear's (``Linear`` is one): it would draw the weight a second time
        if groups < 1 or out_features % groups:
            raise ValueError(f"out_features={out_features} must split into groups={groups} equal blocks")
        self.in_features = in_features
        self.out_features = out_features
        self.groups = groups
        self.init_std = config.initializer_range
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.add_form_parameters(config)
        self.reset_parameters()
        # Built on the meta device (from_pretrained) it drew nothing: the model's _init_weights then draws what the
        # checkpoint lacks. Built for real it keeps this draw (a seed gives the weights it always gave).
        self.drew_at_construction = not self.weight.is_meta

    def add_form_parameters(self, config: ModelConfig) -> None:
        """Register the parameters a subclass adds to the weight (uninitialised; see ``reset_parameters``)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def extra_repr(self) -> str:
        refusal = f", no LoRA: {self.NOT_LORA}" if self.NOT_LORA else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}{refusal}"


class Linear(Projection, nn.Linear):
    """``z = W x`` (no bias, as every projection of a Qwen3 decoder): an ``nn.Linear``, so that PEFT's LoRA adapts
    the fused ``in_proj`` (``target_modules="all-linear"`` included) as it adapts Qwen3's gate_proj and up_proj."""

    def add_form_parameters(self, config: ModelConfig) -> None:
        self.register_parameter("bias", None)  # nn.Linear's attribute, None as it is without bias

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class AffineLike(Projection):
    """affine-divergence eq. 19: ``z = (W x + b) / sqrt(|x|^2 + 1)``, with a learned bias b (init 0).

    Dividing weight and bias alike by ``sqrt(|x|^2 + 1)`` (the norm of the augmented input ``[x, 1]``)
    makes the update of z follow the ideal steepest-descent direction (the paper's affine divergence)
    while keeping |x| as information, unlike a normaliser. ``ffn_init=matched`` multiplies z by
    ``sqrt(d + 1)`` (module docstring); ``paper`` keeps eq. 19 as written.
    """

    OPTIONS = ("ffn_init",)
    NOT_LORA = "z = (W x + b) / sqrt(|x|^2 + 1) is not linear in x"

    def add_form_parameters(self, config: ModelConfig) -> None:
        self.bias = nn.Parameter(torch.empty(self.out_features))
        self.scale = math.sqrt(self.in_features + 1) if config.ffn_init == "matched" else 1.0

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        # The squared norm is summed in fp32 at least: bf16 would round |x|^2 over d features badly.
        sq_norm = x.pow(2).sum(dim=-1, keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32))
        return F.linear(x, self.weight, self.bias) * (self.scale * torch.rsqrt(sq_norm + 1)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:g}"


class Focus(Projection):
    """Focusing neurons (focusing-neuron eq. 5-7): effective weight ``W * Phi``, ``Phi`` ``[out, in]``,

        Phi[j, i] = s_j exp(-(tau_i - mu_j)^2 / (2 sigma_j^2)),   tau_i = i/m (i = 1..m),
        s_j = sqrt(m) / |phi_j|                                    (eq. 7, not Algorithm 2's sum)

    so each neuron j sees a Gaussian window of the m inputs centred at ``focus_mu[j]`` with aperture
    ``focus_sigma[j]``, and ``|Phi[j, :]| = sqrt(m)`` exactly. The centres are spread evenly over [0, 1]
    within each of the ``groups`` output blocks, so that each pathway of a fused projection covers
    the whole input. mu and sigma have their own learning-rate multipliers and are clipped after every
    optimizer step (Algorithm 3), so sigma stays > 0 without a clamp that would block its gradient.
    """

    OPTIONS = ("focus_sigma_init",)
    NOT_LORA = "the effective weight W * Phi would mask a merged W + B A, unlike the unmerged B A x"
    LR_MULTIPLIERS: ClassVar[dict[str, str]] = {"focus_mu": "focus_mu_lr_mult", "focus_sigma": "focus_sigma_lr_mult"}
    CLIP_RANGES: ClassVar[dict[str, tuple[float, float]]] = {"focus_mu": FOCUS_MU_RANGE,
                                                             "focus_sigma": FOCUS_SIGMA_RANGE}
    """Parameter name -> the range Algorithm 3 clips it to after every update (``clip_parameters_``; under
    DeepSpeed, llm/train/deepspeed_step.py clips the engine's fp32 copies with the same ranges)."""

    def add_form_parameters(self, config: ModelConfig) -> None:
        self.sigma_init = config.focus_sigma_init
        self.focus_mu = nn.Parameter(torch.empty(self.out_features))
        self.focus_sigma = nn.Parameter(torch.empty(self.out_features))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        block = self.out_features // self.groups
        # Midpoints of `block` equal cells of [0, 1]: even spacing without piling up on the borders.
        centres = (torch.arange(block, device=self.focus_mu.device, dtype=torch.float32) + 0.5) / block
        init.copy_(self.focus_mu, centres.repeat(self.groups))  # transformers' init: a loaded value is kept
        nn.init.constant_(self.focus_sigma, self.sigma_init)

    def focus_coefficients(self) -> Tensor:
        """Phi ``[out, in]`` of eq. 6-7 for the current ``focus_mu`` / ``focus_sigma``.

        With ``d_ji = (tau_i - mu_j)^2 / (2 sigma_j^2)``, eq. 7 gives
        ``Phi_ji = sqrt(m) exp(-d_ji) / sqrt(sum_i exp(-2 d_ji))
                 = sqrt(m) exp(-d_ji - logsumexp_i(-2 d_ji) / 2)``.
        The log-sum-exp form stays finite when a centre drifts far from every input and all the
        Gaussian values underflow (the literal quotient would be 0/0).
        """
        m = self.in_features
        mu = self.focus_mu
        tau = torch.arange(1, m + 1, device=mu.device, dtype=mu.dtype) / m
        dist = (tau[None, :] - mu[:, None]).pow(2) / (2 * self.focus_sigma[:, None].pow(2))
        return math.sqrt(m) * torch.exp(-dist - 0.5 * torch.logsumexp(-2 * dist, dim=1, keepdim=True))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight * self.focus_coefficients().to(self.weight.dtype))

    @torch.no_grad()
    def clip_parameters_(self) -> None:
        """Algorithm 3's ``clip(sigma, 0.01, 1.0)`` and ``clip(mu, 0, 1)``, in place."""
        for name, bounds in self.CLIP_RANGES.items():
            getattr(self, name).clamp_(*bounds)


# ``ModelConfig.ffn_linear`` -> projection class, built ``(in_features, out_features, config, groups)``.
LINEAR_REGISTRY: dict[str, type[Projection]] = {"linear": Linear, "affine_like": AffineLike, "focus": Focus}


def make_linear(config: ModelConfig, in_features: int, out_features: int, groups: int = 1) -> Projection:
    """The FFN input projection named by ``config.ffn_linear``."""
    return LINEAR_REGISTRY[config.ffn_linear](in_features, out_features, config, groups)
