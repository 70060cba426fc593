"""Feed-forward blocks (``ModelConfig.ffn``): swiglu | isogmlp | iso_ln | iso_mlp, and parameter matching.

Every block has one fused input projection ``in_proj = make_linear(config, d, k*h, groups=k)`` that computes
all k input pathways of the variant in a single matmul (rows in the order of ``projection_names``, e.g.
swiglu's ``[gate; up]``, which the stock-Qwen3 export splits back into ``gate_proj`` / ``up_proj``), mixes
them into an h-vector, and maps it back with ``down_proj`` (a plain bias-free nn.Linear h -> d). Each
variant's ``forward`` is its equation, with d the hidden size and x one token's vector:

    swiglu   W_down( SiLU(W_g x) * (W_u x) )
    isogmlp  W_down( alpha*Gated + (1-alpha)*Iso ),  Iso = gamma*(W_i x) + beta, alpha = sigmoid(...)
    iso_ln   W_down( alpha*Gated + (2-alpha)*LayerNorm(W_i x) + beta ),  alpha in [0.5, 2], |beta| <= 0.1
    iso_mlp  W_down( f(W_up x) ),  f an isotropic activation (isotropic.py)

The two-pathway blocks mix with as few passes over the ``[B, T, h]`` activations as their formula allows
(one ``lerp`` / ``addcmul``, the LayerNorm's affine), which keeps them near SwiGLU's speed
(bench/bench_train_step.py). Their ``diagnostics`` reuse ``pathways``, the computation ``forward`` mixes.

``forward(x, cache, padding_mask, doc_starts)`` takes ``x`` ``[B, T, d]``; ``cache`` is None in training and,
in generation, one dict per layer that persists across steps (only isogmlp's ``causal_mean`` gate keeps state
in it, and only it reads ``padding_mask``, ``[B, T]`` True at real tokens, None when all are real, and
``doc_starts``, ``[B, T]`` True at the first token of each packed document, None for one document per row:
every other block is per-token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import ConfigError
from .isotropic import make_iso_activation
from .layout import document_start_index
from .linear import make_linear

if TYPE_CHECKING:
    from .config import ModelConfig

Cache = dict[str, Any]


class FeedForward(nn.Module):
    """Base block: the fused ``in_proj``, ``down_proj``, and what parameter matching and the optimizer read.

    ``intermediate_size`` is h; None resolves it from the config (``ffn_param_match`` shrinks it so the
    block has SwiGLU's parameter count). Parameter matching itself builds blocks with an explicit h.
    Subclasses define ``forward(x, cache=None, padding_mask=None, doc_starts=None)`` (module docstring).
    """

    PROJECTIONS: ClassVar[tuple[str, ...]]
    """The fused input projections, in the row order of ``in_proj.weight``."""
    OPTIONS: ClassVar[tuple[str, ...]] = ()
    """The ``ModelConfig`` fields this variant reads besides those of ``LR_MULTIPLIERS`` (``ModelConfig.validate``
    refuses both elsewhere)."""
    LR_MULTIPLIERS: ClassVar[dict[str, str]] = {}
    """Parameter name (relative to the block) -> the ``ModelConfig`` field of its learning-rate multiplier;
    such parameters get their own optimizer group without weight decay (llm/train/optim.py)."""
    MUP_SCALED: ClassVar[tuple[str, ...]] = ("in_proj.weight", "down_proj.weight")
    """The hidden matrices, whose init and lr muP scales with width (``modeling_isollm.mup_scaled_parameters``)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        if intermediate_size is None:
            intermediate_size = _matched_intermediate_size(type(self), config)
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size
        self.init_std = config.initializer_range
        self.projections = self.projection_names(config)
        k = len(self.projections)
        self.in_proj = make_linear(config, config.hidden_size, k * intermediate_size, groups=k)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        nn.init.normal_(self.down_proj.weight, std=self.init_std)
        self.drew_at_construction = not self.down_proj.weight.is_meta  # see Projection

    def projection_names(self, config: ModelConfig) -> tuple[str, ...]:
        """Names of the pathways fused into ``in_proj`` (its row blocks, in order)."""
        return self.PROJECTIONS

    def fused_parts(self) -> dict[str, list[int]]:
        """The row blocks of ``in_proj.weight``, one per pathway (``projections``), which an optimizer that
        orthogonalises matrices (llm/train/optim.py, Muon) treats apart."""
        return {"in_proj.weight": [self.intermediate_size] * len(self.projections)}

    def reset_parameters(self) -> None:
        """Re-initialise the block as its constructor does (e.g. after building on the meta device)."""
        self.in_proj.reset_parameters()
        nn.init.normal_(self.down_proj.weight, std=self.init_std)

    def diagnostics(self, x: Tensor) -> dict[str, float]:
        """Learned mixing statistics on the block input ``x``; none for single-pathway blocks."""
        return {}

    def extra_repr(self) -> str:
        return f"intermediate_size={self.intermediate_size}, projections={self.projections}"


class SwiGLU(FeedForward):
    """``W_down( SiLU(W_g x) * (W_u x) )``, the Qwen3 baseline (isogmlp eq. 1 is its gated pathway)."""

    PROJECTIONS = ("gate", "up")

    def forward(self, x: Tensor, cache: Cache | None = None, padding_mask: Tensor | None = None,
                doc_starts: Tensor | None = None) -> Tensor:
        gate, up = self.in_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class IsoMLP(FeedForward):
    """``W_down( f(W_up x) )`` with f an isotropic activation on the whole h-vector
    (isotropic-deep-learning eq. 13).

    Rotation-equivariant: ``W_up -> R W_up``, ``W_down -> W_down R^T`` leaves the block unchanged
    (isotropic-deep-learning eq. 15), so no hidden basis direction is privileged.
    """

    PROJECTIONS = ("up",)
    OPTIONS = ("iso_activation", "ffn_init")

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__(config, intermediate_size)
        self.act = make_iso_activation(config, self.intermediate_size)

    def forward(self, x: Tensor, cache: Cache | None = None, padding_mask: Tensor | None = None,
                doc_starts: Tensor | None = None) -> Tensor:
        return self.down_proj(self.act(self.in_proj(x)))


def _widened(t: Tensor | float) -> Tensor:
    """``t`` in at least fp32, for statistics (fp64 stays fp64)."""
    t = torch.as_tensor(t)
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _rms(t: Tensor) -> Tensor:
    return _widened(t).pow(2).mean().sqrt()


def mixing_diagnostics(alpha: Tensor, beta: Tensor, weighted_gated: Tensor,
                       weighted_iso: Tensor | None) -> dict[str, float]:
    """A two-pathway block's ``diagnostics``: ``alpha`` (mean over tokens), ``beta`` (mean over channels for
    isogmlp's vector) and ``pathway_ratio`` = RMS of the weighted gated contribution / RMS of the weighted
    isotropy one (absent when the isotropy pathway is ablated: ``weighted_iso`` None)."""
    stats = {"alpha": _widened(alpha).mean().item(), "beta": _widened(beta).mean().item()}
    if weighted_iso is not None:
        stats["pathway_ratio"] = (_rms(weighted_gated) / _rms(weighted_iso)).item()
    return stats


class GateReadout(nn.Module):
    """``w_a . s + b_a``: ``weight`` ``[1, n]`` and ``bias`` ``[1]``, nn.Linear's layout and state-dict keys, weight
    normal(0, ``init_std``) and bias 0.

    Not an nn.Linear, so that PEFT's ``target_modules="all-linear"`` adapts exactly what it adapts in a Qwen3 of the
    same shape, which has no such readout (``TokenGate`` reads ``weight`` in one vecdot, so an adapter on it would
    never train). Naming it in ``target_modules`` is PEFT's "Target module GateReadout(..., no LoRA: ...) is not
    supported". transformers' init draws every nn.Linear again after construction; so does this readout's
    (``drew_at_construction`` False, see ``IsoLLMPreTrainedModel._init_weights``), so that a seed gives the weights it
    gave when the readout was an nn.Linear."""

    drew_at_construction = False

    def __init__(self, in_features: int, init_std: float) -> None:
        super().__init__()
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(1, in_features))
        self.bias = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        nn.init.zeros_(self.bias)

    def forward(self, s: Tensor) -> Tensor:
        return F.linear(s, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, no LoRA: the alpha gate's 1-output readout, absent from Qwen3"


class AlphaGate(nn.Module):
    """IsoGMLP's mixing weight ``alpha = sigmoid(logit)`` per token, ``[B, T, 1]`` (isogmlp eq. 3).

    ``proj`` is ``w_a . s + b_a`` on a per-token summary s of x (its width: ``summary_size``); weight
    normal(0, initializer_range) and bias 0, so alpha starts near 1/2, an even mix of the pathways.
    """

    def __init__(self, config: ModelConfig, summary_size: int) -> None:
        super().__init__()
        self.proj = GateReadout(summary_size, config.initializer_range)

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()

    def logit(self, x: Tensor, cache: Cache | None, padding_mask: Tensor | None = None,
              doc_starts: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor, cache: Cache | None = None, padding_mask: Tensor | None = None,
                doc_starts: Tensor | None = None) -> Tensor:
        return torch.sigmoid(self.logit(x, cache, padding_mask, doc_starts)).to(x.dtype)


class TokenGate(AlphaGate):
    """``alpha_t = sigmoid(w_a . x_t + b_a)``: the token's own vector (the causal reading of eq. 3)."""

    MUP_SCALED: ClassVar[tuple[str, ...]] = ("proj.weight",)
    """A width -> 1 readout: Adam moves each weight by about lr and the moves line up with x, so the logit moves
    by about width * lr per step. muP scales its lr by 1/m (Tensor Programs V, Table 3, output weights) and
    its init std by 1/sqrt(m), which keeps the initial logit's spread what it is at the base width; it stays in
    the mixing lr group (``mixing_mup``). ``FeatureMeanGate``'s 1 -> 1 ``proj`` reads a mean, the same size at
    every width: not scaled."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, config.hidden_size)

    def logit(self, x: Tensor, cache: Cache | None, padding_mask: Tensor | None = None,
              doc_starts: Tensor | None = None) -> Tensor:
        # w_a . x + b_a as one reduction over d (compiled: one kernel reading x once), not nn.Linear's GEMM with
        # N = 1, which fills no tensor core; in x's dtype, fp32 for the autocast residual stream.
        return torch.linalg.vecdot(x, self.proj.weight[0].to(x.dtype)).unsqueeze(-1) + self.proj.bias


class CausalMeanGate(TokenGate):
    """``alpha_t = sigmoid(w_a . mean_{s<=t} x_s + b_a)``: eq. 3's ``mean(x)`` over the visible prefix.

    A mean over the whole sequence would let a token see its future. As the projection is affine,
    ``w_a . mean(x) + b_a = mean(w_a . x + b_a)``: we project first and take the running mean of a
    scalar (in fp32, fp64 kept). In generation the running sum and the number of positions seen live in ``cache``.
    Padded positions are left out of both, so a padded row's means are those of its real tokens alone, and a
    packed document's means start at its first token, so they are those of the document alone.
    """

    SUM_KEY = "ffn_alpha_logit_sum"
    COUNT_KEY = "ffn_alpha_positions"

    def logit(self, x: Tensor, cache: Cache | None, padding_mask: Tensor | None = None,
              doc_starts: Tensor | None = None) -> Tensor:
        logit = _widened(super().logit(x, cache))
        if padding_mask is None:  # every position is real: position t has seen t + 1, no mask to apply or sum
            positions = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=logit.dtype)[:, None]
        else:
            real = padding_mask[..., None].to(logit.dtype)
            logit, positions = logit * real, real.cumsum(dim=1)
        running_sum = logit.cumsum(dim=1)
        if doc_starts is not None:  # packed documents: each restarts its mean at its first token
            start = document_start_index(doc_starts)  # [B, T]
            running_sum = running_sum - (running_sum - logit).gather(1, start[..., None])
            positions = (torch.arange(x.shape[1], device=x.device) - start + 1)[..., None].to(logit.dtype)
        if cache is not None:
            if self.SUM_KEY in cache:
                running_sum = running_sum + cache[self.SUM_KEY]
                positions = positions + cache[self.COUNT_KEY]
            kept = {self.SUM_KEY: running_sum[:, -1:], self.COUNT_KEY: positions.expand_as(running_sum)[:, -1:]}
            for key, value in kept.items():  # per row (beam search reorders it); the gate's own state, passed to
                if key in cache:  # it, is advanced in place once kept (cache.LayerState)
                    cache[key].copy_(value)
                else:
                    cache[key] = value.clone(memory_format=torch.contiguous_format)
        return running_sum / positions.clamp_min(1)  # a row's leading padding has seen nothing: 0/1


class FeatureMeanGate(AlphaGate):
    """``alpha_t = sigmoid(w * mean_i x_t,i + b)`` with scalar w, b: eq. 3's mean taken over features."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, 1)

    def logit(self, x: Tensor, cache: Cache | None, padding_mask: Tensor | None = None,
              doc_starts: Tensor | None = None) -> Tensor:
        return self.proj(x.mean(dim=-1, keepdim=True))


# ``ModelConfig.isogmlp_gate`` -> alpha gate class.
ISOGMLP_GATES: dict[str, type[AlphaGate]] = {
    "token": TokenGate, "causal_mean": CausalMeanGate, "feature_mean": FeatureMeanGate}


class IsoGMLP(FeedForward):
    """isogmlp eq. 1-4: ``W_down( alpha*Gated + (1-alpha)*Iso )``, ``Iso = gamma*(W_i x) + beta``.

    gamma, beta are per-channel in R^h (init 1 and 0); alpha comes from ``config.isogmlp_gate``.
    """

    PROJECTIONS = ("gate", "up", "iso")
    OPTIONS = ("isogmlp_gate",)
    LR_MULTIPLIERS: ClassVar[dict[str, str]] = {name: "mixing_lr_mult" for name in
                      ("gamma", "beta", "alpha_gate.proj.weight", "alpha_gate.proj.bias")}

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__(config, intermediate_size)
        self.gamma = nn.Parameter(torch.ones(self.intermediate_size))
        self.beta = nn.Parameter(torch.zeros(self.intermediate_size))
        self.alpha_gate = ISOGMLP_GATES[config.isogmlp_gate](config)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.ones_(self.gamma)
        nn.init.zeros_(self.beta)
        self.alpha_gate.reset_parameters()

    def pathways(self, x: Tensor, cache: Cache | None = None, padding_mask: Tensor | None = None,
                 doc_starts: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(Gated, Iso, alpha)``: the two pathways, unweighted, and the gated one's weight ``[B, T, 1]``."""
        gate, up, projected = self.in_proj(x).split(self.intermediate_size, dim=-1)
        gated = F.silu(gate) * up  # eq. 1
        iso = torch.addcmul(self.beta, self.gamma, projected).to(gated.dtype)  # eq. 2: gamma*(W_i x) + beta
        return gated, iso, self.alpha_gate(x, cache, padding_mask, doc_starts)  # eq. 3

    def forward(self, x: Tensor, cache: Cache | None = None, padding_mask: Tensor | None = None,
                doc_starts: Tensor | None = None) -> Tensor:
        gated, iso, alpha = self.pathways(x, cache, padding_mask, doc_starts)
        # eq. 4, alpha*Gated + (1-alpha)*Iso, in one lerp. lerp wants one dtype: under autocast the pathways
        # are bf16 and alpha fp32; alpha is rounded rather than the pathways promoted, which would save two
        # fp32 [B, T, h] copies for the backward pass.
        return self.down_proj(torch.lerp(iso, gated, alpha.to(gated.dtype)))

    @torch.no_grad()
    def diagnostics(self, x: Tensor) -> dict[str, float]:
        gated, iso, alpha = self.pathways(x)
        return mixing_diagnostics(alpha, self.beta, alpha * gated, (1 - alpha) * iso)


class IsoLN(FeedForward):
    """isotropy-ln-pathway sec. 3.1-3.3 (it numbers no equations): ``W_down( alpha*Gated + (2-alpha)*Iso + beta )``,
    ``Iso = LayerNorm(W_i x)``.

    ``alpha = 0.5 + 1.5*sigmoid(alpha_raw)`` in [0.5, 2] and ``beta = 0.1*tanh(beta_raw)`` in
    [-0.1, 0.1], learned scalars per layer (raw init 0: alpha 1.25, beta 0). Ablations:
    ``iso_ln_alpha`` fixes alpha (no ``alpha_raw`` parameter), ``iso_ln_layernorm: false`` uses
    ``W_i x`` as is, ``iso_ln_pathway: false`` drops ``W_i`` and the pathway: ``W_down(alpha*Gated + beta)``.
    Ablated parts create no parameters, so distributed training sees no unused ones.
    """

    OPTIONS = ("iso_ln_alpha", "iso_ln_layernorm", "iso_ln_pathway")
    LR_MULTIPLIERS: ClassVar[dict[str, str]] = {"alpha_raw": "mixing_lr_mult", "beta_raw": "mixing_lr_mult"}

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__(config, intermediate_size)
        self.fixed_alpha = config.iso_ln_alpha or None
        if self.fixed_alpha is None:
            self.alpha_raw = nn.Parameter(torch.zeros(()))
        self.beta_raw = nn.Parameter(torch.zeros(()))
        self.has_iso_pathway = config.iso_ln_pathway
        if self.has_iso_pathway:
            self.iso_norm = (nn.LayerNorm(self.intermediate_size, eps=config.rms_norm_eps)
                             if config.iso_ln_layernorm else nn.Identity())

    def projection_names(self, config: ModelConfig) -> tuple[str, ...]:
        return ("gate", "up", "iso") if config.iso_ln_pathway else ("gate", "up")

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.fixed_alpha is None:
            nn.init.zeros_(self.alpha_raw)
        nn.init.zeros_(self.beta_raw)
        if self.has_iso_pathway and isinstance(self.iso_norm, nn.LayerNorm):
            self.iso_norm.reset_parameters()

    def alpha(self) -> Tensor:
        if self.fixed_alpha is not None:
            return torch.tensor(self.fixed_alpha, device=self.beta_raw.device)
        return 0.5 + 1.5 * torch.sigmoid(self.alpha_raw)

    def beta(self) -> Tensor:
        return 0.1 * torch.tanh(self.beta_raw)

    def pathways(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """The gated pathway (sec. 3.1) and the isotropy projection ``W_i x`` before its norm (sec. 3.2; None
        when ablated)."""
        gate, up, *projected = self.in_proj(x).split(self.intermediate_size, dim=-1)
        return F.silu(gate) * up, (projected[0] if projected else None)

    def weighted_iso(self, projected: Tensor, weight: Tensor, shift: Tensor) -> Tensor:
        """``weight*Iso + shift`` in one fused kernel, ``Iso = LayerNorm(W_i x)`` (sec. 3.2) or ``W_i x``.

        With the LayerNorm, ``weight*LayerNorm(v) + shift`` is the LayerNorm with its affine scaled by
        ``weight`` and shifted: one kernel, whose backward already reduces the gradients of its ``[h]``
        affine, from which those of alpha and beta follow at the cost of ``[h]`` vectors.
        """
        if isinstance(self.iso_norm, nn.LayerNorm):
            norm = self.iso_norm
            return F.layer_norm(projected, norm.normalized_shape, norm.weight * weight, norm.bias * weight + shift,
                                norm.eps)
        return torch.addcmul(shift, projected, weight)

    def forward(self, x: Tensor, cache: Cache | None = None, padding_mask: Tensor | None = None,
                doc_starts: Tensor | None = None) -> Tensor:
        gated, projected = self.pathways(x)
        alpha, beta = self.alpha(), self.beta()
        shifted = beta if projected is None else self.weighted_iso(projected, 2 - alpha, beta)
        return self.down_proj(torch.addcmul(shifted, gated, alpha))  # sec. 3.3: alpha*Gated + (2-alpha)*Iso + beta

    @torch.no_grad()
    def diagnostics(self, x: Tensor) -> dict[str, float]:
        gated, projected = self.pathways(x)
        alpha, beta = self.alpha(), self.beta()
        iso = None if projected is None else self.weighted_iso(projected, 2 - alpha, torch.zeros_like(beta))
        return mixing_diagnostics(alpha, beta, alpha * gated, iso)


# ``ModelConfig.ffn`` -> block class, constructed ``(config)``.
FFN_REGISTRY: dict[str, type[FeedForward]] = {"swiglu": SwiGLU, "isogmlp": IsoGMLP, "iso_ln": IsoLN, "iso_mlp": IsoMLP}


# --- Parameter matching ---------------------------------------------------------------------------

# Prefer an intermediate size that is a multiple of 8 (tensor-core friendly) when its parameter count
# stays this close to the target; otherwise take the nearest integer.
_ROUNDING_TOLERANCE = 0.005


def swiglu_param_count(config: ModelConfig) -> int:
    """The matching target: SwiGLU with plain projections at ``config.intermediate_size`` (3*d*h)."""
    return 3 * config.hidden_size * config.intermediate_size


def _count_parameters(cls: type[FeedForward], config: ModelConfig, intermediate_size: int) -> int:
    with torch.device("meta"):  # shapes only: no memory, no init cost
        block = cls(config, intermediate_size=intermediate_size)
    return sum(p.numel() for p in block.parameters())


def _matched_intermediate_size(cls: type[FeedForward], config: ModelConfig) -> int:
    """h for block ``cls`` (with ``config.ffn_linear``): ``config.intermediate_size`` unless
    ``ffn_param_match``, then the h whose parameter count equals ``swiglu_param_count(config)``.

    A block's count is affine in h (matrices d*h, per-channel vectors h, scalars), so two builds on
    the meta device give it exactly and any new variant is matched without a formula of its own.
    """
    if not config.ffn_param_match:
        return config.intermediate_size
    target = swiglu_param_count(config)
    low, high = 8, 16
    count_low = _count_parameters(cls, config, low)
    per_unit = (_count_parameters(cls, config, high) - count_low) / (high - low)
    fixed = count_low - per_unit * low

    def rel_error(h: int) -> float:
        return abs(fixed + per_unit * h - target) / target

    exact = (target - fixed) / per_unit
    multiple_of_8 = 8 * round(exact / 8)
    if multiple_of_8 >= 8 and rel_error(multiple_of_8) <= _ROUNDING_TOLERANCE:
        return multiple_of_8
    nearest = round(exact)
    if nearest < 1:
        raise ConfigError("intermediate_size", f"{config.intermediate_size} is too small to parameter-match "
                          f"ffn={config.ffn!r} (needs h={exact:.2f})")
    return nearest


def resolve_intermediate_size(config: ModelConfig) -> int:
    """The h that ``FFN_REGISTRY[config.ffn](config)`` uses (see ``_matched_intermediate_size``)."""
    return _matched_intermediate_size(FFN_REGISTRY[config.ffn], config)

