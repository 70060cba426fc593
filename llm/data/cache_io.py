"""Files written whole or not at all (a prepared ``index.json``; in ``data.cache_dir`` the validation windows and
parquet footers, which are rebuilt with a one-line warning when they do not read back), and the checksums that tell
whether a file still holds what was written (prepared token files, checkpoints)."""

from __future__ import annotations

import os
import secrets
import warnings
from collections.abc import Callable
from pathlib import Path

import xxhash

from llm.data.errors import DataWarning

__all__ = ["file_checksum", "warn_rebuilding", "write_atomically"]


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
