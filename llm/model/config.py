"""The model's hyper-parameters: one flat, documented dataclass.

Field names follow transformers' Qwen3 config so that the HF config (``configuration_isollm.py``)
is this dataclass plus ``model_type``; the variant fields are named after the papers' terms. Every string
choice is a key into an explicit registry (``FFN_REGISTRY``, ``ATTN_SCORING_REGISTRY``, ...), and
``validate()`` names the offending field in one line.

This file is copied to the hub with the modelling code, so it imports nothing outside llm/model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from .attention import ATTN_SCORING_REGISTRY
from .errors import ConfigError, check_choice
from .ffn import FFN_REGISTRY, ISOGMLP_GATES
from .isotropic import ISO_ACTIVATIONS
from .linear import LINEAR_REGISTRY
from .rotary import check_rope_parameters

__all__ = ["ConfigError", "ModelConfig", "check_choice", "upgrade_saved"]

QWEN3_VOCAB_SIZE = 151_680  # the Qwen3 tokenizer's 151,669 ids padded to a multiple of 128


# ``ModelConfig.parametrization``.
PARAMETRIZATIONS = ("standard", "mup")

# ``ModelConfig.ffn_init``: scale-matched constants (default) or the papers' raw formulas.
FFN_INITS = ("matched", "paper")

# The fields that pick a variant, in the order of ``variant_name``.
VARIANT_SELECTORS = ("ffn", "attn_scoring", "ffn_linear")

# Prefixes dropped from an option's field name inside a variant name: iso_ln_layernorm -> layernorm.
_OPTION_PREFIXES = ("iso_ln_", "isogmlp_", "iso_tanh_", "iso_", "focus_", "ffn_")


def _short_option_name(field: str) -> str:
    prefix = next((p for p in _OPTION_PREFIXES if field.startswith(p)), "")
    return field[len(prefix):]


def _format_option(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def _variant_registries() -> dict[str, dict[str, type]]:
    """Every registry whose entries declare ``OPTIONS``: the three selectors and iso_mlp's activation."""
    return {"ffn": FFN_REGISTRY, "attn_scoring": ATTN_SCORING_REGISTRY, "ffn_linear": LINEAR_REGISTRY,
            "iso_activation": ISO_ACTIVATIONS}


def _options_of(entry: type) -> tuple[str, ...]:
    """The fields a registry entry reads: its ``OPTIONS``, then the fields of its ``LR_MULTIPLIERS``."""
    multipliers = getattr(entry, "LR_MULTIPLIERS", {}).values()
    return tuple(dict.fromkeys((*getattr(entry, "OPTIONS", ()), *multipliers)))


def _declaring_entries() -> dict[str, list[str]]:
    """Every variant option -> the registry entries that declare it, as ``selector=key``."""
    entries: dict[str, list[str]] = {}
    for selector, registry in _variant_registries().items():
        for key, entry in registry.items():
            for option in _options_of(entry):
                entries.setdefault(option, []).append(f"{selector}={key}")
    return entries


def _field_defaults() -> dict[str, object]:
    return {f.name: f.default for f in fields(ModelConfig)}


def upgrade_saved(values: dict[str, Any]) -> dict[str, Any]:
    """Saved config fields (a ``config.json``, a run's ``model:`` section) as today's ``ModelConfig`` reads them.

    Fields saved before ``ffn_init`` existed hold the papers' raw scales: ``ffn_init`` is set to ``paper``,
    rather than today's scale-matched default, so that an old checkpoint computes what it was trained to.
    They also hold every option at the defaults of its time (``iso_r0: 1.0`` ...), including those the
    variant does not read, which ``validate`` refuses: those had no effect, and take today's defaults.
    A ``mup`` config saved before ``mup_base_head_dim`` existed scored attention q.k / head_dim, which
    ``mup_base_head_dim=1`` computes; one saved before ``rope_parameters`` rotated by plain RoPE (None). Newer fields
    are returned as they are.
    """
    if values.get("parametrization") == "mup" and "mup_base_head_dim" not in values:
        values = {**values, "mup_base_head_dim": 1}
    if "rope_parameters" not in values:  # saved before RoPE scaling existed: plain RoPE at rope_theta
        values = {**values, "rope_parameters": None}
    if "ffn_init" in values:
        return values
    values = {**values, "ffn_init": "paper"}
    saved = {name: value for name, value in values.items() if name in ModelConfig.field_names()}
    try:
        read = ModelConfig(**saved).with_variant()
    except (KeyError, TypeError):  # an unknown or unhashable variant choice: the schema or validate() names it
        return values
    return {**values, **{name: getattr(read, name) for name in saved}}


@dataclass
class ModelConfig:
    # --- Sizes (transformers' Qwen3 names) ---
    vocab_size: int = QWEN3_VOCAB_SIZE
    """Rows of the embedding; pad tokenizer vocabularies to a multiple of 128 for fast matmuls."""
    hidden_size: int = 768
    """Width d of the residual stream."""
    intermediate_size: int = 2048
    """Width h of the FFN's hidden layer for SwiGLU; other FFNs shrink it when ``ffn_param_match``."""
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 4
    """Grouped-query attention: query heads share ``num_attention_heads // num_key_value_heads`` KV heads."""
    head_dim: int = 0
    """Per-head width; 0 means ``hidden_size // num_attention_heads``."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is meant for (written to the HF and Qwen3 configs); RoPE angles are
    computed per position, so nothing is sized by it."""
    rope_theta: float = 1_000_000.0
    """RoPE's base: frequencies ``rope_theta^(-2i/rotary_dim)`` (Su et al. 2021)."""
    rope_parameters: dict[str, Any] | None = None
    """RoPE scaling as transformers' ``rope_parameters`` (which computes it): None is plain RoPE at ``rope_theta``;
    else ``rope_type`` (linear | dynamic | yarn | longrope | llama3 | proportional) and that type's keys, e.g.
    ``{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 4096}``; ``partial_rotary_factor`` (< 1:
    that fraction of each head rotates) with any type. The HF config holds it completed by transformers' defaults
    (docs/ARCHITECTURE.md, "RoPE")."""
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    """Share the input embedding with the LM head (the papers' 83M-250M models do)."""
    lm_head_precision: str = "bf16"
    """bf16 | fp8: the training loss's logits matmul in the training precision, or with FP8 operands (rowwise
    scales, fp32 accumulation; lm_head.py), refused on a GPU without FP8 (CUDA capability below 8.9). On the CPU fp8
    runs torch's reference kernel of the same matmul. An execution setting, like ``iso_tanh_chunk_size``."""
    qk_norm: bool = True
    """Qwen3's per-head RMSNorm on queries and keys before RoPE."""
    initializer_range: float = 0.02
    """Std of the normal init of every projection and the embedding."""

    # --- Variants: FFN block, its input projections, attention scoring ---
    ffn: str = "swiglu"
    """FFN block: swiglu | isogmlp | iso_ln | iso_mlp (``ffn.FFN_REGISTRY``)."""
    attn_scoring: str = "softmax"
    """Attention scoring: softmax | iso_tanh (``attention.ATTN_SCORING_REGISTRY``)."""
    ffn_linear: str = "linear"
    """Input projections of any FFN: linear | affine_like | focus (``linear.LINEAR_REGISTRY``)."""
    ffn_param_match: bool = False
    """Shrink h of a wider FFN so its parameter count equals SwiGLU's at the same size."""
    isogmlp_gate: str = "token"
    """IsoGMLP's alpha input: token (x_t) | causal_mean (mean of x over positions <= t) | feature_mean."""
    iso_ln_alpha: float = 0.0
    """iso_ln ablation: a fixed alpha in [0.5, 2] instead of the learned one; 0 means learned."""
    iso_ln_layernorm: bool = True
    """iso_ln ablation: False drops the LayerNorm of the isotropy pathway."""
    iso_ln_pathway: bool = True
    """iso_ln ablation: False drops the isotropy pathway (output ``W_down(alpha*Gated + beta)``)."""
    iso_activation: str = "tanh"
    """iso_mlp's radial function: tanh | relu | capped_relu | leaky_relu (``isotropic.ISO_ACTIVATIONS``)."""
    iso_r0: float = 0.5
    """R_0 of iso-ReLU, capped iso-ReLU and iso-leaky-ReLU (isotropic-deep-learning eq. 17-20), in units
    of the initial radius under ``ffn_init=matched`` (docs/ARCHITECTURE.md, "Matched initial scale")."""
    iso_r_cap: float = 1.0
    """R_inf of the capped iso-ReLU (isotropic-deep-learning eq. 18), in the same units as ``iso_r0``."""
    iso_leaky_slope: float = 0.1
    """alpha of the iso-leaky-ReLU (isotropic-deep-learning eq. 20)."""
    ffn_init: str = "matched"
    """matched | paper. matched: affine_like and the iso activations are rescaled by constants so that at
    initialisation they see and give the scale ``linear`` / SwiGLU do; paper: the raw formulas."""
    mixing_lr_mult: float = 5.0
    """Learning-rate multiplier of the learned mixing parameters (iso_ln alpha/beta, isogmlp gamma/beta and
    alpha gate): Adam moves a parameter by about lr per step, so at 1x iso_ln's alpha cannot pass 1.49 on the
    83m schedule; 5x lets it reach the paper's 1.81 with room to spare (docs/ARCHITECTURE.md)."""
    focus_sigma_init: float = 0.1
    """Initial aperture sigma of every focusing neuron (focusing-neuron eq. 6)."""
    focus_mu_lr_mult: float = 0.1
    """Learning-rate multiplier of the focus centres mu (the paper: 0.01 against 0.1 globally)."""
    focus_sigma_lr_mult: float = 0.1
    """Learning-rate multiplier of the focus apertures sigma."""
    iso_tanh_chunk_size: int = 64
    """Chunk length of the linear-time iso_tanh attention (exact inside a chunk, carried state across).
    An execution setting (results equal up to rounding), so not an option of the iso_tanh variant. Work per
    token grows with ``chunk_size + D``, matmul efficiency with the chunk: 64 or 128 on a GPU, chosen by
    ``bench/bench_attention.py --tune 64,128`` (64 is not a GPU measurement at this commit)."""

    # --- Parametrization: how init, learning rates and multipliers scale with width ---
    parametrization: str = "standard"
    """standard | mup. mup: maximal update parametrization (Tensor Programs V, Yang et al. 2022) relative to
    ``mup_base_hidden_size``, so that a learning rate tuned at the base width carries over to wider models:
    hidden matrices and readouts (each module's ``MUP_SCALED``) start at std ``initializer_range / sqrt(m)``
    and train at lr / m, the logits are multiplied by 1 / m, and attention scores q.k by
    sqrt(mup_base_head_dim) / head_dim instead of 1 / sqrt(head_dim), with m = hidden_size / mup_base_hidden_size.
    Vector-like parameters (embedding, norms, the mixing scalars, focus centres and apertures, biases) keep their
    init and lr (docs/ARCHITECTURE.md, "muP")."""
    mup_base_hidden_size: int = 256
    """The width at which ``mup`` equals ``standard`` in init, lr and logits: the width of the lr sweep."""
    mup_base_head_dim: int = 64
    """The base model's head_dim: ``mup`` scores q.k * sqrt(mup_base_head_dim) / head_dim, 1 / head_dim as
    heads widen (Tensor Programs V, section 4) and the standard 1 / sqrt(head_dim) at the base (the mup
    package's ``8 / d`` for 64). With QK-norm a bare 1 / head_dim would cap the logits near the norm gains'
    product (about 1): attention 8x colder than standard at head_dim 64, near uniform for a short run."""

    @property
    def width_multiplier(self) -> float:
        """m = ``hidden_size / mup_base_hidden_size`` under ``mup``; 1 under ``standard``."""
        return self.hidden_size / self.mup_base_hidden_size if self.parametrization == "mup" else 1.0

    @property
    def query_scale(self) -> float:
        """Factor on q (after its norm and RoPE) that turns the scorings' 1 / sqrt(head_dim) into muP's
        sqrt(mup_base_head_dim) / head_dim; 1 under ``standard``."""
        if self.parametrization != "mup":
            return 1.0
        return math.sqrt(self.mup_base_head_dim / self.resolved_head_dim)

    @property
    def hidden_init_std(self) -> float:
        """Initial std of the hidden matrices: ``initializer_range``, divided by sqrt(m) under ``mup``."""
        return self.initializer_range / math.sqrt(self.width_multiplier)

    @property
    def resolved_rope_parameters(self) -> dict[str, Any]:
        """``rope_parameters`` over its defaults: type default, ``rope_theta``, ``partial_rotary_factor`` 1."""
        return {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": 1.0,
                **(self.rope_parameters or {})}

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def variant_name(self) -> str:
        """``<ffn>+<attn_scoring>``, plus ``+<ffn_linear>`` when not ``linear``, each followed by its
        non-default options in brackets, e.g. ``iso_ln[layernorm=false]+softmax`` (docs/ARCHITECTURE.md)."""
        options: dict[str, list[str]] = {selector: [] for selector in VARIANT_SELECTORS}
        defaults = _field_defaults()
        for option, selector in self.option_owners().items():
            value = getattr(self, option)
            if value != defaults[option]:
                options[selector].append(f"{_short_option_name(option)}={_format_option(value)}")
        parts = [f"{getattr(self, s)}[{','.join(options[s])}]" if options[s] else getattr(self, s)
                 for s in VARIANT_SELECTORS]
        if parts[2] == "linear":
            parts.pop()
        return "+".join(parts)

    def option_owners(self) -> dict[str, str]:
        """The variant options in use: each field a selected registry entry reads (its ``OPTIONS`` and the fields
        of its ``LR_MULTIPLIERS``) -> the top-level selector (``ffn``, ``attn_scoring`` or ``ffn_linear``) whose
        choice brings it. An option that is itself a choice (iso_mlp's ``iso_activation``) brings the options of
        the entry it selects."""
        registries = _variant_registries()
        owners: dict[str, str] = {}

        def collect(selector: str, top: str) -> None:
            for option in _options_of(registries[selector][getattr(self, selector)]):
                owners.setdefault(option, top)
                if option in registries:
                    collect(option, top)

        for selector in VARIANT_SELECTORS:
            collect(selector, selector)
        return owners

    def with_variant(self, **choices: str) -> ModelConfig:
        """This config with other variant choices (e.g. ``ffn="swiglu"``) and every option that the new
        choices do not read back at its default, so the result validates (a reference build)."""
        changed = replace(self, **choices)
        unread = _declaring_entries().keys() - changed.option_owners().keys()
        defaults = _field_defaults()
        return replace(changed, **{option: defaults[option] for option in unread})

    def _check_unused_options(self) -> None:
        """Refuse a non-default option that no selected variant reads (it would change nothing silently)."""
        owned = self.option_owners()
        defaults = _field_defaults()
        for option, entries in _declaring_entries().items():
            value = getattr(self, option)
            if option not in owned and value != defaults[option]:
                selected = ", ".join(f"{s}={getattr(self, s)}" for s in VARIANT_SELECTORS)
                raise ConfigError(option, f"{value!r} has no effect: it is an option of {' or '.join(entries)}, "
                                  f"and this model is {selected}")

    def validate(self) -> ModelConfig:
        """Raise ``ConfigError`` naming the first bad field; return self so calls chain."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                     "iso_tanh_chunk_size", "mup_base_hidden_size", "mup_base_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"expected a positive integer, got {value!r}")
        if self.head_dim < 0:
            raise ConfigError("head_dim", f"expected 0 (derived) or a positive integer, got {self.head_dim}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("hidden_size", f"{self.hidden_size} is not divisible by "
                              f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_key_value_heads", f"{self.num_key_value_heads} does not divide "
                              f"num_attention_heads={self.num_attention_heads}")
        if self.resolved_head_dim % 2:
            raise ConfigError("head_dim", f"rotary embedding needs an even head dimension, "
                              f"got {self.resolved_head_dim}")
        for name in ("rope_theta", "rms_norm_eps", "initializer_range", "focus_sigma_init",
                     "mixing_lr_mult", "focus_mu_lr_mult", "focus_sigma_lr_mult"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(name, f"expected a positive finite number, got {getattr(self, name)!r}")
        check_rope_parameters(self)
        for selector, registry in _variant_registries().items():
            check_choice(selector, getattr(self, selector), registry)
        check_choice("isogmlp_gate", self.isogmlp_gate, ISOGMLP_GATES)
        check_choice("ffn_init", self.ffn_init, FFN_INITS)
        check_choice("parametrization", self.parametrization, PARAMETRIZATIONS)
        check_choice("lm_head_precision", self.lm_head_precision, ("bf16", "fp8"))
        self._check_unused_options()
        owned = self.option_owners()
        if self.iso_ln_alpha and not 0.5 <= self.iso_ln_alpha <= 2.0:
            raise ConfigError("iso_ln_alpha", f"expected 0 (learned) or a value in [0.5, 2], got {self.iso_ln_alpha}")
        if not self.iso_r0 >= 0:
            raise ConfigError("iso_r0", f"expected >= 0, got {self.iso_r0}")
        if "iso_r_cap" in owned and not self.iso_r0 < self.iso_r_cap:  # only the capped iso-ReLU has a cap
            raise ConfigError("iso_r0", f"expected 0 <= iso_r0 < iso_r_cap={self.iso_r_cap}, got {self.iso_r0}")
        if not 0 <= self.iso_leaky_slope <= 1:
            raise ConfigError("iso_leaky_slope", f"expected a slope in [0, 1], got {self.iso_leaky_slope}")
        if self.ffn_init == "matched" and "iso_r0" in owned and not self.iso_r0 < 1:
            raise ConfigError("iso_r0", f"expected < 1 with ffn_init=matched (radii in units of the initial "
                              f"radius: R0 >= 1 zeroes a typical vector at init), got {self.iso_r0}")
        return self

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
