"""Shared fixtures: small slices of the FineWeb sample written to tmp dirs, and a small trained BPE."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data.tokenizer import train_tokenizer

SHARED_DATA = Path(__file__).resolve().parents[2] / "../shared/data"
FINEWEB_SAMPLE = SHARED_DATA / "fineweb-sample"


def sample_rows(count: int, chars: int = 600) -> list[dict[str, str]]:
    """The first ``count`` FineWeb sample documents (text cut to ``chars`` characters to keep tests fast)."""
    files = sorted(FINEWEB_SAMPLE.glob("*.parquet"))
    if not files:
        pytest.skip(f"FineWeb sample not found at {FINEWEB_SAMPLE.resolve()} (see SPEC.md: shared/data)")
    table = pq.read_table(files[0], columns=["text", "id"]).slice(0, count).to_pylist()
    return [{"text": row["text"][:chars], "id": row["id"]} for row in table]


def write_parquet_shards(directory: Path, rows: list[dict[str, str]], num_files: int) -> Path:
    """Split ``rows`` into ``num_files`` parquet files (FineWeb layout: text, id) under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(rows) // num_files)
    for i in range(num_files):
        chunk = rows[i * per_file : (i + 1) * per_file]
        pq.write_table(pa.Table.from_pylist(chunk), directory / f"train-{i:05d}-of-{num_files:05d}.parquet")
    return directory


@pytest.fixture(scope="session")
def rows() -> list[dict[str, str]]:
    return sample_rows(240)


@pytest.fixture(scope="session")
def five_shards(tmp_path_factory: pytest.TempPathFactory, rows: list[dict[str, str]]) -> Path:
    """5 files for 4 nodes: the shard-level split."""
    return write_parquet_shards(tmp_path_factory.mktemp("five"), rows[:150], 5)


@pytest.fixture(scope="session")
def three_shards(tmp_path_factory: pytest.TempPathFactory, rows: list[dict[str, str]]) -> Path:
    """3 files for 4 nodes: the document-level split."""
    return write_parquet_shards(tmp_path_factory.mktemp("three"), rows[:120], 3)


@pytest.fixture(scope="session")
def bpe(tmp_path_factory: pytest.TempPathFactory, rows: list[dict[str, str]]) -> Tokenizer:
    """A 512-token byte-level BPE trained on the sample slice."""
    corpus = write_parquet_shards(tmp_path_factory.mktemp("corpus"), rows, 1)
    return train_tokenizer([str(corpus)], 512, tmp_path_factory.mktemp("tok"))


@pytest.fixture
def data_cfg(tmp_path: Path, three_shards: Path) -> DataConfig:
    return DataConfig(source=str(three_shards), seq_len=64, shuffle_block=8, val_bucket=20, val_tokens=500,
                      tokenize_batch=16, cache_dir=str(tmp_path / "cache"))
