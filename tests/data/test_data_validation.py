"""The validation split: a stable hash bucket, disjoint from training, identical and cached across builds."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data.tokenizer import eos_id
from llm.data.validation import build_val_windows, is_validation, val_cache_path


def test_bucket_is_a_stable_hash() -> None:
    key = "<urn:uuid:0001>"
    value = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    assert is_validation(key, 7) == (value % 7 == 0)
    share = sum(is_validation(f"doc-{i}", 50) for i in range(20_000)) / 20_000
    assert abs(share - 1 / 50) < 0.005
    assert all(is_validation(f"doc-{i}", 1) for i in range(10))


def test_val_windows_are_the_held_out_documents_in_order(data_cfg: DataConfig, bpe: Tokenizer) -> None:
    windows = build_val_windows(data_cfg, bpe)
    width = data_cfg.seq_len + 1
    assert windows.shape == (data_cfg.val_tokens // width, width) and windows.dtype == torch.long
    eos = eos_id(bpe)
    expected = []
    for path in sorted(Path(data_cfg.source).glob("*.parquet")):
        for row in pq.read_table(path).to_pylist():
            if is_validation(row["id"], data_cfg.val_bucket):
                expected += [*bpe.encode(row["text"], add_special_tokens=False).ids, eos]
    assert windows.reshape(-1).tolist() == expected[: windows.numel()]


def test_val_windows_identical_across_builds_ranks_and_cached(data_cfg: DataConfig, bpe: Tokenizer) -> None:
    first = build_val_windows(data_cfg, bpe)
    path = val_cache_path(data_cfg, bpe)
    assert path.is_file() and torch.equal(torch.load(path), first)
    # what a rank, a worker count or a data-order seed changes does not touch the validation set
    other = replace(data_cfg, seed=3, num_workers=2, shuffle_block=1)
    assert val_cache_path(other, bpe) == path
    torch.save(torch.zeros(2, 3, dtype=torch.long), path)  # a marker: a second build must read the cache
    assert build_val_windows(other, bpe).shape == (2, 3)
    path.unlink()
    assert torch.equal(build_val_windows(other, bpe), first)  # rebuilt from the source: identical
    assert val_cache_path(replace(data_cfg, seq_len=32), bpe) != path


def test_minimum_one_window_and_clear_error_when_too_few_tokens(data_cfg: DataConfig, bpe: Tokenizer) -> None:
    assert build_val_windows(replace(data_cfg, val_tokens=1), bpe).shape == (1, data_cfg.seq_len + 1)
    with pytest.raises(ValueError, match=r"data.val_tokens: .* lower data.val_tokens or data.val_bucket"):
        build_val_windows(replace(data_cfg, val_tokens=10**7), bpe)
