"""One writer per run directory: ``run.lock`` names the process that holds it.

Two processes writing the same ``runs/<name>/`` would interleave metrics.jsonl rows, and the resume's
``truncate_metrics`` of one would replace the file the other appends to. So the main process of a run
creates ``run.lock`` exclusively (``O_CREAT | O_EXCL``) before it reads or writes anything there, with
its pid, host and a lease that a daemon thread renews while the run lives; the lock is removed when the
run ends. A lock is stale, and taken over, when its holder is a dead pid on this host or its lease has
expired (a holder on another host that stopped renewing: a crashed node).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

__all__ = ["LEASE_S", "RunLock", "RunLockedError"]

LOCK_FILE = "run.lock"
# A holder renews its lease every ``LEASE_S / 10`` seconds; a lock not renewed for ``LEASE_S`` is stale.
LEASE_S = 600.0


class RunLockedError(RuntimeError):
    """Another live process holds the run directory."""


@contextmanager
def _exclusive(run_dir: Path) -> Iterator[None]:
    """Changes to the lock file are one step at a time for every process of this host: flock on the run
    directory itself (which writes nothing). Without it, two processes that both saw the same stale lock could
    each remove it, the second removing the first's fresh one, and both would hold the directory; and a holder
    whose lease ran out could renew over the lock that replaced it."""
    guard = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)
        yield
    finally:
        os.close(guard)  # closing drops the flock


class RunLock:
    """``RunLock.acquire(run_dir)`` takes the directory or raises ``RunLockedError`` naming the holder;
    ``release()`` gives it back (and stops renewing the lease)."""

    def __init__(self, path: Path, record: dict, created_dir: bool) -> None:
        self.path = path
        self._record = record
        self._created_dir = created_dir
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="run-lock-lease", daemon=True)
        self._renewer.start()

    @classmethod
    def acquire(cls, run_dir: str | Path, lease_s: float = LEASE_S,
                advice: str = "wait for that run to end, or choose another name=") -> RunLock:
        """``advice``: what the message of a held lock tells its reader to do."""
        path = Path(run_dir) / LOCK_FILE
        created_dir = not path.parent.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "lease_s": lease_s}
        with _exclusive(path.parent):
            for _ in range(2):  # a stale lock is removed once, then created afresh
                try:
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    holder = cls._holder(path)
                    if holder is not None and not cls._stale(holder):
                        raise RunLockedError(
                            f"{path.parent} is in use by pid {holder['pid']} on {holder['host']} ({path}); {advice}"
                        ) from None
                    path.unlink(missing_ok=True)
                    continue
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump({**record, "renewed": time.time()}, f)
                except OSError:  # a full disk: leave no empty lock behind
                    path.unlink(missing_ok=True)
                    raise
                return cls(path, record, created_dir)
            raise RunLockedError(f"{path.parent}: another process took {path} while a stale lock was replaced")

    @staticmethod
    def _holder(path: Path) -> dict | None:
        """The lock's record; None when it is unreadable (torn by a crash while being written: stale)."""
        try:
            holder = json.loads(path.read_text())
            return holder if {"pid", "host", "renewed", "lease_s"} <= holder.keys() else None
        except (OSError, ValueError, AttributeError):
            return None

    @staticmethod
    def _stale(holder: dict) -> bool:
        if time.time() - float(holder["renewed"]) > float(holder["lease_s"]):
            return True
        if holder["host"] == socket.gethostname():
            # our own pid: a lock an earlier run in this process could not release (a crash before the loop)
            return holder["pid"] == os.getpid() or not psutil.pid_exists(int(holder["pid"]))
        return False

    def _held(self) -> bool:
        """Whether the lock file still names this process (another may have taken over an expired lease)."""
        holder = self._holder(self.path)
        return holder is not None and (holder["pid"], holder["host"]) == (self._record["pid"], self._record["host"])

    def _renew(self) -> None:
        interval = float(self._record["lease_s"]) / 10
        while not self._stop.wait(interval):
            tmp = self.path.with_name(f".{LOCK_FILE}.tmp")
            try:
                with _exclusive(self.path.parent):
                    if not self._held():
                        return  # taken over: renewing would overwrite the new holder's lock
                    tmp.write_text(json.dumps({**self._record, "renewed": time.time()}))
                    os.replace(tmp, self.path)
            except OSError:  # a full disk: the lease may lapse, the dead-pid check still protects this host
                continue

    def release(self) -> None:
        """Stop renewing and remove the lock, unless another process has taken it over meanwhile; and the run
        directory too when ``acquire`` created it and nothing else was written there (a run refused during setup,
        e.g. for a tokenizer larger than ``model.vocab_size``, leaves no empty directory under that name)."""
        self._stop.set()
        self._renewer.join()
        if not self.path.parent.is_dir():  # the run directory was removed: nothing to release
            return
        with _exclusive(self.path.parent):
            if self._held():
                self.path.unlink()
                if self._created_dir and not any(self.path.parent.iterdir()):
                    self.path.parent.rmdir()
