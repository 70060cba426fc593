"""Fixtures of the launch tests: a small FineWeb slice and a BPE trained on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import write_docs

from llm.data import train_tokenizer


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 FineWeb sample documents in 2 parquet files: enough windows for 2 ranks, seconds to stream."""
    return write_docs(tmp_path_factory.mktemp("corpus"), 200, 2)


@pytest.fixture(scope="session")
def tokenizer_file(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    train_tokenizer([str(corpus)], 512, out)
    return out / "tokenizer.json"
