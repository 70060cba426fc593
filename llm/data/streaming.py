"""Streamed training tokens (``StreamingTokens``): per node, a deterministic resumable stream of windows.

1. Epoch split (``llm.data.split``): every epoch orders the source's pieces (parquet row groups, or whole
   jsonl/txt files) by ``(seed, epoch)`` and gives each node a contiguous ``1/num_nodes`` of the epoch's rows
   (bytes for jsonl/txt): one global epoch, whatever the number of files.
2. Validation documents are dropped (``validation.is_validation``), every document is tokenized whole (in
   parts of at most ``max_doc_chars`` characters) with EOS appended, and the node's token stream is cut into
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
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data.errors import DataError
from llm.data.pieces import Piece, PieceReader
from llm.data.sources import Source, data_source, source_fingerprint
from llm.data.split import epoch_order, node_segments
from llm.data.token_source import State, TokenSource, block_permutation
from llm.data.tokenizer import encode_documents, eos_id, former_tokenizer_identity, tokenizer_identity
from llm.data.validation import split_batch


class StreamingTokens(TokenSource):
    """Training tokens streamed from a repository (hub or local) or local files, by pieces."""

    def __init__(self, data_cfg: DataConfig, tokenizer: Tokenizer) -> None:
        self.reader = PieceReader(data_source(data_cfg), data_cfg)
        self.source: Source = self.reader.source
        self.pieces: tuple[Piece, ...] = self.reader.pieces
        self.tokenizer = tokenizer
        self.eos = eos_id(tokenizer)
        self.cfg = data_cfg
        self.fingerprints = {"tokenizer": tokenizer_identity(tokenizer), "prepared": None,
                             "source": source_fingerprint(self.source)}
        self.former_tokenizer = former_tokenizer_identity(tokenizer)

    def piece_docs(self, piece: int, start: int, hi: int) -> Iterator[tuple[int, list[str], int]]:
        """(position before the batch, training texts of the batch, how many validation documents it dropped) of a
        piece's range, a failed read retried (``PieceReader.batches``)."""
        for before, rows, _ in self.reader.batches(piece, start, hi):
            train, held_out = split_batch(rows, self.source, self.cfg.val_bucket)
            yield before, train, len(held_out)

    def tokens(self, docs: list[str]) -> np.ndarray:
        return encode_documents(self.tokenizer, docs, self.eos, self.cfg.max_doc_chars)[0]

    def chunks(self, epoch: int, node: int, num_nodes: int, start: State | None
               ) -> Iterator[tuple[State, np.ndarray]]:
        """(position at the chunk's start, its tokens) for this node's documents of one epoch, from
        ``start`` (a position yielded earlier) or the epoch's beginning."""
        order = epoch_order(len(self.pieces), self.cfg.seed, epoch, self.cfg.shuffle_shards)
        segments = node_segments(self.pieces, order, node, num_nodes)
        first, at = (start["seg"], start["at"]) if start else (0, None)
        for seg in range(first, len(segments)):
            piece, lo, hi = segments[seg]
            for before, docs, _ in self.piece_docs(piece, at if seg == first and at is not None else lo, hi):
                if docs:
                    yield {"seg": seg, "at": before}, self.tokens(docs)

    def node_windows(self, node: int, num_nodes: int, state: State | None) -> Iterator[tuple[np.ndarray, State]]:
        return iter_windows(self, node, num_nodes, self.cfg.seq_len + 1, self.cfg.seed, self.cfg.shuffle_block,
                            state)


def _windows(source: StreamingTokens, node: int, num_nodes: int, width: int, start: State,
             max_epochs: int | None) -> Iterator[tuple[np.ndarray, State]]:
    """(window of ``width`` tokens, state where the next window starts) over epochs, from a window-start state;
    a final partial window is dropped."""
    epoch, pos, offset = start["epoch"], start["pos"], start["offset"]
    parts: list[np.ndarray] = []
    have = 0
    while max_epochs is None or epoch < max_epochs:
        empty = pos is None
        for chunk_pos, tokens in source.chunks(epoch, node, num_nodes, pos):
            empty = False
            i = offset  # the tokens of the chunk before ``offset`` went into windows before ``start``
            while i < len(tokens):
                take = min(width - have, len(tokens) - i)
                parts.append(tokens[i : i + take])
                have += take
                i += take
                if have == width:
                    yield np.concatenate(parts), {"epoch": epoch, "pos": chunk_pos, "offset": i}
                    parts, have = [], 0
            offset = 0
        if empty:
            raise DataError(f"data: node {node} of {num_nodes} (rank x worker) got no training documents in epoch "
                            f"{epoch} from a source of {len(source.pieces)} piece(s); use fewer ranks/workers or "
                            "more data")
        epoch, pos, offset = epoch + 1, None, 0


def iter_windows(source: StreamingTokens, node: int, num_nodes: int, width: int, seed: int, shuffle_block: int,
                 state: State | None = None, max_epochs: int | None = None) -> Iterator[tuple[np.ndarray, State]]:
    """One node's shuffled windows, each with the node state after it (resume from it to continue)."""
    state = state or {"block": 0, "index": 0, "start": {"epoch": 0, "pos": None, "offset": 0}}
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
