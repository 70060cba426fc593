"""Generation state: what each decoder layer carries from one ``generate()`` step to the next."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map


@dataclass
class LayerState:
    """What one decoder layer carries from one generation step to the next."""

    attention: Any = None
    """The scoring's opaque ``present``: ``(k, v)`` for softmax, ``(S, G)`` for iso_tanh."""
    ffn: dict[str, torch.Tensor] = field(default_factory=dict)
    """The FFN's own running state (isogmlp's causal_mean gate keeps its prefix sum here)."""


class IsoLLMCache:
    """Generation state of all layers plus the number of tokens seen (the next token's position).

    Not a ``transformers.cache_utils.Cache``: iso_tanh has no keys or values to cache. It offers what
    ``generate()`` asks of a cache for greedy decoding, sampling and beam search (``get_seq_length``,
    ``reorder_cache``); it is not compileable or croppable, so assisted decoding is not supported.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerState() for _ in range(num_layers)]
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep the rows of the surviving beams (every state tensor is batch-first)."""
        def select(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value.index_select(0, beam_idx.to(value.device))
            return value

        for layer in self.layers:
            layer.attention, layer.ffn = tree_map(select, (layer.attention, layer.ffn))
