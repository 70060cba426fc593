"""Pre-tokenized shards: ``isollm-data prepare`` writes them, ``PreparedTokens`` reads them by memmap.

Layout of a prepared directory (one token shard per source shard, so shard order, node split, windows,
block shuffle and loader state are those of the streaming reader, and the two yield identical batches)::

    index.json            format, source identity, tokenizer fingerprint, val_bucket, shards (written last)
    tokens_00000.bin      uint32 tokens of shard 0's training documents, each followed by EOS
    docs_00000.npy        int64 document boundaries: document k is tokens [docs[k], docs[k + 1])
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data.errors import DataError
from llm.data.sources import data_source
from llm.data.stream import StreamingTokens, TokenSource
from llm.data.tokenizer import encode_documents, tokenizer_identity

__all__ = ["FORMAT", "INDEX_FILE", "PreparedTokens", "prepare"]

INDEX_FILE = "index.json"
FORMAT = 1
"""Layout version written to the index; the reader refuses any other."""


def prepare(data_cfg: DataConfig, tokenizer: Tokenizer, out_dir: str | Path) -> dict[str, Any]:
    """Tokenize every training (non-validation) document of ``data_cfg.source`` into ``out_dir``; returns
    the index. Validation documents are left out: ``build_val_windows`` reads them from the source."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stream = StreamingTokens(data_cfg, tokenizer)
    shards = []
    for shard in range(stream.num_shards):
        tokens_file, docs_file = f"tokens_{shard:05d}.bin", f"docs_{shard:05d}.npy"
        lengths = []
        with (out / tokens_file).open("wb") as f:
            for _, texts in stream.shard_docs(shard, None):
                if texts:
                    tokens, doc_lengths = encode_documents(tokenizer, texts, stream.eos)
                    f.write(tokens.tobytes())
                    lengths.append(doc_lengths)
        bounds = np.concatenate([[0], np.cumsum(np.concatenate(lengths) if lengths else [])]).astype(np.int64)
        np.save(out / docs_file, bounds)
        shards.append({"tokens": tokens_file, "docs": docs_file, "num_docs": len(bounds) - 1,
                       "num_tokens": int(bounds[-1])})
    index = {"format": FORMAT, "source": stream.source.identity(), "tokenizer": tokenizer_identity(tokenizer),
             "val_bucket": data_cfg.val_bucket, "shards": shards}
    tmp = out / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / INDEX_FILE)
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


class PreparedTokens(TokenSource):
    """Training tokens read by memmap from a prepared directory."""

    def __init__(self, data_cfg: DataConfig, tokenizer: Tokenizer) -> None:
        assert data_cfg.prepared is not None
        self.root = Path(data_cfg.prepared)
        index_path = self.root / INDEX_FILE
        if not index_path.is_file():
            raise FileNotFoundError(f"data.prepared: no {INDEX_FILE} in {self.root} "
                                    "(write it with `isollm-data prepare`)")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != FORMAT:
            raise DataError(f"data.prepared: {index_path} has format {self.index.get('format')!r}, this reader "
                            f"reads format {FORMAT}; prepare again")
        if self.index["tokenizer"] != tokenizer_identity(tokenizer):
            raise DataError(f"data.prepared: {self.root} was tokenized with another tokenizer "
                             "than data.tokenizer")
        if self.index["val_bucket"] != data_cfg.val_bucket:
            raise DataError(f"data.prepared: {self.root} holds out 1/{self.index['val_bucket']} documents, "
                             f"data.val_bucket is {data_cfg.val_bucket}; prepare again")
        # the validation set is read from data.source, so tokens prepared from another source would not
        # have its held-out documents removed (or would train on another corpus than the one evaluated)
        difference = _source_difference(self.index["source"], data_source(data_cfg).identity())
        if difference:
            raise DataError(f"data.prepared: {self.root} was prepared from another source than data.source "
                            f"({difference}); prepare again")
        self.num_shards = len(self.index["shards"])
        self.cfg = data_cfg

    def _open(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        # opened per pass rather than in __init__: a memmap pickled into a spawned worker is copied whole
        entry = self.index["shards"][shard]
        bounds = np.load(self.root / entry["docs"])
        if entry["num_tokens"] == 0:
            return np.zeros(0, dtype=np.uint32), bounds
        return np.memmap(self.root / entry["tokens"], dtype=np.uint32, mode="r"), bounds

    def shard_docs(self, shard: int, state: int | None) -> Iterator[tuple[int, list[np.ndarray]]]:
        """(index of the first document, the documents' tokens) in batches of ``data.tokenize_batch``."""
        tokens, bounds = self._open(shard)
        num_docs = len(bounds) - 1
        for doc in range(state or 0, num_docs, self.cfg.tokenize_batch):
            end = min(doc + self.cfg.tokenize_batch, num_docs)
            yield doc, [tokens[bounds[k] : bounds[k + 1]] for k in range(doc, end)]

    def tokens(self, docs: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(docs)
