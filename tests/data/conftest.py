"""Shared fixtures: small slices of the FineWeb sample written to tmp dirs, and a small trained BPE."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import write_docs
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data.tokenizer import train_tokenizer

CHARS = 600
"""Sample texts are cut to this many characters to keep tests fast."""


@pytest.fixture(autouse=True)
def outside_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run in ``tmp_path``: a command given no ``data.cache_dir`` (isollm-data plan, prepare) writes the default
    one, relative to the working directory, and must not write it into the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def five_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 files for 4 nodes: more files than nodes."""
    return write_docs(tmp_path_factory.mktemp("five"), 150, 5, chars=CHARS)


@pytest.fixture(scope="session")
def three_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 files for 4 nodes: fewer files than nodes."""
    return write_docs(tmp_path_factory.mktemp("three"), 120, 3, chars=CHARS)


@pytest.fixture(scope="session")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A 512-token byte-level BPE trained on the first 240 sample documents."""
    corpus = write_docs(tmp_path_factory.mktemp("corpus"), 240, 1, chars=CHARS)
    return train_tokenizer([str(corpus)], 512, tmp_path_factory.mktemp("tok"))


@pytest.fixture
def data_cfg(tmp_path: Path, three_shards: Path) -> DataConfig:
    return DataConfig(source=str(three_shards), seq_len=64, shuffle_block=8, val_bucket=20, val_tokens=500,
                      tokenize_batch=16, cache_dir=str(tmp_path / "cache"))
