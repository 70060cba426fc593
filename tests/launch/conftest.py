"""Fixtures of the launch tests: a small FineWeb slice and a BPE trained on it."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm.data import train_tokenizer

REPO = Path(__file__).resolve().parents[2]
FINEWEB = REPO.parent / "shared" / "data" / "fineweb-sample"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 FineWeb sample documents in 2 parquet files: enough windows for 2 ranks, seconds to stream."""
    files = sorted(FINEWEB.glob("*.parquet"))
    if not files:
        pytest.skip(f"no FineWeb sample at {FINEWEB}")
    rows = pq.read_table(files[0], columns=["text", "id"]).slice(0, 200).to_pylist()
    out = tmp_path_factory.mktemp("corpus")
    for i in range(2):
        pq.write_table(pa.Table.from_pylist(rows[i * 100 : (i + 1) * 100]), out / f"train-{i:05d}.parquet")
    return out


@pytest.fixture(scope="session")
def tokenizer_file(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    train_tokenizer([str(corpus)], 512, out)
    return out / "tokenizer.json"
