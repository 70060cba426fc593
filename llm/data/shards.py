"""Pre-tokenized tokens: ``isollm-data prepare`` writes them, ``PreparedTokens`` reads them by memmap.

Layout of a prepared directory (one token file per source file; the index records each piece's token range,
so the pieces can be visited in the streaming reader's epoch order)::

    index.json            format, source identity and fingerprint (``source_fingerprint``: what the tokens were
                          read from), tokenizer fingerprint, val_bucket, max_doc_chars, the data fields it was
                          prepared with (``llm.data.identity``), files
                          (each with its token count and checksum: ``llm.data.prepared_index``), pieces
                          (written last)
    tokens_00000.bin      uint32 tokens of file 0's training documents, each followed by EOS (no file for a file
                          without training documents)

``PreparedTokens`` reads by global window index: the global token stream is the pieces' tokens in each
epoch's order, epoch after epoch (exactly what one streaming node reads); window g is its tokens
``[g(L+1), (g+1)(L+1))``; the shuffled order permutes blocks of ``shuffle_block`` windows like the streaming
shuffle of node 0 of 1; and node i of N takes shuffled positions i, i + N, i + 2N, ... So one node yields
the streaming batches, N nodes split one global order evenly (to a window), and a position is a count.

A node's state is ``{"from": F, "skip": [...], "taken": m}``: its positions are ``F + i + N k`` (k = 0,
1, ...) that are not in ``skip``, of which it has taken the first ``m``. A run resumed with another number
of nodes starts from the first position no node took, skipping those taken beyond it (``reshard``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data.cache_io import write_atomically
from llm.data.errors import DataError
from llm.data.identity import READ_TIME, data_identity, identity_differences
from llm.data.prepared_index import CHECKSUM, FORMAT, INDEX_FILE, file_problems, read_index
from llm.data.sources import data_source, source_fingerprint
from llm.data.split import epoch_order
from llm.data.streaming import StreamingTokens
from llm.data.token_source import State, TokenSource, block_permutation
from llm.data.tokenizer import TOKENIZATION, encode_documents, former_tokenizer_identity, tokenizer_identity, top_id

__all__ = ["FORMAT", "INDEX_FILE", "START", "PreparedTokens", "continue_positions", "node_positions", "prepare"]

# A node's state before its first window.
START: State = {"from": 0, "skip": [], "taken": 0}


def prepare(data_cfg: DataConfig, tokenizer: Tokenizer, out_dir: str | Path, max_tokens: int | None = None
            ) -> dict[str, Any]:
    """Tokenize the training (non-validation) documents of ``data_cfg.source`` into ``out_dir``, all of them
    or, with ``max_tokens``, whole documents in source order up to the first that reaches the limit (so at most
    one document more than ``max_tokens``); returns the index.
    Validation documents are left out: ``build_val_windows`` reads them from the source."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stream = StreamingTokens(data_cfg, tokenizer)
    files = {file: k for k, file in enumerate(dict.fromkeys(p.file for p in stream.pieces))}
    written = [0] * len(files)
    digests = [xxhash.xxh3_64() for _ in files]  # of each file's bytes as written (cache_io.file_checksum)
    total = 0  # sum(written)
    pieces = []
    for k in range(len(files)):  # an earlier prepare's: a file without training tokens (max_tokens left it
        (out / f"tokens_{k:05d}.bin").unlink(missing_ok=True)  # unread, or all validation) gets no token file
    for index, piece in enumerate(stream.pieces):
        if max_tokens is not None and total >= max_tokens:
            break
        k = files[piece.file]
        start, docs, held_out = written[k], 0, 0
        for _, texts, dropped in stream.piece_docs(index, 0, piece.size):
            held_out += dropped
            if texts:
                tokens, lengths = encode_documents(stream.tokenizer, texts, stream.eos, data_cfg.max_doc_chars)
                if max_tokens is not None and total + len(tokens) > max_tokens:  # stop after the document
                    keep = int(np.searchsorted(np.cumsum(lengths), max_tokens - total)) + 1  # that reaches it
                    tokens, texts = tokens[: int(lengths[:keep].sum())], texts[:keep]
                # a file's pieces are consecutive in source order; opened per batch, a file is created with its
                # first tokens, and one is open at a time (a repository may hold more files than a process may open)
                with (out / f"tokens_{k:05d}.bin").open("ab") as output:
                    output.write(data := tokens.tobytes())
                digests[k].update(data)
                written[k] += len(tokens)
                total += len(tokens)
                docs += len(texts)
            if max_tokens is not None and total >= max_tokens:
                break
        pieces.append({"file": k, "start": start, "num_tokens": written[k] - start, "num_docs": docs,
                       "num_held_out": held_out})
    index = {"format": FORMAT, "source": stream.source.identity(), "source_fingerprint": stream.fingerprints["source"],
             "tokenizer": stream.fingerprints["tokenizer"],
             "val_bucket": data_cfg.val_bucket, "max_doc_chars": data_cfg.max_doc_chars, "tokenization": TOKENIZATION,
             "max_tokens": max_tokens, "data": data_identity(data_cfg, READ_TIME),
             "files": [{"tokens": f"tokens_{k:05d}.bin", "num_tokens": n, CHECKSUM: digest.hexdigest()}
                       for k, (n, digest) in enumerate(zip(written, digests, strict=True))],
             "pieces": pieces}
    write_atomically(out / INDEX_FILE, lambda tmp: tmp.write_text(json.dumps(index, indent=1)))
    return index


def _source_difference(prepared_from: dict[str, Any], configured: dict[str, Any]) -> str | None:
    """The first way two ``Source.identity()`` differ, or None. Local files compare by name and size, not
    by path: the same files reached from another directory, node or mount are the same source."""
    for key in ("path", "name", "split", "text_column", "id_column"):
        if key == "path" and configured["files"]:
            continue  # a local source's path is where its files sit
        if prepared_from.get(key) != configured[key]:
            return f"source.{key} {prepared_from.get(key)!r} vs {configured[key]!r}"
    prepared_files = [(Path(f).name, size) for f, size in prepared_from.get("files", [])]
    files = [(Path(f).name, size) for f, size in configured["files"]]
    if len(prepared_files) != len(files):
        return f"{len(prepared_files)} files vs {len(files)}"
    for (was, was_size), (now, now_size) in zip(prepared_files, files, strict=True):
        if (was, was_size) != (now, now_size):
            return f"file {was} of {was_size} bytes vs {now} of {now_size} bytes"
    return None


def _class_index(first: int, offset: int, num_nodes: int, skip: list[int], taken: int) -> int:
    """k such that the first ``taken`` positions ``first + offset + num_nodes * k`` not in ``skip`` are
    those with a smaller k."""
    k = taken
    for q in sorted(skip):
        rel = q - first - offset
        if rel >= 0 and rel % num_nodes == 0:
            if rel // num_nodes < k:
                k += 1
            else:
                break
    return k


class PreparedTokens(TokenSource):
    """Training tokens read by memmap from a prepared directory, by global window index."""

    resharding = True

    def __init__(self, data_cfg: DataConfig, tokenizer: Tokenizer) -> None:
        assert data_cfg.prepared is not None
        self.root = Path(data_cfg.prepared)
        self.index = read_index(self.root)
        # a token file cut short would fail only when the loader reaches its missing part, hundreds of steps in
        if (problem := next(file_problems(self.root, self.index), None)) is not None:
            raise DataError(f"data.prepared: {problem}; prepare again (`isollm-data verify {self.root}` checks "
                            "every file)")
        # Every id read is checked against the tokenizer's top id (``tokens``), which the run's model.vocab_size
        # exceeds (``ids_past``): a flipped bit would otherwise be an IndexError in the embedding, or a device
        # assert on CUDA, when its window came up. Not a scan of every file here (a 10B-token directory is 40 GB to
        # read at every start), nor a maximum recorded at prepare time (bytes damaged after it keep the record):
        # the max of each window read (10 us a 2,049-token window on one busy CPU core, 2026-11-26).
        self.top_id = top_id(tokenizer)
        # an index prepared before 2026-12-01 records the tokenizer by the former rule
        if self.index["tokenizer"] not in (tokenizer_identity(tokenizer), former_tokenizer_identity(tokenizer)):
            raise DataError(f"data.prepared: {self.root} was tokenized with another tokenizer than data.tokenizer")
        if self.index.get("tokenization") != TOKENIZATION:  # its held-out documents were cut by another rule
            raise DataError(f"data.prepared: {self.root} was prepared with another document tokenization "
                            f"({self.index.get('tokenization', 'not recorded')!r}, now {TOKENIZATION!r}); "
                            "prepare again")
        # every data field the tokens were prepared with (``llm.data.identity``); an older index records two
        recorded = self.index.get("data") or {key: self.index[key] for key in ("val_bucket", "max_doc_chars")}
        if diffs := identity_differences(recorded, data_identity(data_cfg, READ_TIME)):
            raise DataError(f"data.prepared: {self.root} was prepared with other data settings: {', '.join(diffs)}; "
                            "prepare again")
        # the validation set is read from data.source, so tokens prepared from another source would not
        # have its held-out documents removed (or would train on another corpus than the one evaluated)
        if difference := _source_difference(self.index["source"], data_source(data_cfg).identity()):
            raise DataError(f"data.prepared: {self.root} was prepared from another source than data.source "
                            f"({difference}); prepare again")
        self.cfg = data_cfg
        # the index records every token file's checksum: another preparation is another fingerprint. The source's is
        # the one prepare recorded of what it tokenized, not a new hash of files the run does not read (an index
        # written before it was recorded: the source's now, as then)
        self.fingerprints = {"tokenizer": self.index["tokenizer"], "prepared": xxhash.xxh3_64_hexdigest(
            json.dumps(self.index, sort_keys=True).encode()),
            "source": self.index.get("source_fingerprint") or source_fingerprint(data_source(data_cfg))}
        self.lengths = np.array([p["num_tokens"] for p in self.index["pieces"]], dtype=np.int64)
        self.epoch_tokens = int(self.lengths.sum())
        if self.epoch_tokens == 0:
            raise DataError(f"data.prepared: {self.root} holds no training tokens")
        self._memmaps: dict[int, np.ndarray] = {}
        self._epoch: tuple[int, list[int], np.ndarray] | None = None
        self._block: tuple[int, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a memmap pickled into a spawned worker would be copied whole: each process opens its own
        return {**self.__dict__, "_memmaps": {}}

    def _file(self, k: int) -> np.ndarray:
        if k not in self._memmaps:
            entry = self.index["files"][k]
            self._memmaps[k] = (np.memmap(self.root / entry["tokens"], dtype=np.uint32, mode="r")
                                if entry["num_tokens"] else np.zeros(0, dtype=np.uint32))
        return self._memmaps[k]

    def _order(self, epoch: int) -> tuple[list[int], np.ndarray]:
        """(piece order of the epoch, end offset of each visited piece in the epoch's tokens)."""
        if self._epoch is None or self._epoch[0] != epoch:
            order = epoch_order(len(self.lengths), self.cfg.seed, epoch, self.cfg.shuffle_shards)
            self._epoch = (epoch, order, np.cumsum(self.lengths[order]))
        return self._epoch[1], self._epoch[2]

    def tokens(self, begin: int, end: int) -> np.ndarray:
        """Tokens ``[begin, end)`` of the global stream (epochs end to end)."""
        parts = []
        while begin < end:
            epoch, offset = divmod(begin, self.epoch_tokens)
            order, ends = self._order(epoch)
            slot = int(np.searchsorted(ends, offset, side="right"))
            piece = self.index["pieces"][order[slot]]
            inside = offset - (int(ends[slot]) - piece["num_tokens"])
            take = min(end - begin, piece["num_tokens"] - inside)
            parts.append(self._file(piece["file"])[piece["start"] + inside : piece["start"] + inside + take])
            if (found := int(parts[-1].max())) > self.top_id:
                raise DataError(f"data.prepared: {self.root / self.index['files'][piece['file']]['tokens']} holds "
                                f"token id {found:,}, past the tokenizer's ids (0 to {self.top_id:,}): the file is "
                                f"damaged (`isollm-data verify {self.root}`); prepare again")
            begin += take
        return np.concatenate(parts)

    def window(self, position: int) -> np.ndarray:
        """The window at shuffled position ``position`` of the global order."""
        size = self.cfg.shuffle_block
        block, inside = divmod(position, size)
        if self._block is None or self._block[0] != block:
            self._block = (block, block_permutation(self.cfg.seed, 0, 1, block, size))
        width = self.cfg.seq_len + 1
        g = block * size + int(self._block[1][inside])
        return self.tokens(g * width, (g + 1) * width)

    def node_windows(self, node: int, num_nodes: int, state: State | None) -> Iterator[tuple[np.ndarray, State]]:
        state = state or START
        for taken, position in enumerate(node_positions(state, node, num_nodes), start=state["taken"] + 1):
            yield self.window(position), {**state, "taken": taken}

    def reshard(self, states: list[State | None], num_nodes: int) -> list[State]:
        return continue_positions(states, num_nodes)


def node_positions(state: State, node: int, num_nodes: int) -> Iterator[int]:
    """Node ``node``'s positions of the global shuffled order that it has not taken yet, in order."""
    first, skipped = state["from"], set(state["skip"])
    for k in itertools.count(_class_index(first, node, num_nodes, state["skip"], state["taken"])):
        position = first + node + num_nodes * k
        if position not in skipped:
            yield position


def continue_positions(states: list[State | None], num_nodes: int) -> list[State]:
    """States of ``num_nodes`` nodes that continue where ``states`` (every node of the previous run) left the
    global order: from the first position no node took, skipping the positions taken beyond it."""
    states = [s or START for s in states]
    first, skip = states[0]["from"], states[0]["skip"]
    old = len(states)
    taken_before = set(skip)  # positions >= first taken before the last reshard
    # each old node took every position of its class below ``ends[i]`` (itself, or before as skip)
    ends = [first + i + old * _class_index(first, i, old, skip, s["taken"]) for i, s in enumerate(states)]
    frontier = []
    for end in ends:
        while end in taken_before:
            end += old
        frontier.append(end)
    new_first = min(frontier)
    new_skip = {q for q in taken_before if q >= new_first}
    for i, end in enumerate(frontier):
        lowest = new_first + (first + i - new_first) % old
        new_skip.update(range(lowest, end, old))
    return [{"from": new_first, "skip": sorted(new_skip), "taken": 0} for _ in range(num_nodes)]
