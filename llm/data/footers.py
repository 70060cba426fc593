"""Parquet footers: what a source's files hold (columns, row groups), read once per job instead of once per
process.

Resolving a source (``llm.data.sources`` checks the text column) and cutting it into pieces
(``llm.data.pieces.list_pieces``: one per row group) need every file's footer: on the hub one request per file,
tens of thousands for FineWeb, per process. What the footers say (a ``Footer``) is therefore kept

- per process, by file;
- across processes and jobs in ``data.cache_dir``: ``footers_<digest>.json``, the digest naming the ordered list
  of files, holding each file's fingerprint (``llm.data.files.fingerprints``: size and mtime of a local file,
  size and git blob id of a hub file, from one directory listing, not a request per file), columns and row
  groups, with a checksum. A file whose fingerprint changed is read again; another list of files (a file added
  or removed) is another cache file. The cache is written to a temporary file and renamed; one that does not
  read back or match its checksum is ignored with a warning and rewritten, one that cannot be written is
  skipped with a warning.

A distributed job lists in its main process first (``llm.train.setup.build_data``), so the other ranks find the
cache warm; DataLoader workers receive the pieces with their dataset and list nothing.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from llm.data.cache_io import files_cache_path, read_entries, write_entries
from llm.data.errors import DataError, DataWarning
from llm.data.files import Fingerprint, fingerprints, open_file
from llm.errors import one_line

__all__ = ["FOOTER_THREADS", "FORMAT", "Footer", "footers", "parquet_metadata", "read_cache",
           "read_metadata", "write_cache"]

# Footers read at once (one request each on the hub).
FOOTER_THREADS = 32
# Layout of a footer cache file; a file of another is rebuilt.
FORMAT = 1


@dataclass(frozen=True)
class Footer:
    """What a parquet file's footer says about the file, without its statistics and encodings."""

    columns: tuple[tuple[str, str], ...]
    """(name, arrow type) of each column."""
    row_groups: tuple[tuple[int, int], ...]
    """(rows, compressed bytes of all columns) of each row group."""

    @property
    def num_rows(self) -> int:
        return sum(rows for rows, _ in self.row_groups)

    @classmethod
    def of(cls, meta: pq.FileMetaData) -> Footer:
        columns = tuple((field.name, str(field.type)) for field in meta.schema.to_arrow_schema())
        groups = tuple((group.num_rows, sum(group.column(c).total_compressed_size for c in range(group.num_columns)))
                       for group in map(meta.row_group, range(meta.num_row_groups)))
        return cls(columns, groups)

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> Footer:
        columns = tuple((str(name), str(kind)) for name, kind in entry["columns"])
        groups = tuple((int(rows), int(nbytes)) for rows, nbytes in entry["row_groups"])
        return cls(columns, groups)


# This process's footers by file (the first listing of a source fills it; its files are not re-checked).
_KNOWN: dict[str, Footer] = {}


def read_metadata(file: str) -> pq.FileMetaData:
    """The file's footer, read now (one request on the hub); ``DataError`` naming the file when it is not
    parquet."""
    try:
        if "://" not in file:
            return pq.read_metadata(file)
        with open_file(file) as f:
            return pq.read_metadata(f)
    except Exception as err:
        raise DataError(f"data.source: {file} is not a readable parquet file ({err})") from None


@functools.cache
def parquet_metadata(file: str) -> pq.FileMetaData:
    """The footer of a file this process reads rows of, read once per process (every segment of every epoch
    opens its file again). Listing does not keep whole footers: a repository's would fill memory."""
    return read_metadata(file)


def read_cache(path: Path) -> dict[str, tuple[Fingerprint, Footer]]:
    """The cached footers by file; empty, with a warning, when the file does not read back intact."""
    return read_entries(path, "footer cache", FORMAT, lambda entry: (entry["fingerprint"], Footer.from_json(entry)))


def write_cache(path: Path, files: Sequence[str], prints: Sequence[Fingerprint | None],
                found: dict[str, Footer]) -> None:
    """Write the footers of ``files`` with their fingerprints (those without one are left out) atomically."""
    entries = {file: {"fingerprint": fp, **asdict(found[file])}  # json writes the tuples as lists
               for file, fp in zip(files, prints, strict=True) if fp is not None}
    try:
        write_entries(path, entries, FORMAT)
    except OSError as err:
        warnings.warn(f"could not write the footer cache {path} ({one_line(err)}); the next process reads the "
                      "footers again", DataWarning, stacklevel=2)


def _cached_or_read(files: Sequence[str], cache_dir: str | None) -> dict[str, Footer]:
    """Footers of ``files``: from the cache file of this list where a file's fingerprint is unchanged, else
    read (``FOOTER_THREADS`` at a time) and the cache file rewritten."""
    found: dict[str, Footer] = {}
    prints: list[Fingerprint | None] = []
    path = None
    if cache_dir is not None:
        prints = fingerprints(files)
        path = files_cache_path("footers", files, cache_dir)
        cached = read_cache(path) if path.is_file() else {}
        for file, fp in zip(files, prints, strict=True):
            if fp is not None and file in cached and cached[file][0] == fp:
                found[file] = cached[file][1]
    if missing := [file for file in files if file not in found]:
        with ThreadPoolExecutor(min(FOOTER_THREADS, len(missing))) as pool:
            found.update(zip(missing, pool.map(lambda file: Footer.of(read_metadata(file)), missing),
                             strict=True))
        # files without a fingerprint are read by every process: they alone are no reason to rewrite the cache
        if path is not None and set(missing) & {file for file, fp in zip(files, prints, strict=True) if fp}:
            write_cache(path, files, prints, found)
    return found


def footers(files: Sequence[str], cache_dir: str | None) -> list[Footer]:
    """The footer of each file, in order: known to this process, else from ``cache_dir`` (None: no cache across
    processes), else read."""
    if any(file not in _KNOWN for file in files):
        _KNOWN.update(_cached_or_read(list(dict.fromkeys(files)), cache_dir))
    return [_KNOWN[file] for file in files]
