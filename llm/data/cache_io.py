"""Files written whole or not at all (a prepared ``index.json``; in ``data.cache_dir`` the validation windows and
parquet footers, which are rebuilt with a one-line warning when they do not read back)."""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

from llm.data.errors import DataWarning

__all__ = ["warn_rebuilding", "write_atomically"]


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` by ``write(temporary path)`` in the same directory, then rename it over ``path``: a
    reader (another rank, a concurrent job) sees the previous file or the whole new one, never a torn one.
    Raises ``OSError`` when the directory cannot be written (the temporary file is removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def warn_rebuilding(what: str, path: Path, reason: str) -> None:
    """One warning line: the cache file ``path`` holding ``what`` did not read back and is rebuilt."""
    warnings.warn(f"rebuilding the {what} {path}: unreadable ({reason})", DataWarning, stacklevel=3)
