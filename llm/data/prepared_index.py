"""A prepared directory's ``index.json`` and the integrity of the token files it lists.

The index records each file's token count and xxh3-64 checksum (indexes written before checksums were recorded
have none, and still load). A run checks what is cheap before its first step: the index's fields, every file's
size and that every piece lies inside its file; ``isollm-data verify`` also reads every file through its checksum
(zeroed bytes keep the size). The token ids are checked as the loader reads them (``PreparedTokens.tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from llm.data.cache_io import file_checksum
from llm.data.errors import DataError
from llm.errors import one_line

__all__ = ["CHECKSUM", "FORMAT", "INDEX_FILE", "file_problems", "read_index", "verify"]

INDEX_FILE = "index.json"
# Layout version written to the index; the reader refuses any other.
FORMAT = 2
# A file entry's key of the file's checksum.
CHECKSUM = "xxh3_64"
FIELDS = {"tokenizer": str, "val_bucket": int, "max_doc_chars": int, "source": dict, "files": list, "pieces": list}


def _well_formed(index: dict[str, Any]) -> bool:
    files = index.get("files")
    return (all(isinstance(index.get(key), kind) for key, kind in FIELDS.items())
            and all(isinstance(f, dict) and isinstance(f.get("tokens"), str) and isinstance(f.get("num_tokens"), int)
                    for f in files)
            and all(isinstance(p, dict) and all(isinstance(p.get(k), int) for k in ("file", "start", "num_tokens"))
                    and 0 <= p["file"] < len(files) for p in index["pieces"]))


def read_index(root: Path) -> dict[str, Any]:
    """The index of the prepared directory ``root``; one line naming it when it is missing, is not JSON, is of
    another format or lacks a field the reader needs."""
    path = root / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(f"data.prepared: no {INDEX_FILE} in {root} (write it with `isollm-data prepare`)")
    try:
        index = json.loads(path.read_bytes())
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError alike
        raise DataError(f"data.prepared: {path} is not JSON ({one_line(err)}); prepare again") from None
    found = index.get("format") if isinstance(index, dict) else None
    if found != FORMAT:
        raise DataError(f"data.prepared: {path} has format {found!r}, this reader reads format {FORMAT}; prepare again")
    if not _well_formed(index):
        raise DataError(f"data.prepared: {path} lacks fields `isollm-data prepare` writes, or holds them with "
                        "another type; prepare again")
    return index


def file_problems(root: Path, index: dict[str, Any], checksums: bool = False) -> Iterator[str]:
    """A line for each token file that does not hold what the index records: missing, of another size than 4
    bytes (uint32) per token, or (``checksums``, where one is recorded) of another checksum; then one for each
    piece that runs past its file. A file of no tokens need not exist (prepare writes none; it once wrote empty
    ones)."""
    for entry in index["files"]:
        path, want = root / entry["tokens"], entry["num_tokens"] * 4
        if not want and not path.exists():
            continue
        size = path.stat().st_size if path.is_file() else None
        if size != want:
            held = "is missing" if size is None else f"holds {size:,} bytes"
            yield f"{path} {held}; {INDEX_FILE} records {entry['num_tokens']:,} tokens ({want:,} bytes)"
        elif checksums and CHECKSUM in entry and (found := file_checksum(path, xxhash.xxh3_64)) != entry[CHECKSUM]:
            yield f"{path} has checksum {found}; {INDEX_FILE} records {entry[CHECKSUM]} (bytes changed in place)"
    for i, piece in enumerate(index["pieces"]):  # the loader reads [start, start + num_tokens) of the piece's file
        start, end, entry = piece["start"], piece["start"] + piece["num_tokens"], index["files"][piece["file"]]
        if not 0 <= start <= end <= entry["num_tokens"]:
            yield (f"{root / INDEX_FILE} records piece {i} as tokens {start:,} to {end:,} of {root / entry['tokens']}, "
                   f"which holds {entry['num_tokens']:,}")


def verify(root: Path) -> tuple[list[str], str]:
    """(a line per damaged token file, a summary line): every file's size and recorded checksum, every piece's
    range."""
    index = read_index(root)
    files = index["files"]
    unrecorded = sum(CHECKSUM not in entry for entry in files)
    checked = (f"checksum not recorded for {unrecorded} (prepared before checksums were; prepare again to record "
               "them), sizes checked" if unrecorded else "sizes and checksums match")
    summary = f"{root}: {len(files)} token file(s), {sum(f['num_tokens'] for f in files):,} tokens: {checked}"
    return list(file_problems(root, index, checksums=True)), summary
