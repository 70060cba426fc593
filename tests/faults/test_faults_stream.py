"""Streaming read failures: a dropped read is retried from the last good position and the token stream is
unchanged; a source that keeps failing (or a corrupt file) ends in one ``DataError`` naming the shard."""

from __future__ import annotations

import re
import shutil
import warnings
from itertools import islice
from pathlib import Path

import pytest
import torch
from tiny import fail_reads, record_sleeps

from llm.config import DataConfig
from llm.data.errors import DataError
from llm.data.stream import build_train_loader
from llm.data.tokenizer import load_tokenizer
from llm.model.config import ConfigError

BATCHES = 40
"""About 5,000 tokens: 8 or 9 reads of 4 documents (~150 tokens each)."""


def _cfg(source: Path, **fields) -> DataConfig:
    # tokenize_batch=4 over 100-document files: 25 reads a file, so read 3 resumes mid-file
    return DataConfig(source=str(source), seq_len=32, shuffle_block=8, val_bucket=10, val_tokens=330,
                      tokenize_batch=4, retry_backoff_s=1e-3, **fields)


def _stream(cfg: DataConfig, bpe: Path, batches: int = BATCHES) -> torch.Tensor:
    loader = build_train_loader(cfg, load_tokenizer(str(bpe)), micro_batch_size=4, rank=0, world_size=1)
    return torch.stack(list(islice(iter(loader), batches)))


def _retry_of(warning: warnings.WarningMessage) -> str:
    return re.search(r"retry \d+ of \d+", str(warning.message)).group()


@pytest.mark.parametrize("fail_at", [1, 3])
def test_failed_read_is_retried_and_the_stream_is_unchanged(corpus: Path, bpe: Path, fail_at: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(corpus)
    clean = _stream(cfg, bpe)
    reads = fail_reads(monkeypatch, {fail_at}, ConnectionError("Connection reset by peer"))
    sleeps = record_sleeps(monkeypatch)
    with pytest.warns(UserWarning, match=r"reading .*train-0000\d-of-00003\.parquet failed \(ConnectionError: "
                                         r"Connection reset by peer\); retry 1 of 5") as caught:
        retried = _stream(cfg, bpe)
    assert reads["n"] > fail_at  # the failure happened inside the compared stream
    assert len([w for w in caught if "retry" in str(w.message)]) == 1
    assert sleeps == [cfg.retry_backoff_s]
    assert torch.equal(retried, clean)


def test_retries_reset_after_a_good_read(corpus: Path, bpe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two separate drops with read_retries=1 are survived: the budget is per failure, not per run."""
    cfg = _cfg(corpus, read_retries=1)
    clean = _stream(cfg, bpe)
    reads = fail_reads(monkeypatch, {2, 5}, TimeoutError("read timed out"))
    record_sleeps(monkeypatch)
    with pytest.warns(UserWarning, match="retry 1 of 1") as caught:
        assert torch.equal(_stream(cfg, bpe), clean)
    assert reads["n"] > 5  # both failures happened inside the compared stream
    assert len([w for w in caught if "retry" in str(w.message)]) == 2


def test_source_that_keeps_failing_raises_data_error(corpus: Path, bpe: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(corpus, read_retries=3)
    reads = fail_reads(monkeypatch, set(range(1, 100)), ConnectionError("Server Disconnected"))
    sleeps = record_sleeps(monkeypatch)
    with pytest.warns(UserWarning) as caught, pytest.raises(DataError) as raised:
        _stream(cfg, bpe)
    assert [_retry_of(w) for w in caught] == ["retry 1 of 3", "retry 2 of 3", "retry 3 of 3"]
    message = str(raised.value)
    assert message.startswith("data.source: could not read ") and "\n" not in message
    assert str(corpus) in message and "after 3 retries (ConnectionError: Server Disconnected)" in message
    assert reads["n"] == 4  # the first read and 3 retries, then it stops
    assert sleeps == [1e-3, 2e-3, 4e-3]  # exponential backoff: retry_backoff_s * 2**(k - 1)


def test_corrupt_parquet_page_names_the_file(corpus: Path, bpe: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A real failed read, not a mock: zeroed bytes in the middle of a file keep its footer (so the up-front
    check passes) but break a data page, which pyarrow reports as an ``OSError`` deep in ``datasets``."""
    source = tmp_path / "corrupt"
    shutil.copytree(corpus, source)
    bad = source / "train-00001-of-00003.parquet"
    data = bytearray(bad.read_bytes())
    data[len(data) // 4 : len(data) // 2] = bytes(len(data) // 2 - len(data) // 4)
    bad.write_bytes(bytes(data))
    sleeps = record_sleeps(monkeypatch)
    cfg = _cfg(source, read_retries=2, shuffle_shards=False)
    with pytest.warns(UserWarning) as caught, pytest.raises(DataError) as raised:
        _stream(cfg, bpe, batches=400)  # reads on through file 1
    assert [_retry_of(w) for w in caught] == ["retry 1 of 2", "retry 2 of 2"]
    assert f"could not read {bad} after 2 retries (OSError: " in str(raised.value)
    assert len(sleeps) == 2


@pytest.mark.parametrize(("field", "value"), [("read_retries", -1), ("retry_backoff_s", -0.5)])
def test_negative_retry_settings_are_rejected(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{field}.*expected >= 0, got {value}"):
        DataConfig(**{field: value}).validate()
