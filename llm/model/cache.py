"""Generation state: what each decoder layer carries from one ``generate()`` step to the next."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache


@dataclass
class LayerState:
    """What one decoder layer carries from one generation step to the next, each state passed to its owner (the
    scoring, the FFN) as an argument. A state of fixed size (iso_tanh's sums without autograd, the FFN's; a
    static cache's buffers) is advanced in place, so that a static cache's captured step keeps its memory."""

    attention: tuple[torch.Tensor, ...] | None = None
    """The scoring's ``present``, a tuple of batch-first tensors: ``(k, v)`` for softmax (a static cache's
    ``[B, Hkv, max_length, D]`` buffers after the prompt), ``(S, G)`` for iso_tanh."""
    ffn: dict[str, torch.Tensor] = field(default_factory=dict)
    """The FFN's own running state (isogmlp's causal_mean gate keeps its prefix sum here)."""


@dataclass
class StaticDecoding:
    """A static cache's bookkeeping for one-token steps, on the device: no step reads a number back to the host,
    so the step can be captured once as a CUDA graph and replayed for every token."""

    slot: torch.Tensor
    """``[1]`` long: where the next token's key and value go in the softmax buffers (the tokens seen so far)."""
    real_keys: torch.Tensor
    """``[B, capacity]`` bool: the slots that hold a real (not padding) token's key; a row's count of them is
    also its next real token's position."""
    graph: tuple | None = None
    """The captured step on CUDA (``static_decoding.static_step``): the graph, its input buffers and its output."""


class DecodeStep(NamedTuple):
    """One token per row through a static cache: built once per step (``static_decoding.decode_step``) and passed
    to every layer, whose attention and FFN read it as an argument."""

    slot: torch.Tensor
    """``[1]`` long: the buffer slot of the new token's key and value."""
    visible: torch.Tensor
    """``[B, 1, 1, capacity]`` bool: the real slots and the new token's own, so that a padded one sees a key."""
    real: torch.Tensor
    """``[B, 1]`` bool: whether the new token is real (the padding mask of the step)."""


DROPS_DRAFTS = "assisted and prompt-lookup decoding drop rejected draft tokens from the cache, but {}"
"""The refusal of a decoding strategy that would have a state forget tokens it cannot (its reason filled in)."""


class IsoLLMCache(Cache):
    """Generation state of all layers plus the number of tokens seen (the next token's position).

    A ``transformers.cache_utils.Cache`` (what ``generate()`` expects of a state), whose layers are
    ``LayerState``s rather than key/value layers: iso_tanh has no keys or values to cache, and an FFN may keep
    state of its own. It serves greedy decoding, sampling and beam search (``get_seq_length``,
    ``reorder_cache``), and assisted and prompt-lookup decoding, which roll rejected draft tokens back (``crop``),
    where the state can forget a token: softmax's keys and values can, iso_tanh's (S, G) sums cannot.

    With ``max_length`` it is static: after the prompt, softmax's keys and values move into buffers of that many
    positions and every state is then updated in place, so that each one-token step has the same shapes and
    memory and runs as one CUDA graph replay, without a kernel launch per operation (static_decoding.py).
    ``is_compileable`` stays False all the same: that flag makes transformers' ``generate()`` compile the whole
    forward and build 4-d masks this model does not read.
    """

    is_compileable = False

    def __init__(self, num_layers: int, max_length: int | None = None) -> None:
        if max_length is not None and max_length < 1:
            raise ValueError(f"IsoLLMCache: max_length must be a positive number of tokens, got {max_length}")
        super().__init__(layers=[LayerState() for _ in range(num_layers)])
        self.seen_tokens = 0
        self.max_length = max_length
        self.decoding: StaticDecoding | None = None
        """Set after the prompt of a static cache (``max_length``)."""
        self.embedded_prompt = 0
        """The prompt's tokens when ``generate()`` got it as ``inputs_embeds``: its ``input_ids`` leave them out."""
        self.keeps_every_token: str | None = None
        """Why the model's state cannot forget a token (None: it can), set by the model that fills the cache."""

    @property
    def is_croppable(self) -> bool:
        return self.max_length is None and self.keeps_every_token is None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_length if self.max_length is not None else -1  # -1: transformers' "no maximum"

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds, each once: the layers' states and a static cache's step bookkeeping."""
        held = [state for layer in self.layers for state in (*(layer.attention or ()), *layer.ffn.values())]
        return held + ([self.decoding.slot, self.decoding.real_keys] if self.decoding is not None else [])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep the rows of the surviving beams, in place (a captured step reads the same memory)."""
        for state in self.tensors():
            if self.decoding is None or state is not self.decoding.slot:  # every other state is batch-first
                state.copy_(state.index_select(0, beam_idx.to(state.device)))

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers 5 counts them negative): the draft tokens that
        assisted or prompt-lookup decoding rejected. Softmax's keys and values are cut; other states refuse."""
        if tokens_to_remove > 0:
            raise ValueError(f"IsoLLMCache.crop takes minus the tokens to remove, got {tokens_to_remove}")
        if not tokens_to_remove:
            return
        if not self.is_croppable:
            why = self.keeps_every_token or "a static cache (max_length) replays one captured step on fixed buffers"
            raise NotImplementedError(DROPS_DRAFTS.format(why))
        self.seen_tokens += tokens_to_remove
        for layer in self.layers:
            if layer.attention is not None:  # softmax's (k, v), [B, Hkv, T, D]
                layer.attention = tuple(t[:, :, : self.seen_tokens] for t in layer.attention)
