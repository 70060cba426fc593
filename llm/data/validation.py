"""The held-out validation set: a stable hash bucket of documents, materialised once and cached.

A document is validation iff blake2b(id) mod ``val_bucket`` == 0 (its text when the source has no id
column). blake2b rather than ``hash()``: Python salts string hashes per process, which would give every rank
and every run a different split. Training streams drop these documents; ``build_val_windows`` packs them in
source order into a fixed tensor that every variant, seed and rank of a comparison evaluates on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data.cache_io import warn_rebuilding, write_atomically
from llm.data.errors import DataError
from llm.data.pieces import PieceReader
from llm.data.sources import Source, data_source, source_fingerprint
from llm.data.tokenizer import TOKENIZATION, encode_documents, eos_id, tokenizer_identity
from llm.errors import one_line

__all__ = ["build_val_windows", "is_validation", "split_batch", "val_cache_path"]


def is_validation(key: str, bucket: int) -> bool:
    """Whether a document (by its id, or its text when there is no id) belongs to the validation bucket."""
    digest = hashlib.blake2b(key.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % bucket == 0


def split_batch(batch: dict[str, list], source: Source, bucket: int) -> tuple[list[str], list[str]]:
    """(training texts, validation texts) of a batch of rows, in order; empty documents belong to neither."""
    if source.text_column not in batch:
        raise DataError(f"data.source: {source.path} has no column {source.text_column!r} "
                         f"(columns: {', '.join(batch)}); set data.text_column")
    texts = batch[source.text_column]
    keys = batch[source.id_column] if source.id_column else texts
    train: list[str] = []
    val: list[str] = []
    for text, key in zip(texts, keys, strict=True):
        if text:
            (val if is_validation(str(key if key is not None else text), bucket) else train).append(text)
    return train, val


def val_cache_path(data_cfg: DataConfig, tokenizer: Tokenizer) -> Path:
    """Cache file of the validation windows, keyed by everything that determines their tokens: the source's files
    by their content (``source_fingerprint``), not their path and size alone."""
    source = data_source(data_cfg)
    key = {"source": source.identity(), "content": source_fingerprint(source),
           "tokenizer": tokenizer_identity(tokenizer), "seq_len": data_cfg.seq_len, "val_bucket": data_cfg.val_bucket,
           "val_tokens": data_cfg.val_tokens, "max_doc_chars": data_cfg.max_doc_chars, "tokenization": TOKENIZATION}
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=10).hexdigest()
    return Path(data_cfg.cache_dir) / f"val_{digest}.pt"


def _val_texts(data_cfg: DataConfig) -> Iterator[list[str]]:
    """The validation texts of each batch of rows, in source order (shard by shard, a failed read retried
    like the training stream's)."""
    reader = PieceReader(data_source(data_cfg), data_cfg)
    for index, piece in enumerate(reader.pieces):
        for _, batch, _ in reader.batches(index, 0, piece.size):
            yield split_batch(batch, reader.source, data_cfg.val_bucket)[1]


def _windows_digest(windows: torch.Tensor) -> str:
    return hashlib.blake2b(windows.numpy().tobytes(), digest_size=16).hexdigest()


def _load_cached_windows(path: Path, shape: tuple[int, int]) -> torch.Tensor | None:
    """The cached windows when the file holds them intact (its shape and checksum), else None with a
    warning naming the file (it is rebuilt): a torn or corrupted cache must not change the validation set."""
    try:
        cached = torch.load(path, weights_only=True)
        windows = cached["windows"] if isinstance(cached, dict) else None
        if isinstance(windows, torch.Tensor) and tuple(windows.shape) == shape and windows.dtype == torch.int64 \
                and cached.get("blake2b") == _windows_digest(windows):
            return windows
        reason = "not the windows of this data config with their checksum"
    except Exception as err:  # torch.load raises RuntimeError, UnpicklingError, EOFError, ... on bad bytes
        reason = one_line(err)
    warn_rebuilding("validation cache", path, reason)
    return None


def build_val_windows(data_cfg: DataConfig, tokenizer: Tokenizer) -> torch.Tensor:
    """LongTensor[N, seq_len + 1] of held-out tokens, N = max(1, val_tokens // (seq_len + 1)).

    Validation documents are taken in source order (no shuffle: the set must not depend on the data seed),
    each followed by EOS, packed into non-overlapping windows, and cached in ``data_cfg.cache_dir`` with a checksum
    (``write_atomically``: concurrent ranks never read a partial file; ``_load_cached_windows``)."""
    path = val_cache_path(data_cfg, tokenizer)
    width = data_cfg.seq_len + 1
    num_windows = max(1, data_cfg.val_tokens // width)
    if path.is_file() and (cached := _load_cached_windows(path, (num_windows, width))) is not None:
        return cached
    need = num_windows * width
    eos = eos_id(tokenizer)
    parts, have, docs = [], 0, 0
    for texts in _val_texts(data_cfg):
        if texts:
            parts.append(encode_documents(tokenizer, texts, eos, data_cfg.max_doc_chars)[0])
            have += len(parts[-1])
            docs += len(texts)
        if have >= need:
            break
    if have < need:
        raise DataError(f"data.val_tokens: the held-out documents of {data_cfg.source} ({docs} docs, 1 in "
                        f"{data_cfg.val_bucket}) hold {have} tokens, fewer than {need} ({num_windows} window(s) of "
                        f"{width}); lower data.val_tokens or data.val_bucket")
    windows = torch.from_numpy(np.concatenate(parts)[:need].astype(np.int64)).view(num_windows, width)
    write_atomically(path, lambda tmp: torch.save({"windows": windows, "blake2b": _windows_digest(windows)}, tmp))
    return windows
