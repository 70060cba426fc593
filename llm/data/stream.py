"""The training stream: documents -> tokens (+EOS) -> non-overlapping windows -> block shuffle -> batches.

Work is split into ``num_nodes = world_size * max(num_workers, 1)`` disjoint *nodes* (one per rank and
DataLoader worker; node = rank * workers + worker). A token source (``llm.data.token_source``) gives each node
its windows: ``llm.data.streaming.StreamingTokens`` reads and tokenizes the source per node and resumes only with
the same number of nodes; ``llm.data.shards.PreparedTokens`` reads pre-tokenized windows by global index and
resumes with any (``TokenSource.reshard``). This module turns a token source into batches: one DataLoader worker
per node of this rank, and a state that records the batches consumed.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from llm.config import DataConfig
from llm.data.errors import DataError, DataWarning
from llm.data.identity import data_identity
from llm.data.shards import PreparedTokens
from llm.data.streaming import StreamingTokens
from llm.data.token_source import State, TokenSource
from llm.data.tokenizer import TOKENIZATION

__all__ = ["TrainLoader", "build_train_loader"]


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
        self._unchecked = False

    def _identity(self, topology: bool = True) -> dict[str, Any]:
        """What a saved state must match: the data's identity (``llm.data.identity``: every data field but a declared
        few), the tokenization rule and the fingerprints; ``topology=False`` leaves out what a resharded resume may
        change."""
        fixed = {**data_identity(self.cfg), "tokenization": TOKENIZATION,
                 **{f"{data}_fingerprint": value for data, value in self.source.fingerprints.items()}}
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
        loader = DataLoader(_NodeBatches(self, list(self.states), self.next_worker), batch_size=None,
                            num_workers=self.cfg.num_workers, worker_init_fn=_quiet_tokenizers)
        for batch, worker, state in loader:
            self.states[worker] = state
            self.next_worker = (worker + 1) % self.workers
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {**self._identity(), "next_worker": self.next_worker, "workers": copy.deepcopy(self.states)}

    def _check(self, state: dict[str, Any], expected: dict[str, Any]) -> None:
        """Refuse a state of other data in one line naming both values. What an older state does not record: a data
        field (the checkpoint's config.yaml checks it: ``load_checkpoint``); the tokenization came with the
        tokenizer's fingerprint (a state with it was cut by today's rule; one without may not have been, and is
        refused); the source's fingerprint is recorded from this resume on."""
        for key, value in expected.items():
            if key in state:
                if state[key] != value and (key, state[key]) != ("tokenizer_fingerprint", self.source.former_tokenizer):
                    raise DataError(f"data loader state: {key} was {state[key]!r}, this loader has "
                                    f"{value!r}; resume with the same data settings and files")
            elif key == "tokenization" and "tokenizer_fingerprint" not in state:
                raise DataError("data loader state: written by an isollm that recorded neither the tokenizer nor the "
                                "document tokenization, which has changed since (long documents, txt paragraphs): "
                                "continuing would train on other tokens; start another run (name=) for this data")
            elif key == "source_fingerprint" and not self._unchecked:
                self._unchecked = True  # once, not once per rank state
                warnings.warn(f"data loader state: records no source fingerprint (older isollm): {self.cfg.source} "
                              f"could not be checked against it; recorded from this resume on", DataWarning,
                              stacklevel=2)

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
    source_class = PreparedTokens if data_cfg.prepared else StreamingTokens
    return TrainLoader(source_class(data_cfg, tokenizer), data_cfg, micro_batch_size, rank, world_size)
