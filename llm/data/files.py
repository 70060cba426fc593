"""A source's files through fsspec, local paths and ``hf://`` URLs alike: opening, sizes, and fingerprints that
tell whether a file changed without reading it."""

from __future__ import annotations

import functools
import json
import posixpath
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import xxhash

from llm.data.cache_io import file_checksum

__all__ = ["CONTENT_KEYS", "Fingerprint", "content_fingerprint", "file_size", "fingerprints", "open_file"]

# Keys of fsspec's file info that change with a file's content: a local file's modification time, a hub file's
# git blob id (and xet hash), an object store's ETag or modification time.
CONTENT_KEYS = ("mtime", "blob_id", "xet_hash", "ETag", "etag", "LastModified", "last_modified", "md5")

# A file's size and the ``CONTENT_KEYS`` its filesystem reports.
Fingerprint = dict[str, int | float | str]


def open_file(file: str) -> BinaryIO:
    """A local path or a remote URL (``hf://datasets/...``) opened for binary reading through fsspec."""
    return fsspec.open(file, "rb").open()


@functools.cache
def file_size(file: str) -> int:
    fs, path = fsspec.core.url_to_fs(file)
    return int(fs.size(path))


def _json_value(value: Any) -> int | float | str:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def fingerprints(files: Sequence[str]) -> list[Fingerprint | None]:
    """Each file's fingerprint from its directory's listing: one listing per directory (one request on the hub,
    where a file's URL also names the commit), not a request per file. None for a file whose filesystem reports
    no content key: its size alone cannot tell a rewritten file from the old one."""
    listings: dict[tuple[fsspec.AbstractFileSystem, str], dict[str, dict[str, Any]]] = {}
    result: list[Fingerprint | None] = []
    for file in files:
        fs, path = fsspec.core.url_to_fs(file)
        parent = posixpath.dirname(path)
        try:
            if (fs, parent) not in listings:
                listings[fs, parent] = {entry["name"]: entry for entry in fs.ls(parent, detail=True)}
            # a name the listing spells otherwise (an encoded revision) is asked for alone
            info = listings[fs, parent].get(path) or fs.info(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"data.source: no such file: {file}") from None
        content = {key: _json_value(info[key]) for key in CONTENT_KEYS if info.get(key) is not None}
        result.append({"size": int(info["size"]), **content} if content else None)
    return result


def content_fingerprint(files: Sequence[str]) -> str:
    """One digest of what the files hold, in order, whatever path reaches them (the same data through another path
    has the same fingerprint). A local file counts by the xxh3-64 of all its bytes: its size and modification time
    would miss a rewrite at the same size (or with its mtime put back), a parquet footer a change inside a row
    group; xxh3 hashes faster than a disk reads, so this costs one read of the source per process. A remote file
    counts by what its filesystem says of its content (a hub file's git blob id: ``fingerprints``, one listing per
    directory), never its bytes; its modification time is left out (the same blob keeps its fingerprint)."""
    remote = [file for file in files if "://" in file]
    listed = dict(zip(remote, fingerprints(remote), strict=True))
    digests = [file_checksum(Path(file), xxhash.xxh3_64) if file not in listed
               else {key: value for key, value in (listed[file] or {"size": file_size(file)}).items() if key != "mtime"}
               for file in files]
    return xxhash.xxh3_64_hexdigest(json.dumps(digests, sort_keys=True).encode())
