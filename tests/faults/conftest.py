"""Fixtures of the fault-injection tests: slices of the real FineWeb sample, a small BPE trained on a few
hundred of its documents, and the tiny run overrides of a 2-layer, width-32 model."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from llm.data import train_tokenizer

FINEWEB = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "fineweb-sample"

TINY = [
    "model.vocab_size=512", "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.max_position_embeddings=64",
    "data.seq_len=32", "data.shuffle_block=8", "data.val_bucket=10", "data.val_tokens=330",
    "train.lr=3e-3", "train.warmup_steps=5", "train.micro_batch_size=4", "train.global_batch_tokens=256",
    "train.log_every=1", "train.eval_every=1000", "train.isotropy_samples=128", "train.grad_norm_window=10",
    "trackers=[]",
]
"""Overrides of a run that takes well under a second per step on one CPU thread."""


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and one thread makes CPU runs bitwise reproducible."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each in-process ``fit`` starts from a clean slate."""
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def write_docs(directory: Path, count: int, num_files: int, chars: int = 600) -> Path:
    """The first ``count`` sample documents (text cut to ``chars``), as ``num_files`` parquet files (FineWeb
    columns text, id) under ``directory``."""
    files = sorted(FINEWEB.glob("*.parquet"))
    if not files:
        pytest.skip(f"no FineWeb sample at {FINEWEB}")
    rows = pq.read_table(files[0], columns=["text", "id"]).slice(0, count).to_pylist()
    rows = [{"text": row["text"][:chars], "id": row["id"]} for row in rows]
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(rows) // num_files)
    for i in range(num_files):
        table = pa.Table.from_pylist(rows[i * per_file : (i + 1) * per_file])
        pq.write_table(table, directory / f"train-{i:05d}-of-{num_files:05d}.parquet")
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 sample documents in 3 files (one shard each)."""
    return write_docs(tmp_path_factory.mktemp("corpus"), 300, 3)


@pytest.fixture(scope="module")
def bpe(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-token byte-level BPE trained on the corpus (under a second)."""
    out = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_tokenizer([str(corpus)], 512, out)
    return out


@pytest.fixture
def run_overrides(corpus: Path, bpe: Path, tmp_path: Path) -> list[str]:
    """Overrides of a tiny run on the corpus, writing under ``tmp_path``; append train.max_steps etc."""
    return [f"data.source={corpus}", f"data.tokenizer={bpe}", f"data.cache_dir={tmp_path / 'cache'}",
            f"out_dir={tmp_path / 'runs'}", *TINY]
