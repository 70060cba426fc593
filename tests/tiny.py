"""What several test folders share: the real FineWeb sample beside the checkout, slices of it, and the
overrides of a tiny run (2 layers, width 32, vocabulary 512) that takes well under a second a step."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
FINEWEB = REPO.parent / "shared" / "data" / "fineweb-sample"

TINY_MODEL = [
    "model.vocab_size=512", "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.max_position_embeddings=64",
    "data.seq_len=32", "data.shuffle_block=8", "trackers=[]",
]
"""Model and data-shape overrides of the tiny run; each folder adds its validation and train settings."""


def fineweb_files() -> list[Path]:
    files = sorted(FINEWEB.glob("*.parquet"))
    if not files:
        pytest.skip(f"no FineWeb sample at {FINEWEB} (shared/data beside the checkout)")
    return files


def write_docs(directory: Path, count: int, num_files: int, chars: int | None = None) -> Path:
    """The first ``count`` sample documents (text cut to ``chars`` when given), as ``num_files`` parquet
    files with FineWeb's columns text and id, under ``directory``."""
    rows = pq.read_table(fineweb_files()[0], columns=["text", "id"]).slice(0, count).to_pylist()
    if chars is not None:
        rows = [{"text": row["text"][:chars], "id": row["id"]} for row in rows]
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(rows) // num_files)
    for i in range(num_files):
        table = pa.Table.from_pylist(rows[i * per_file : (i + 1) * per_file])
        pq.write_table(table, directory / f"train-{i:05d}-of-{num_files:05d}.parquet")
    return directory
