"""A source's files through fsspec, local paths and ``hf://`` URLs alike: opening, sizes, fingerprints that tell
whether a file changed without reading it, and the content fingerprint of a list of files: a local file's bytes
read once and then trusted by its stat (``local_digests``, docs/ARCHITECTURE.md "Content fingerprints"), a hub
file's blob id."""

from __future__ import annotations

import functools
import json
import os
import posixpath
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import xxhash

from llm.data.cache_io import file_checksum, files_cache_path, read_entries, write_entries
from llm.data.errors import DataWarning
from llm.errors import one_line

__all__ = ["CONTENT_KEYS", "Fingerprint", "content_fingerprint", "file_size", "fingerprints", "local_digests",
           "open_file"]

# Keys of fsspec's file info that change with a file's content: a local file's modification time, a hub file's
# git blob id (and xet hash), an object store's ETag or modification time.
CONTENT_KEYS = ("mtime", "blob_id", "xet_hash", "ETag", "etag", "LastModified", "last_modified", "md5")

# A file's size and the ``CONTENT_KEYS`` its filesystem reports.
Fingerprint = dict[str, int | float | str]

# Layout of a digest cache file (``data.cache_dir/digests_<digest of the file list>.json``); another is rebuilt.
DIGESTS_FORMAT = 1
# git's "racy clean" rule: a cached digest is trusted only for a file that last changed (mtime and ctime) this long
# before the stat taken when it was hashed. A change within a timestamp's granularity of that stat (a coarse kernel
# clock tick; 2 s on FAT), or under a file server's clock a little behind this host's, could keep the stat the
# cache holds; a file changed that recently is hashed again, and is trusted from a later hash on.
RACY_NS = 2_000_000_000


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


def _stat(file: str) -> list[int]:
    """What changes when a file's bytes do: its size, mtime, ctime (which the kernel sets at every write and every
    ``utime``: a rewrite with its mtime put back still moves it) and inode (a file replaced by a rename)."""
    found = os.stat(file)
    return [found.st_size, found.st_mtime_ns, found.st_ctime_ns, found.st_ino]


def _digest_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A digest cache entry as ``local_digests`` compares it; raises on one of another shape."""
    return {"stat": [int(value) for value in entry["stat"]], "stat_ns": int(entry["stat_ns"]),
            "xxh3_64": str(entry["xxh3_64"])}


def local_digests(files: Sequence[str], cache_dir: str | None) -> list[str]:
    """The xxh3-64 of each local file's bytes: from ``cache_dir``'s digest cache of this list of files where the
    file's stat is the one it was hashed at and it had not changed for ``RACY_NS`` before (a stat, no read), else
    read, the cache then rewritten (atomically: another rank reads it whole). None: every file read."""
    path = files_cache_path("digests", files, cache_dir) if cache_dir is not None else None
    cached = read_entries(path, "digest cache", DIGESTS_FORMAT, _digest_entry) if path and path.is_file() else {}
    entries = {}
    for file in files:
        stat_ns, stat = time.time_ns(), _stat(file)  # the stat before the read: a write during it is a later ctime
        entry = cached.get(file)
        if entry is None or entry["stat"] != stat or max(stat[1], stat[2]) >= entry["stat_ns"] - RACY_NS:
            entry = {"stat": stat, "stat_ns": stat_ns, "xxh3_64": file_checksum(Path(file), xxhash.xxh3_64)}
        entries[file] = entry
    if path is not None and entries != cached:
        try:
            write_entries(path, entries, DIGESTS_FORMAT)
        except OSError as err:
            warnings.warn(f"could not write the digest cache {path} ({one_line(err)}); the next process reads the "
                          "source's files again", DataWarning, stacklevel=2)
    return [entries[file]["xxh3_64"] for file in files]


def content_fingerprint(files: Sequence[str], cache_dir: str | None = None) -> str:
    """One digest of what the files hold, in order, whatever path reaches them (the same data through another path
    has the same fingerprint). A local file counts by the xxh3-64 of all its bytes (``local_digests``: read once,
    then a stat while it is unchanged, with ``cache_dir``): its size and modification time would miss a rewrite at
    the same size (or with its mtime put back), a parquet footer a change inside a row group. A remote file counts
    by what its filesystem says of its content (a hub file's git blob id: ``fingerprints``, one listing per
    directory), never its bytes; its modification time is left out (the same blob keeps its fingerprint)."""
    remote = [file for file in files if "://" in file]
    listed = dict(zip(remote, fingerprints(remote), strict=True))
    local = [file for file in files if file not in listed]
    hashed = dict(zip(local, local_digests(local, cache_dir), strict=True))
    digests = [hashed[file] if file in hashed
               else {key: value for key, value in (listed[file] or {"size": file_size(file)}).items() if key != "mtime"}
               for file in files]
    return xxhash.xxh3_64_hexdigest(json.dumps(digests, sort_keys=True).encode())
