"""The training stream: documents -> tokens (+EOS) -> non-overlapping windows -> block shuffle -> batches.

Work is split into ``num_nodes = world_size * max(num_workers, 1)`` disjoint *nodes* (one per rank and
DataLoader worker; node = rank * workers + worker). Two sources implement it:

**Streaming** (``StreamingTokens``), per node, a deterministic resumable stream:

1. Epoch split (``llm.data.split``): every epoch orders the source's pieces (parquet row groups, or whole
   jsonl/txt files) by ``(seed, epoch)`` and gives each node a contiguous ``1/num_nodes`` of the epoch's rows
   (bytes for jsonl/txt): one global epoch, whatever the number of files.
2. Validation documents are dropped (``validation.is_validation``), documents are cut to
   ``max_doc_chars`` characters, every document gets EOS appended, and the node's token stream is cut into
   windows of ``seq_len + 1`` tokens: window k = tokens [k(L+1), (k+1)(L+1)). Windows continue across
   epoch boundaries, so no token is dropped or repeated.
3. Window shuffle: windows are permuted within consecutive blocks of ``shuffle_block`` windows by a
   permutation seeded with ``(seed, num_nodes, node, block index)`` (the block index counts over the node's
   whole stream, epochs included).

A streaming node's position is a JSON dict ``{"block", "index", "start"}``: the block being emitted, how
many of its windows were emitted, and where the block's first window starts: ``{"epoch", "pos",
"offset"}``, ``pos`` being the reader's position at the start of a tokenization chunk (``{"seg", "at"}``:
the segment of the node's share, the piece position) and ``offset`` the tokens of that chunk consumed
before the window. Resuming re-reads that chunk, regenerates the block and skips what was emitted: exact,
at the cost of re-tokenizing at most one block. It resumes only with the same number of nodes.

**Prepared tokens** (``llm.data.shards.PreparedTokens``) are read by global window index: the global
stream is the 1-node streaming stream (so one node reads exactly what streaming reads), and node i of N
takes its shuffled windows i, i + N, i + 2N, ... A position is the count of windows taken, so a run can
resume with any number of nodes (``TokenSource.reshard``).
"""

from __future__ import annotations

import copy
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from llm.config import DataConfig
from llm.data.errors import DataError
from llm.data.pieces import PieceReader, list_pieces
from llm.data.sources import data_source
from llm.data.split import epoch_order, node_segments
from llm.data.tokenizer import encode_documents, eos_id
from llm.data.validation import split_batch

__all__ = [
    "StreamingTokens",
    "TokenSource",
    "TrainLoader",
    "block_permutation",
    "build_train_loader",
    "iter_windows",
]

State = dict[str, Any]


def block_permutation(seed: int, node: int, num_nodes: int, block: int, size: int) -> np.ndarray:
    """Order in which the windows of one block are emitted."""
    return np.random.default_rng([seed, num_nodes, node, block]).permutation(size)


class TokenSource(ABC):
    """Windows of training tokens for one node, with an exact resumable position."""

    cfg: DataConfig
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


class StreamingTokens(TokenSource):
    """Training tokens streamed from a repository (hub or local) or local files, by pieces."""

    def __init__(self, data_cfg: DataConfig, tokenizer: Tokenizer) -> None:
        self.source = data_source(data_cfg)
        self.reader = PieceReader(self.source, data_cfg)
        self.pieces = list_pieces(self.source)
        self.tokenizer = tokenizer
        self.eos = eos_id(tokenizer)
        self.cfg = data_cfg

    def piece_docs(self, piece: int, start: int, hi: int) -> Iterator[tuple[int, list[str]]]:
        """(position before the batch, training texts of the batch) of a piece's range: validation documents
        dropped, a failed read retried (``PieceReader.batches``)."""
        for before, rows, _ in self.reader.batches(piece, start, hi):
            yield before, split_batch(rows, self.source, self.cfg.val_bucket, self.cfg.max_doc_chars)[0]

    def tokens(self, docs: list[str]) -> np.ndarray:
        return encode_documents(self.tokenizer, docs, self.eos)[0]

    def chunks(self, epoch: int, node: int, num_nodes: int, start: State | None
               ) -> Iterator[tuple[State, np.ndarray]]:
        """(position at the chunk's start, its tokens) for this node's documents of one epoch, from
        ``start`` (a position yielded earlier) or the epoch's beginning."""
        order = epoch_order(len(self.pieces), self.cfg.seed, epoch, self.cfg.shuffle_shards)
        segments = node_segments(self.pieces, order, node, num_nodes)
        first, at = (start["seg"], start["at"]) if start else (0, None)
        for seg in range(first, len(segments)):
            piece, lo, hi = segments[seg]
            for before, docs in self.piece_docs(piece, at if seg == first and at is not None else lo, hi):
                if docs:
                    yield {"seg": seg, "at": before}, self.tokens(docs)

    def node_windows(self, node: int, num_nodes: int, state: State | None) -> Iterator[tuple[np.ndarray, State]]:
        return iter_windows(self, node, num_nodes, self.cfg.seq_len + 1, self.cfg.seed, self.cfg.shuffle_block,
                            state)


def _pieces(source: StreamingTokens, node: int, num_nodes: int, start: State, max_epochs: int | None
            ) -> Iterator[tuple[int, State, int, np.ndarray]]:
    """(epoch, chunk position, offset, tokens[offset:]) over epochs, from a window-start state."""
    epoch, pos, offset = start["epoch"], start["pos"], start["offset"]
    while max_epochs is None or epoch < max_epochs:
        empty = pos is None
        for chunk_pos, tokens in source.chunks(epoch, node, num_nodes, pos):
            empty = False
            yield epoch, chunk_pos, offset, tokens[offset:]
            offset = 0
        if empty:
            raise DataError(
                f"data: node {node} of {num_nodes} (rank x worker) got no training documents in epoch {epoch} "
                f"from a source of {len(source.pieces)} piece(s); use fewer ranks/workers or more data"
            )
        epoch, pos, offset = epoch + 1, None, 0


def _windows(source: StreamingTokens, node: int, num_nodes: int, width: int, start: State,
             max_epochs: int | None) -> Iterator[tuple[np.ndarray, State]]:
    """(window of ``width`` tokens, state where the next window starts); a final partial window is dropped."""
    parts: list[np.ndarray] = []
    have = 0
    for epoch, pos, offset, tokens in _pieces(source, node, num_nodes, start, max_epochs):
        i = 0
        while i < len(tokens):
            take = min(width - have, len(tokens) - i)
            parts.append(tokens[i : i + take])
            have += take
            i += take
            if have == width:
                yield np.concatenate(parts), {"epoch": epoch, "pos": pos, "offset": offset + i}
                parts, have = [], 0


def initial_state() -> State:
    return {"block": 0, "index": 0, "start": {"epoch": 0, "pos": None, "offset": 0}}


def iter_windows(
    source: StreamingTokens, node: int, num_nodes: int, width: int, seed: int, shuffle_block: int,
    state: State | None = None, max_epochs: int | None = None,
) -> Iterator[tuple[np.ndarray, State]]:
    """One node's shuffled windows, each with the node state after it (resume from it to continue)."""
    state = state or initial_state()
    block, skip, start = state["block"], state["index"], state["start"]
    windows = _windows(source, node, num_nodes, width, start, max_epochs)
    while True:
        buffered = list(islice(windows, shuffle_block))
        if not buffered:
            return
        next_start = buffered[-1][1]
        order = block_permutation(seed, node, num_nodes, block, len(buffered))
        for k in range(skip, len(buffered)):
            after = ({"block": block, "index": k + 1, "start": start} if k + 1 < len(buffered)
                     else {"block": block + 1, "index": 0, "start": next_start})
            yield buffered[order[k]][0], after
        block, skip, start = block + 1, 0, next_start


class _NodeBatches(IterableDataset):
    """The per-worker dataset: yields (batch, logical worker, node state after the batch).

    DataLoader worker slot w runs logical worker ``(w + shift) % workers``: the DataLoader always starts its
    round-robin at slot 0, so a resume whose next batch belongs to logical worker ``shift`` rotates the
    assignment instead."""

    def __init__(self, loader: TrainLoader, states: list[State | None], shift: int) -> None:
        self.loader = loader
        self.states = states
        self.shift = shift

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int, State]]:
        info = get_worker_info()
        worker = 0 if info is None else (info.id + self.shift) % info.num_workers
        for batch, state in self.loader.node_batches(worker, self.states[worker]):
            yield batch, worker, state


class TrainLoader:
    """Infinite iterable of LongTensor[micro_batch_size, seq_len + 1] with an exact, JSON-serialisable state.

    ``state_dict()`` reflects the batches the caller has *consumed* (workers prefetch ahead; each batch
    carries its worker's state after it, and we keep the last consumed one per worker plus whose turn is
    next), so a loader rebuilt with the same arguments and ``load_state_dict`` continues exactly."""

    def __init__(self, source: TokenSource, data_cfg: DataConfig, micro_batch_size: int, rank: int,
                 world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside [0, world_size={world_size})")
        self.source = source
        self.cfg = data_cfg
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.workers = max(data_cfg.num_workers, 1)
        self.states: list[State | None] = [None] * self.workers
        self.next_worker = 0

    def _identity(self, topology: bool = True) -> dict[str, Any]:
        """What a saved state must match; ``topology=False`` leaves out what a resharded resume may change."""
        fixed = {"seq_len": self.cfg.seq_len, "seed": self.cfg.seed, "shuffle_block": self.cfg.shuffle_block,
                 "shuffle_shards": self.cfg.shuffle_shards, "val_bucket": self.cfg.val_bucket,
                 "max_doc_chars": self.cfg.max_doc_chars, "prepared": self.cfg.prepared is not None}
        if not topology:
            return fixed
        return {"rank": self.rank, "world_size": self.world_size, "num_workers": self.cfg.num_workers,
                "micro_batch_size": self.micro_batch_size, **fixed}

    def node_batches(self, worker: int, state: State | None) -> Iterator[tuple[torch.Tensor, State]]:
        """Batches of one logical worker's node, each with the node state after it."""
        node = self.rank * self.workers + worker
        windows = self.source.node_windows(node, self.world_size * self.workers, state)
        while True:  # the window stream is infinite (epochs repeat), so every group is full
            group = list(islice(windows, self.micro_batch_size))
            batch = torch.from_numpy(np.stack([w for w, _ in group]).astype(np.int64))
            yield batch, group[-1][1]

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.cfg.num_workers == 0:
            for batch, state in self.node_batches(0, self.states[0]):
                self.states[0] = state
                yield batch
            return
        dataset = _NodeBatches(self, list(self.states), self.next_worker)
        loader = DataLoader(dataset, batch_size=None, num_workers=self.cfg.num_workers,
                            worker_init_fn=_quiet_tokenizers)
        for batch, worker, state in loader:
            self.states[worker] = state
            self.next_worker = (worker + 1) % self.workers
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {**self._identity(), "next_worker": self.next_worker, "workers": copy.deepcopy(self.states)}

    def _check(self, state: dict[str, Any], expected: dict[str, Any]) -> None:
        for key, value in expected.items():
            if state.get(key) != value:
                raise DataError(f"data loader state: {key} was {state.get(key)!r}, this loader has "
                                 f"{value!r}; resume with the same data settings")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check(state, self._identity())
        self.states = copy.deepcopy(state["workers"])
        self.next_worker = state["next_worker"]

    def load_state_dicts(self, states: list[dict[str, Any]]) -> None:
        """Continue from the states of every rank of a run (``states[r]`` of rank r): this rank's own when
        the ranks and workers are the same, else this rank's share of the global order left by them all
        (``TokenSource.reshard``: prepared tokens; a streamed source raises a one-line ``DataError``)."""
        if len(states) == self.world_size and states[self.rank].get("num_workers") == self.cfg.num_workers:
            self.load_state_dict(states[self.rank])
            return
        for state in states:
            self._check(state, self._identity(topology=False))
        if not self.source.resharding:
            raise DataError(f"resume: the data loader state was written by {len(states)} processes, resuming with "
                            f"{self.world_size} (data.num_workers {states[0].get('num_workers')} -> "
                            f"{self.cfg.num_workers}): a streamed source continues only with as many; relaunch "
                            "with those, or pre-tokenize it (isollm-data prepare, data.prepared) to resume with any")
        nodes = [node for state in states for node in state["workers"]]
        mine = self.source.reshard(nodes, self.world_size * self.workers)
        self.states = mine[self.rank * self.workers : (self.rank + 1) * self.workers]
        self.next_worker = 0


def _quiet_tokenizers(_worker_id: int) -> None:
    """Workers tokenize with one thread each (the workers are the parallelism); this also silences
    tokenizers' fork-after-parallelism warning."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def build_train_loader(data_cfg: DataConfig, tokenizer: Tokenizer, micro_batch_size: int, rank: int,
                       world_size: int) -> TrainLoader:
    """The training loader of one process; reads ``data_cfg.prepared`` shards when set, else streams."""
    data_cfg.validate()
    if data_cfg.prepared:
        from llm.data.shards import PreparedTokens

        source: TokenSource = PreparedTokens(data_cfg, tokenizer)
    else:
        source = StreamingTokens(data_cfg, tokenizer)
    return TrainLoader(source, data_cfg, micro_batch_size, rank, world_size)
