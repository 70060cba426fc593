"""RoPE's cos and sin (Su et al. 2021) for the config's ``rope_parameters``, as transformers' Qwen3 computes them.

The frequencies of every scaled type (linear, dynamic NTK, YaRN, LongRoPE, Llama 3 ...) come from transformers'
own ``ROPE_INIT_FUNCTIONS``, and the types whose frequencies follow the sequence length (dynamic, longrope) are
updated by its ``dynamic_rope_update``, so an isollm model and its stock-Qwen3 export rotate alike. The default type
is computed here by today's formula (its bits are those of the checkpoints trained before scaling existed).

Copied to the hub with the modelling code: torch and transformers only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from .errors import ConfigError, check_choice

ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)


def rope_config(config: Any) -> PreTrainedConfig:
    """What transformers' RoPE functions read of ``config`` (a ``ModelConfig`` or the HF config), on a
    ``PreTrainedConfig``, with ``rope_parameters`` standardised and validated by it (what it refuses, a missing key
    for one, is a ``ConfigError``). ``head_dim`` is resolved: 0 means derived, which dynamic would read as 0."""
    view = PreTrainedConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                            head_dim=config.resolved_head_dim, max_position_embeddings=config.max_position_embeddings)
    view.rope_parameters = dict(config.resolved_rope_parameters)
    try:
        view.standardize_rope_params()
        view.validate_rope()
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError("rope_parameters", str(err.args[0] if err.args else err)) from None
    return view


@contextmanager
def _rope_warnings() -> Iterator[list[str]]:
    """The messages transformers' RoPE validation only logs as warnings (an unknown key, llama3's low_freq_factor
    above its high_freq_factor, ...), collected whatever transformers' verbosity, and not printed."""
    logger, messages = logging.getLogger("transformers.modeling_rope_utils"), []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    level, propagate = logger.level, logger.propagate
    # warning_once (YaRN's factor mismatch, Phi3's original length) caches its message per process: a second config
    # with the same mistake would pass unseen. Within this check the logger's own warning_once is the plain warning.
    logger.warning_once = logger.warning  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        yield messages
    finally:
        del logger.warning_once  # type: ignore[attr-defined]
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def check_rope_parameters(config: Any) -> None:
    """Raise ``ConfigError`` naming ``config.rope_parameters`` where transformers would refuse them or only warn.
    Every value is checked, not the keys known today: a number (or a list's) must be finite and not a bool (but
    YaRN's ``truncate``), so an inf factor cannot remove all position information."""
    if not isinstance(config.rope_parameters, dict | None):
        raise ConfigError("rope_parameters", f"expected a mapping such as {{rope_type: yarn, factor: 4.0}}, "
                          f"got {config.rope_parameters!r}")
    resolved = config.resolved_rope_parameters
    check_choice("rope_parameters.rope_type", resolved["rope_type"], ROPE_TYPES)
    for key, value in resolved.items():
        if key != "truncate" and any(isinstance(v, bool) or (isinstance(v, float) and not math.isfinite(v))
                                     for v in (value if isinstance(value, list) else [value])):
            raise ConfigError(f"rope_parameters.{key}", f"expected a finite number, got {value!r}")
    original = resolved.get("original_max_position_embeddings", 1)
    if type(original) is not int or original < 1:  # transformers divides by it
        raise ConfigError("rope_parameters.original_max_position_embeddings",
                          f"expected a positive integer, got {original!r}")
    if resolved["rope_theta"] != config.rope_theta:
        raise ConfigError("rope_parameters.rope_theta", f"{resolved['rope_theta']} differs from rope_theta="
                          f"{config.rope_theta}: set the field rope_theta alone")
    if not isinstance(partial := resolved["partial_rotary_factor"], int | float) or not 0 < partial <= 1:
        raise ConfigError("rope_parameters.partial_rotary_factor", f"expected a fraction in (0, 1], got {partial!r}")
    if not isinstance(factor := resolved.get("factor", 1), int | float) or factor < 1:
        raise ConfigError("rope_parameters.factor", f"expected a number >= 1, got {factor!r}")
    with _rope_warnings() as warned:
        rope_config(config)
    if warned:
        raise ConfigError("rope_parameters", f"{warned[0]} (transformers only warns)")


class IsoLLMRotaryEmbedding(nn.Module):
    """``(cos, sin)``, ``[B, T, rotary_dim]``, of integer positions ``[B, T]``, scaled by the type's
    ``attention_scaling`` (YaRN's temperature), in ``x``'s dtype; transformers' ``Qwen3RotaryEmbedding`` with its
    frequencies kept in fp32 whatever the model's dtype.

    Frequencies ``theta^(-2i/rotary_dim)`` are laid out as ``[f_0..f_{R/2-1}, f_0..f_{R/2-1}]``, the rotate-half
    convention of Llama and Qwen3 (not interleaved pairs); ``rotary_dim`` is ``partial_rotary_factor * head_dim``
    (``fused_ops.apply_rotary`` leaves the rest of each head unrotated).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = rope_config(config)
        self.rope_type = self.config.rope_parameters["rope_type"]
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        init = ROPE_INIT_FUNCTIONS.get(self.rope_type, self.compute_default_rope_parameters)
        inv_freq, self.attention_scaling = init(self.config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: PreTrainedConfig, device: torch.device | None = None,
                                        **kwargs: Any) -> tuple[torch.Tensor, float]:
        """Plain RoPE's ``theta^(-2i/rotary_dim)`` and no attention scaling (the name transformers' init looks up)."""
        dim = int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
        exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        return 1.0 / (config.rope_parameters["rope_theta"] ** exponent), 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The default type computes its frequencies on the positions' device at each call, as isollm always has:
        # the bits of every checkpoint trained before scaling existed (the buffer, computed on the CPU by
        # transformers' init, could differ from a GPU's pow in the last bit). Two tiny ops on D/2 values.
        inv_freq = self.inv_freq if self.rope_type != "default" else \
            self.compute_default_rope_parameters(self.config, position_ids.device)[0]
        freqs = position_ids[..., None].float() * inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_scaling != 1:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> IsoLLMRotaryEmbedding:
        """Follow the model to a device but not to a dtype: ``model.to(torch.bfloat16)`` would round the frequencies
        to 8 bits (the angle at position 4096 moves by up to 16 radians) and change what a checkpoint computes.
        torch routes ``to``, ``cuda``, ``half`` ... through this method; tests/model/test_rotary.py fails if not."""
        fp32 = dict(self.named_buffers(recurse=False))
        super()._apply(fn, recurse)
        for name, before in fp32.items():
            after = getattr(self, name)
            if after.dtype != before.dtype and not before.is_meta:
                self.register_buffer(name, before.to(after.device), persistent=False)
        return self
