"""A source's files through fsspec, local paths and ``hf://`` URLs alike: opening, sizes, and fingerprints that
tell whether a file changed without reading it."""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Sequence
from typing import Any, BinaryIO

import fsspec

__all__ = ["CONTENT_KEYS", "Fingerprint", "file_size", "fingerprints", "open_file"]

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
