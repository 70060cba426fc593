"""What the training loader reads from: one node's windows of tokens, with an exact resumable position.

Implemented by ``llm.data.streaming.StreamingTokens`` (streamed from the source) and
``llm.data.shards.PreparedTokens`` (pre-tokenized shards).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import numpy as np

from llm.config import DataConfig

State = dict[str, Any]


def block_permutation(seed: int, node: int, num_nodes: int, block: int, size: int) -> np.ndarray:
    """Order in which the windows of one block are emitted."""
    return np.random.default_rng([seed, num_nodes, node, block]).permutation(size)


class TokenSource(ABC):
    """Windows of training tokens for one node, with an exact resumable position."""

    cfg: DataConfig
    fingerprints: dict[str, str | None]
    """What the data is beyond its settings: the fingerprint of the tokenizer's definition (``tokenizer_identity``)
    under "tokenizer", a prepared index's under "prepared" (None when streaming), the source's files'
    (``source_fingerprint``; on prepared tokens the one ``prepare`` recorded of what it tokenized) under "source"."""
    former_tokenizer: str | None = None
    """The tokenizer's fingerprint by isollm's rule before 2026-12-01 (``former_tokenizer_identity``), which a
    loader state of that time records in place of today's; None where no such state can exist."""
    resharding = False
    """Whether a position can continue with another number of nodes (``reshard``)."""

    @abstractmethod
    def node_windows(self, node: int, num_nodes: int, state: State | None) -> Iterator[tuple[np.ndarray, State]]:
        """Node ``node``'s windows of ``seq_len + 1`` tokens, each with the node state after it, from ``state``
        (a state yielded earlier; None: the start)."""

    def reshard(self, states: list[State | None], num_nodes: int) -> list[State]:
        """States of ``num_nodes`` nodes continuing the global order where ``states`` (one per node of a run
        with another number of nodes) left it: nothing lost, nothing repeated."""
        raise NotImplementedError
