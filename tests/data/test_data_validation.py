"""The validation split: a stable hash bucket, disjoint from training, identical and cached across builds,
read with the training stream's retries."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny import fail_reads, fineweb_files, forget_sources, record_sleeps
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data import validation
from llm.data.errors import DataError
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
    assert path.is_file() and torch.equal(torch.load(path)["windows"], first)
    # what a rank, a worker count or a data-order seed changes does not touch the validation set
    other = replace(data_cfg, seed=3, num_workers=2, shuffle_block=1)
    assert val_cache_path(other, bpe) == path
    marker = first.flip(0)  # a marker (with its checksum): a second build must read the cache
    torch.save({"windows": marker, "blake2b": validation._windows_digest(marker)}, path)
    assert torch.equal(build_val_windows(other, bpe), marker)
    path.unlink()
    assert torch.equal(build_val_windows(other, bpe), first)  # rebuilt from the source: identical
    assert val_cache_path(replace(data_cfg, seq_len=32), bpe) != path


def test_the_cache_key_records_the_tokenization_scheme(data_cfg: DataConfig, bpe: Tokenizer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """How long documents are tokenized (whole in parts, once their head only; txt paragraphs cut at lines) changes
    the windows without changing any setting: a cache of another scheme must not be read."""

    path = val_cache_path(data_cfg, bpe)
    monkeypatch.setattr(validation, "TOKENIZATION", "the first max_doc_chars characters of a document")
    assert val_cache_path(data_cfg, bpe) != path


def test_minimum_one_window_and_clear_error_when_too_few_tokens(data_cfg: DataConfig, bpe: Tokenizer) -> None:
    assert build_val_windows(replace(data_cfg, val_tokens=1), bpe).shape == (1, data_cfg.seq_len + 1)
    with pytest.raises(ValueError, match=r"data.val_tokens: .* lower data.val_tokens or data.val_bucket"):
        build_val_windows(replace(data_cfg, val_tokens=10**7), bpe)


def test_failed_read_is_retried_and_the_windows_are_unchanged(data_cfg: DataConfig, bpe: Tokenizer,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """Read 2 is the middle of the first file (40 documents, 16 a read): the retry resumes inside it."""
    cfg = replace(data_cfg, retry_backoff_s=1e-3)
    clean = build_val_windows(cfg, bpe)
    reads = fail_reads(monkeypatch, {2}, ConnectionError("Connection reset by peer"))
    sleeps = record_sleeps(monkeypatch)
    with pytest.warns(UserWarning, match=r"reading .*train-00000-of-00003\.parquet failed \(ConnectionError: "
                                         r"Connection reset by peer\); retry 1 of 5") as caught:
        retried = build_val_windows(replace(cfg, cache_dir=str(tmp_path / "other")), bpe)
    assert reads["n"] > 2  # the failure happened inside the build
    assert len([w for w in caught if "retry" in str(w.message)]) == 1
    assert sleeps == [1e-3]
    assert torch.equal(retried, clean)


def test_source_that_keeps_failing_raises_data_error(data_cfg: DataConfig, bpe: Tokenizer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    reads = fail_reads(monkeypatch, set(range(1, 100)), ConnectionError("Server Disconnected"))
    sleeps = record_sleeps(monkeypatch)
    with pytest.warns(UserWarning) as caught, pytest.raises(DataError) as raised:
        build_val_windows(replace(data_cfg, read_retries=2, retry_backoff_s=1e-3), bpe)
    assert [re.search(r"retry \d+ of \d+", str(w.message)).group() for w in caught] == ["retry 1 of 2",
                                                                                       "retry 2 of 2"]
    message = str(raised.value)
    assert message.startswith("data.source: could not read ") and "\n" not in message
    assert "train-00000-of-00003.parquet after 2 retries (ConnectionError: Server Disconnected)" in message
    assert reads["n"] == 3  # the first read and 2 retries, then it stops
    assert sleeps == [1e-3, 2e-3]  # exponential backoff: retry_backoff_s * 2**(k - 1)


def _rebuilt(data_cfg: DataConfig, bpe: Tokenizer) -> torch.Tensor:
    """The validation windows as a new process builds them (the source resolved and fingerprinted afresh)."""
    forget_sources()
    return build_val_windows(data_cfg, bpe)


def test_a_source_rewritten_at_the_same_size_is_another_validation_set(tmp_path: Path, bpe: Tokenizer) -> None:
    """A txt file rewritten with other text of the same size, and a local repository whose parquet changed at the
    same path: before, the cache (keyed by path and size) gave the old validation set while training read the new."""
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(f"document {i} is about apples and pears" for i in range(200)))
    cfg = DataConfig(source=str(text), seq_len=16, val_bucket=4, val_tokens=60, cache_dir=str(tmp_path / "cache"))
    first = _rebuilt(cfg, bpe)
    text.write_text(text.read_text().replace("apples", "plants"))  # same size, other tokens
    assert not torch.equal(second := _rebuilt(cfg, bpe), first)
    forget_sources()
    assert torch.equal(second, validation.build_val_windows(replace(cfg, cache_dir=str(tmp_path / "fresh")), bpe))

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                    "    path: data/*.parquet\n---\n")
    rows = pq.read_table(fineweb_files()[0], columns=["text", "id"]).slice(0, 240).to_pylist()
    pq.write_table(pa.Table.from_pylist(rows[:120]), repo / "data" / "train.parquet")
    cfg = replace(cfg, source=str(repo), name="default", val_bucket=10, val_tokens=100)
    first = _rebuilt(cfg, bpe)
    pq.write_table(pa.Table.from_pylist(rows[120:240]), repo / "data" / "train.parquet")
    assert not torch.equal(_rebuilt(cfg, bpe), first)
