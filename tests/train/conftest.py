"""Fixtures of the trainer tests: tiny run configs on the real FineWeb sample (``fineweb`` and ``bpe`` come
from tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import TINY_MODEL

from llm.config import RunConfig, load_config


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One validation cache for the session: every test's runs use the same validation windows."""
    return tmp_path_factory.mktemp("data_cache")


TINY = [
    *TINY_MODEL, "data.val_bucket=50", "data.val_tokens=2048", "train.lr=3e-3", "train.warmup_steps=5",
    "train.max_steps=30", "train.micro_batch_size=4", "train.global_batch_tokens=256", "train.log_every=1",
    "train.eval_every=1000", "train.checkpoint_every=1000", "train.isotropy_samples=128", "train.grad_norm_window=10",
]


@pytest.fixture
def tiny_overrides() -> list[str]:
    """The tiny model / data / train overrides alone (for tests that need no data)."""
    return list(TINY)


@pytest.fixture
def tiny_config(fineweb: Path, bpe: Path, data_cache: Path, tmp_path: Path):
    """``tiny_config(*overrides) -> RunConfig``: a 2-layer, width-32 model on the sample, run in tmp_path."""

    def make(*overrides: str) -> RunConfig:
        base = [f"data.source={fineweb}", f"data.tokenizer={bpe}", f"data.cache_dir={data_cache}",
                f"out_dir={tmp_path / 'runs'}", "name=tiny"]
        return load_config(None, [*base, *TINY, *overrides])

    return make
