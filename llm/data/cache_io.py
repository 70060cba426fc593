"""Files written whole or not at all (a prepared ``index.json``; in ``data.cache_dir`` the validation windows, and
the per-file caches of a list of files (parquet footers, content digests), which are rebuilt with a one-line warning
when they do not read back), and the checksums that tell whether a file still holds what was written (prepared token
files, checkpoints)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from llm.data.errors import DataWarning
from llm.errors import one_line

__all__ = ["file_checksum", "files_cache_path", "read_entries", "warn_rebuilding", "write_atomically",
           "write_entries"]

Entry = TypeVar("Entry")


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` by ``write(temporary path)`` in the same directory, fsync it, then rename it over ``path``: a
    reader (another rank, a concurrent job) sees the previous file or the whole new one, never a torn one. The
    data is on disk before the rename; the rename itself is durable once the OS writes the directory (it is not
    fsynced: after a power loss the previous file may come back, never a torn one).
    Raises ``OSError`` when the directory cannot be written (the temporary file is removed). The file gets the
    mode ``write`` creates it with (0666 less the umask, as the token files beside an index.json): not mkstemp's
    0600, which left a shared prepared directory or cache unreadable to the others who share it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")  # a name no concurrent writer picks
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def warn_rebuilding(what: str, path: Path, reason: str) -> None:
    """One warning line: the cache file ``path`` holding ``what`` did not read back and is rebuilt."""
    warnings.warn(f"rebuilding the {what} {path}: unreadable ({reason})", DataWarning, stacklevel=3)


def files_cache_path(kind: str, files: Sequence[str], cache_dir: str) -> Path:
    """``cache_dir/<kind>_<digest>.json``, the digest naming the ordered list of files: another list (a file added or
    removed) is another cache file."""
    digest = hashlib.blake2b(json.dumps(list(files)).encode(), digest_size=10).hexdigest()
    return Path(cache_dir) / f"{kind}_{digest}.json"


def _checksum(entries: Any) -> str:
    return hashlib.blake2b(json.dumps(entries, sort_keys=True).encode(), digest_size=16).hexdigest()


def write_entries(path: Path, entries: dict[str, Any], layout: int) -> None:
    """A cache of one entry per file, in layout ``layout``, with its checksum, written atomically; ``OSError`` when
    it cannot be written."""
    text = json.dumps({"format": layout, "blake2b": _checksum(entries), "files": entries}, separators=(",", ":"))
    write_atomically(path, lambda tmp: tmp.write_text(text))


def read_entries(path: Path, what: str, layout: int, entry: Callable[[Any], Entry]) -> dict[str, Entry]:
    """The entries ``write_entries`` wrote, by file, each through ``entry`` (which raises on one of the wrong shape);
    empty, with a warning naming the cache of ``what``, when the file does not read back intact."""
    try:
        cached = json.loads(path.read_bytes())
        if not (isinstance(cached, dict) and cached.get("format") == layout
                and cached.get("blake2b") == _checksum(cached.get("files"))):
            reason = f"not a format {layout} {what} with its checksum"
        else:
            return {file: entry(value) for file, value in cached["files"].items()}
    except Exception as err:  # OSError, a JSON or UTF-8 error, or an entry of the wrong shape
        reason = one_line(err)
    warn_rebuilding(what, path, reason)
    return {}


def file_checksum(path: Path, algorithm: type[xxhash.xxh3_64] | type[xxhash.xxh3_128], *, fsync: bool = False) -> str:
    """Hex digest of the file's bytes by ``algorithm`` (xxh3 hashes at several GB/s: a file is hashed about as fast
    as it is read); ``fsync``: also fsync the file through the same descriptor (one open and one pass per file)."""
    digest = algorithm()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()
