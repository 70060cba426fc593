"""What a run's data is, derived from the whole ``DataConfig``: every field but a declared few.

A resume checks it three times, each from this one derivation: the checkpoint's config.yaml against the run's
(``llm.train.checkpoint.load_checkpoint``), every rank's loader state (``llm.data.stream.TrainLoader``), and a
prepared directory's index (``llm.data.shards.PreparedTokens``, less what is applied when its tokens are read). A
field added to ``DataConfig`` is part of the identity by default: leaving one out takes an entry below, with why.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from llm.config import DataConfig

__all__ = ["NOT_IDENTITY", "READ_TIME", "data_identity", "identity_differences"]

NOT_IDENTITY = {
    "source": "its files' content is the source fingerprint, recorded beside: the same files at another path (another "
              "mount, node or directory) are the same data",
    "tokenizer": "the tokenizer fingerprint stands for it: the same tokenizer at another path gives the same ids",
    "prepared": "the prepared fingerprint stands for the directory's tokens (none when streaming)",
    "num_workers": "how the stream is cut among DataLoader workers: a loader state records it as its topology, which "
                   "prepared tokens may change on resume",
    "tokenize_batch": "rows per tokenizer call: the same tokens in other batches (a resume re-reads by position)",
    "cache_dir": "where the validation set and the parquet footers are cached, each keyed by what it holds",
    "read_retries": "how often a failed read is retried: the rows read are the same",
    "retry_backoff_s": "how long to wait between retries: the rows read are the same",
}
"""The fields of ``DataConfig`` that cannot change a training token, the order of the tokens, the validation split or
how the model sees them; every other field is identity."""

READ_TIME = frozenset({"seq_len", "document_masking", "seed", "shuffle_block", "shuffle_shards", "val_tokens"})
"""Fields applied when prepared tokens are read (windows, order, masks, the validation set): not prepared into them."""


def data_identity(cfg: DataConfig, exempt: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Every field of ``cfg`` but ``NOT_IDENTITY`` and ``exempt``, by name."""
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in NOT_IDENTITY and f.name not in exempt}


def identity_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"field (recorded r, now c)"`` for each field of ``current`` that ``recorded`` holds with another value. A
    field it lacks was added after it was written: the checkpoint's config.yaml, read back with today's schema,
    checks that one (an older loader state or prepared index records fewer fields)."""
    return [f"{key} (recorded {recorded[key]!r}, now {value!r})" for key, value in current.items()
            if key in recorded and recorded[key] != value]
