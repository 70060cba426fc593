"""The parquet footer cache (``data.cache_dir/footers_<digest>.json``) at FineWeb's scale, without FineWeb.

A synthetic listing of hub files shaped like FineWeb's (``--files`` parquet files of ``--row-groups`` row groups
each, hub fingerprints: size and a git blob id) goes through the cache's own writer and reader
(``llm.data.footers.write_cache`` / ``read_cache``): what the main process writes once per job, and what every
other rank of every node reads at start when ``data.cache_dir`` is shared. Prints the file's size, the time to
write it, and the time one rank takes to load it (``--ranks`` loads in a row, median).

The shape: FineWeb's files are about 2.1 GB each (its ``data/CC-MAIN-*/`` folders, as written by datatrove); the
defaults assume ~25,000 such files (~50 TB) of 20 row groups, 500,000 row groups in all; pass other counts for
another dataset or for millions of row groups (``--row-groups 80``: 2 million). The counts are assumptions from
the dataset's published sizes, not read off its metadata here (no network).

    python bench/bench_footers.py [--files 25000] [--row-groups 20] [--ranks 3]
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import harness
import torch

from llm.data.footers import Footer, read_cache, write_cache

COLUMNS = (("text", "string"), ("id", "string"), ("dump", "string"), ("url", "string"), ("date", "string"),
           ("file_path", "string"), ("language", "string"), ("language_score", "double"), ("token_count", "int64"))
"""FineWeb's columns."""


def synthetic_listing(files: int, row_groups: int) -> tuple[list[str], list[dict], dict[str, Footer]]:
    names = [f"hf://datasets/HuggingFaceFW/fineweb@main/data/CC-MAIN-{2013 + i // 260}-{i % 52:02d}/"
             f"{i // 1000:03d}_{i % 1000:05d}.parquet" for i in range(files)]
    prints = [{"size": 2_150_000_000 + i, "blob_id": f"{i:040x}"} for i in range(files)]
    footer = Footer(COLUMNS, tuple((100_000 + g, 107_000_000 + g * 13) for g in range(row_groups)))
    return names, prints, dict.fromkeys(names, footer)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--files", type=int, default=25_000)
    parser.add_argument("--row-groups", type=int, default=20, help="per file")
    parser.add_argument("--ranks", type=int, default=3, help="loads timed (each as one rank's start would)")
    args = parser.parse_args()
    names, prints, found = synthetic_listing(args.files, args.row_groups)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "footers.json"
        cpu = torch.device("cpu")
        written = harness.timed(lambda: write_cache(path, names, prints, found), cpu)()
        loads = [harness.timed(lambda: read_cache(path), cpu)() for _ in range(args.ranks)]
        assert len(read_cache(path)) == args.files
        size = path.stat().st_size
    groups = args.files * args.row_groups
    print(f"# footer cache, {args.files:,} files x {args.row_groups} row groups = {groups:,} row groups")
    print(f"{'size MiB':>10} {'bytes/row group':>16} {'write s':>8} {'load s (per rank)':>18}")
    print(f"{size / 2**20:10.1f} {size / groups:16.1f} {written:8.2f} {statistics.median(loads):18.2f}")


if __name__ == "__main__":
    main()
