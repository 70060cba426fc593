"""Fixtures of the trainer tests: a small BPE trained on the real FineWeb sample, and tiny run configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from llm.config import RunConfig, load_config
from llm.data import train_tokenizer

FINEWEB = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "fineweb-sample"


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a shared 2-core machine two threads per process
    made them ~15x slower (measured: 27 ms -> 460 ms per step under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def fineweb() -> Path:
    if not any(FINEWEB.glob("*.parquet")):
        pytest.skip(f"no FineWeb sample at {FINEWEB}")
    return FINEWEB


@pytest.fixture(scope="session")
def bpe(fineweb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-token byte-level BPE trained on one shard of the sample (about a second)."""
    out = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_tokenizer(sorted(fineweb.glob("*.parquet"))[:1], 512, out)
    return out


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One validation cache for the session: every test's runs use the same validation windows."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each in-process ``fit`` starts from a clean slate."""
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


TINY = [
    "model.vocab_size=512", "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.max_position_embeddings=64",
    "data.seq_len=32", "data.shuffle_block=8", "data.val_bucket=50", "data.val_tokens=2048",
    "train.lr=3e-3", "train.warmup_steps=5", "train.max_steps=30", "train.micro_batch_size=4",
    "train.global_batch_tokens=256", "train.log_every=1", "train.eval_every=1000",
    "train.checkpoint_every=1000", "train.isotropy_samples=128", "train.grad_norm_window=10", "trackers=[]",
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
