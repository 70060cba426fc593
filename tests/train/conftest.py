"""Fixtures of the trainer tests: tiny run configs on the real FineWeb sample (``fineweb`` and ``bpe`` come
from tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import TINY_TRAIN

from llm.config import RunConfig, load_config


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One validation cache for the session: every test's runs use the same validation windows."""
    return tmp_path_factory.mktemp("data_cache")


TINY = [*TINY_TRAIN, "data.val_bucket=50", "data.val_tokens=2048", "train.max_steps=30", "train.checkpoint_every=1000"]


@pytest.fixture
def tiny_overrides() -> list[str]:
    """The tiny model / data / train overrides alone (for tests that need no data)."""
    return list(TINY)


@pytest.fixture
def run_overrides(fineweb: Path, bpe: Path, data_cache: Path, tmp_path: Path) -> list[str]:
    """Every override of the tiny run on the sample, writing runs/tiny under ``tmp_path`` (for train.py)."""
    return [f"data.source={fineweb}", f"data.tokenizer={bpe}", f"data.cache_dir={data_cache}",
            f"out_dir={tmp_path / 'runs'}", "name=tiny", *TINY]


@pytest.fixture
def tiny_config(run_overrides: list[str]):
    """``tiny_config(*overrides) -> RunConfig``: a 2-layer, width-32 model on the sample, run in tmp_path."""

    def make(*overrides: str) -> RunConfig:
        return load_config(None, [*run_overrides, *overrides])

    return make
