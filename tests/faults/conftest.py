"""Fixtures of the fault-injection tests: slices of the real FineWeb sample, a small BPE trained on a few
hundred of its documents, and the tiny run overrides of a 2-layer, width-32 model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tiny import TINY_TRAIN, write_docs

from llm.data import train_tokenizer

TINY = [*TINY_TRAIN, "data.val_bucket=10", "data.val_tokens=330"]
"""Overrides of a run that takes well under a second per step on one CPU thread (a 330-token validation
set from the 300-document corpus)."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 sample documents in 3 files (one shard each)."""
    return write_docs(tmp_path_factory.mktemp("corpus"), 300, 3, chars=600)


@pytest.fixture(scope="module")
def bpe(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-token byte-level BPE trained on the corpus (under a second)."""
    out = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_tokenizer([str(corpus)], 512, out)
    return out


@pytest.fixture(scope="module")
def overrides_under(corpus: Path, bpe: Path) -> Callable[[Path], list[str]]:
    """``overrides_under(root)``: overrides of a tiny run on the corpus writing under ``root`` (runs/, cache/)."""

    def make(root: Path) -> list[str]:
        return [f"data.source={corpus}", f"data.tokenizer={bpe}", f"data.cache_dir={root / 'cache'}",
                f"out_dir={root / 'runs'}", *TINY]

    return make


@pytest.fixture
def run_overrides(overrides_under: Callable[[Path], list[str]], tmp_path: Path) -> list[str]:
    """Overrides of a tiny run on the corpus, writing under ``tmp_path``; append train.max_steps etc."""
    return overrides_under(tmp_path)
