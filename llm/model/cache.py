"""Generation state: what each decoder layer carries from one ``generate()`` step to the next."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache


@dataclass
class LayerState:
    """What one decoder layer carries from one generation step to the next."""

    attention: tuple[torch.Tensor, ...] | None = None
    """The scoring's ``present``, a tuple of batch-first tensors: ``(k, v)`` for softmax, ``(S, G)`` for iso_tanh."""
    ffn: dict[str, torch.Tensor] = field(default_factory=dict)
    """The FFN's own running state (isogmlp's causal_mean gate keeps its prefix sum here)."""


class IsoLLMCache(Cache):
    """Generation state of all layers plus the number of tokens seen (the next token's position).

    A ``transformers.cache_utils.Cache`` (what ``generate()`` expects of a state), whose layers are
    ``LayerState``s rather than key/value layers: iso_tanh has no keys or values to cache, and an FFN may keep
    state of its own. It serves greedy decoding, sampling and beam search (``get_seq_length``,
    ``reorder_cache``). It is neither compileable nor croppable: the (S, G) sums cannot forget a token, so
    assisted decoding, which rolls rejected drafts back, is refused.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[LayerState() for _ in range(num_layers)])
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep the rows of the surviving beams (every state tensor is batch-first)."""
        def select(state: torch.Tensor) -> torch.Tensor:
            return state.index_select(0, beam_idx.to(state.device))

        for layer in self.layers:
            if layer.attention is not None:
                layer.attention = tuple(select(state) for state in layer.attention)
            layer.ffn = {name: select(state) for name, state in layer.ffn.items()}

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: assisted decoding rolls rejected draft tokens back, and the sums cannot forget a token."""
        if tokens_to_remove:
            raise NotImplementedError("IsoLLMCache cannot drop tokens: iso_tanh's (S, G) sums and the FFN's running "
                                      "means cannot forget one, so assisted decoding is not supported")
