"""The training stream: documents -> tokens (+EOS) -> non-overlapping windows -> block shuffle -> batches.

Work is split into ``num_nodes = world_size * max(num_workers, 1)`` disjoint *nodes* (one per rank and
DataLoader worker; node = rank * workers + worker), each an independent, deterministic, resumable stream:

1. Shard order: every epoch permutes the source's shards (files) with ``(seed, epoch)``; every node computes
   the same permutation.
2. Node split: with at least as many shards as nodes, node i reads shards ``order[i::num_nodes]`` (nodes
   may then differ by one shard of work; each runs its own epochs). With fewer shards (e.g. one txt file),
   every node reads every shard and keeps training document j iff ``j % num_nodes == i``: disjoint and
   balanced, at the cost of each node reading the whole source. (We do not use ``split_dataset_by_node``'s
   example split: its resume hands a rank the other ranks' documents, see SPEC "Verified".)
3. Validation documents are dropped (``validation.is_validation``), every document gets EOS appended, and
   the token stream is cut into windows of ``seq_len + 1`` tokens: window k = tokens [k(L+1), (k+1)(L+1)).
   Windows continue across epoch boundaries, so no token is dropped or repeated.
4. Window shuffle: windows are permuted within consecutive blocks of ``shuffle_block`` windows by a
   permutation seeded with ``(seed, num_nodes, node, block index)`` (the block index counts over the node's
   whole stream, epochs included).

A node's position is a JSON dict ``{"block", "index", "start"}``: the block being emitted, how many of its
windows were emitted, and where the block's first window starts: ``{"epoch", "pos", "offset"}``, ``pos``
being the reader's position at the start of a tokenization chunk (``{"slot", "shard", "j"}``: index into
the node's shard list, the shard reader's own state, training documents counted so far for the node split)
and ``offset`` the tokens of that chunk consumed before the window. Resuming re-reads that chunk,
regenerates the block and skips what was emitted: exact, at the cost of re-tokenizing at most one block.
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
from llm.data.sources import ShardReader, data_source
from llm.data.tokenizer import encode_documents, eos_id
from llm.data.validation import split_batch

__all__ = [
    "StreamingTokens",
    "TokenSource",
    "TrainLoader",
    "build_train_loader",
    "iter_windows",
    "node_shards",
    "shard_order",
]

State = dict[str, Any]


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Shard visiting order of an epoch: a permutation by (seed, epoch), or source order."""
    if not shuffle:
        return list(range(num_shards))
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(num_shards)]


def node_shards(order: list[int], node: int, num_nodes: int) -> tuple[list[int], bool]:
    """(shards this node reads, whether documents are split by index instead): see the module docstring."""
    if len(order) >= num_nodes:
        return order[node::num_nodes], False
    return order, True


class TokenSource(ABC):
    """Training tokens by chunks; implemented by the streaming reader and the pre-tokenized shards, which
    differ only in how they read a shard's documents (``shard_docs``) and turn them into tokens."""

    num_shards: int
    cfg: DataConfig

    @abstractmethod
    def shard_docs(self, shard: int, state: Any) -> Iterator[tuple[Any, list[Any]]]:
        """(position in the shard before the documents, a batch of training documents) for one shard, from
        ``state`` (a position yielded earlier; None: the shard's start)."""

    @abstractmethod
    def tokens(self, docs: list[Any]) -> np.ndarray:
        """The documents' tokens, each document followed by EOS."""

    def chunks(self, epoch: int, node: int, num_nodes: int, start: State | None
               ) -> Iterator[tuple[State, np.ndarray]]:
        """(position at the chunk's start, its tokens) for this node's documents of one epoch, from
        ``start`` (a position yielded earlier) or the epoch's beginning."""
        order = shard_order(self.num_shards, self.cfg.seed, epoch, self.cfg.shuffle_shards)
        shards, split_docs = node_shards(order, node, num_nodes)
        first_slot, shard_state, j = (start["slot"], start["shard"], start["j"]) if start else (0, None, 0)
        for slot in range(first_slot, len(shards)):
            for state, docs in self.shard_docs(shards[slot], shard_state):
                pos = {"slot": slot, "shard": copy.deepcopy(state), "j": j}
                if split_docs:  # the node's documents are those whose count j + i is node mod num_nodes
                    mine = docs[(node - j) % num_nodes :: num_nodes]
                    j += len(docs)
                    docs = mine
                if docs:
                    yield pos, self.tokens(docs)
            shard_state = None


class StreamingTokens(TokenSource):
    """Training tokens streamed from a hub dataset or local files through ``datasets``."""

    def __init__(self, data_cfg: DataConfig, tokenizer: Tokenizer) -> None:
        self.source = data_source(data_cfg)
        self.reader = ShardReader(self.source, data_cfg)
        self.num_shards = self.reader.num_shards
        self.tokenizer = tokenizer
        self.eos = eos_id(tokenizer)
        self.cfg = data_cfg

    def shard_docs(self, shard: int, state: State | None) -> Iterator[tuple[State | None, list[str]]]:
        """(reader state before the batch, training texts of the batch): validation documents dropped, a
        failed read retried (``ShardReader.batches``)."""
        for before, batch in self.reader.batches(shard, state):
            yield before, split_batch(batch, self.source, self.cfg.val_bucket)[0]

    def tokens(self, docs: list[str]) -> np.ndarray:
        return encode_documents(self.tokenizer, docs, self.eos)[0]


def _pieces(source: TokenSource, node: int, num_nodes: int, start: State, max_epochs: int | None
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
                f"data: node {node} of {num_nodes} (rank x worker) got no training documents in epoch "
                f"{epoch} "
                f"from a source of {source.num_shards} shard(s); use fewer ranks/workers or more data"
            )
        epoch, pos, offset = epoch + 1, None, 0


def _windows(source: TokenSource, node: int, num_nodes: int, width: int, start: State,
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


def block_permutation(seed: int, node: int, num_nodes: int, block: int, size: int) -> np.ndarray:
    """Order in which the windows of one block are emitted."""
    return np.random.default_rng([seed, num_nodes, node, block]).permutation(size)


def initial_state() -> State:
    return {"block": 0, "index": 0, "start": {"epoch": 0, "pos": None, "offset": 0}}


def iter_windows(
    source: TokenSource, node: int, num_nodes: int, width: int, seed: int, shuffle_block: int,
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

    def _identity(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "num_workers": self.cfg.num_workers,
                "micro_batch_size": self.micro_batch_size, "seq_len": self.cfg.seq_len, "seed": self.cfg.seed,
                "shuffle_block": self.cfg.shuffle_block, "shuffle_shards": self.cfg.shuffle_shards,
                "val_bucket": self.cfg.val_bucket, "prepared": self.cfg.prepared is not None}

    def node_batches(self, worker: int, state: State | None) -> Iterator[tuple[torch.Tensor, State]]:
        """Batches of one logical worker's node, each with the node state after it."""
        node = self.rank * self.workers + worker
        windows = iter_windows(self.source, node, self.world_size * self.workers, self.cfg.seq_len + 1,
                               self.cfg.seed, self.cfg.shuffle_block, state)
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise DataError(f"data loader state: {key} was {state.get(key)!r}, this loader has "
                                 f"{value!r}; resume with the same data settings")
        self.states = copy.deepcopy(state["workers"])
        self.next_worker = state["next_worker"]


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
