"""One global epoch: the split of a source's pieces among ``num_nodes`` nodes (rank x DataLoader worker).

Every epoch orders the pieces (a permutation by ``(seed, epoch)``, or source order), lays them end to end
in their units (rows of parquet row groups, bytes of line-oriented files) and cuts that line into
``num_nodes`` contiguous ranges of equal length: node i gets ``[floor(i U / N), floor((i + 1) U / N))``
of the ``U`` units. So

- every document belongs to exactly one node per epoch (a row to the range holding it, a line-oriented
  record to the range holding its first byte), whatever the numbers of files and nodes;
- every node reads about 1/N of the bytes: its range, plus at most the rest of the (at most two) row groups
  it shares with a neighbour, or one record past its end;
- the nodes' shares differ by at most one row (parquet) or one document's bytes (jsonl, txt).

A node's share of an epoch is a list of segments ``(piece, lo, hi)`` in the piece's unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llm.data.pieces import Piece

__all__ = ["NodeShare", "Segment", "epoch_order", "node_segments", "node_shares"]

# (index of the piece in source order, first unit, end unit) within the piece.
Segment = tuple[int, int, int]


def epoch_order(num_pieces: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Piece visiting order of an epoch: a permutation by (seed, epoch), or source order."""
    if not shuffle:
        return list(range(num_pieces))
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(num_pieces)]


def node_segments(pieces: Sequence[Piece], order: list[int], node: int, num_nodes: int) -> list[Segment]:
    """The segments of ``pieces`` (visited in ``order``) that make up node ``node``'s share of the epoch."""
    total = sum(p.size for p in pieces)
    lo, hi = total * node // num_nodes, total * (node + 1) // num_nodes
    segments: list[Segment] = []
    offset = 0
    for index in order:
        size = pieces[index].size
        start, end = max(lo, offset) - offset, min(hi, offset + size) - offset
        if start < end:
            segments.append((index, start, end))
        offset += size
        if offset >= hi:
            break
    return segments


@dataclass(frozen=True)
class NodeShare:
    """What one node reads of one epoch."""

    units: int
    """Rows (parquet) or bytes (jsonl, txt) of its share."""
    share_bytes: float
    """Bytes on disk of its share (a row range counts its fraction of the row group's bytes)."""
    read_bytes: int
    """Bytes it reads: whole row groups for parquet, its byte ranges for line-oriented files."""

    @property
    def amplification(self) -> float:
        return self.read_bytes / self.share_bytes if self.share_bytes else 1.0


def node_shares(pieces: Sequence[Piece], order: list[int], num_nodes: int) -> list[NodeShare]:
    """Every node's share of the epoch visited in ``order``."""
    shares = []
    for node in range(num_nodes):
        segments = node_segments(pieces, order, node, num_nodes)
        units = sum(hi - lo for _, lo, hi in segments)
        share = sum(pieces[i].num_bytes * (hi - lo) / pieces[i].size for i, lo, hi in segments)
        read = sum(pieces[i].num_bytes if pieces[i].kind == "parquet" else hi - lo for i, lo, hi in segments)
        shares.append(NodeShare(units, share, read))
    return shares
