"""Two processes writing one run directory: the second gets one line naming the holder (pid, host) and exit 2,
before it builds anything, and nothing of the first run's is touched; a stale lock (a dead pid on this host, an
expired lease) is taken over; a finished run leaves no lock behind; a lock that cannot be written (a full disk) is
a failed write, exit 1."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import metrics_rows, start_train_py

import llm.train.setup as setup
from llm.cli.train import main
from llm.train.lock import LOCK_FILE, RunLock, RunLockedError

HOST = socket.gethostname()


def _write_lock(run_dir: Path, pid: int, host: str = HOST, renewed: float | None = None,
                lease_s: float = 600.0) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps({"pid": pid, "host": host, "lease_s": lease_s,
                                "renewed": time.time() if renewed is None else renewed}))
    return path


@pytest.fixture
def live_pid():
    """A live process other than this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_held_by_a_live_process_refuses(tmp_path: Path, live_pid: int) -> None:
    _write_lock(tmp_path, live_pid)
    with pytest.raises(RunLockedError, match=rf"^{tmp_path} is in use by pid {live_pid} on {HOST} "):
        RunLock.acquire(tmp_path)
    _write_lock(tmp_path, 1, host="elsewhere")  # another host, lease still running: its pid cannot be checked
    with pytest.raises(RunLockedError, match=r"in use by pid 1 on elsewhere"):
        RunLock.acquire(tmp_path)


@pytest.mark.parametrize("stale", ["dead pid", "expired lease", "torn file"])
def test_stale_lock_is_taken_over_and_released(stale: str, tmp_path: Path, dead_pid: int) -> None:
    if stale == "dead pid":
        _write_lock(tmp_path, dead_pid)
    elif stale == "expired lease":
        _write_lock(tmp_path, 1, host="elsewhere", renewed=time.time() - 700)
    else:
        (tmp_path / LOCK_FILE).write_text('{"pid": 12')
    lock = RunLock.acquire(tmp_path)
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert (holder["pid"], holder["host"]) == (os.getpid(), HOST)
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_lease_is_renewed_while_held(tmp_path: Path) -> None:
    lock = RunLock.acquire(tmp_path, lease_s=0.5)  # renewed every 0.05 s
    try:
        first = json.loads((tmp_path / LOCK_FILE).read_text())["renewed"]
        deadline = time.monotonic() + 30
        while json.loads((tmp_path / LOCK_FILE).read_text())["renewed"] == first:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        lock.release()


def test_a_holder_whose_lease_was_taken_over_neither_renews_nor_removes_the_new_lock(tmp_path: Path) -> None:
    """A holder paused past its lease (its lock taken over by a run on another host) must leave the new
    holder's lock alone: no renewal over it, no removal on release."""
    lock = RunLock.acquire(tmp_path, lease_s=0.5)  # renewed every 0.05 s
    new_holder = _write_lock(tmp_path, 1, host="elsewhere")
    written = new_holder.read_text()
    time.sleep(0.3)  # several renewal periods
    lock.release()
    assert new_holder.read_text() == written


def test_train_py_on_a_locked_run_is_one_line_exit_2(run_overrides: list[str], tmp_path: Path, live_pid: int,
                                                     monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    run_dir = tmp_path / "runs" / "x"
    lock = _write_lock(run_dir, live_pid)
    before = lock.read_bytes()

    def load_tokenizer(spec):
        raise AssertionError("the tokenizer was loaded before the lock was refused")

    monkeypatch.setattr(setup, "load_tokenizer", load_tokenizer)  # refused before any setup work
    assert main([*run_overrides, "name=x", "train.max_steps=2", "resume=true"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert lines == [f"error: name: {run_dir} is in use by pid {live_pid} on {HOST} ({lock}); wait for that run "
                     f"to end, or choose another name="]
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE] and lock.read_bytes() == before


def test_a_run_refused_during_setup_leaves_no_directory_it_created(run_overrides: list[str], tmp_path: Path,
                                                                    capsys) -> None:
    run_dir = tmp_path / "runs" / "x"
    assert main([*run_overrides, "name=x", "train.max_steps=2", "model.vocab_size=8"]) == 2
    assert "model.vocab_size" in capsys.readouterr().err
    assert not run_dir.exists()
    existing = tmp_path / "runs" / "y"
    existing.mkdir()
    assert main([*run_overrides, "name=y", "train.max_steps=2", "model.vocab_size=8"]) == 2
    assert existing.is_dir() and not any(existing.iterdir())  # not created by the run: kept


def test_lock_that_cannot_be_written_is_one_line_exit_1(run_overrides: list[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A full disk while the lock file is created is a failed write (exit 1), not a bad name= (exit 2)."""
    run_dir = tmp_path / "runs" / "x"
    real_open = os.open

    def full_disk_open(path, flags, *args, **kwargs):
        if Path(path).name == LOCK_FILE and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", full_disk_open)
    assert main([*run_overrides, "name=x", "train.max_steps=2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: could not create the lock of {run_dir} (OSError: [Errno 28] No space left on device: "
        f"'{run_dir / LOCK_FILE}')"]
    assert not any(run_dir.iterdir())
    monkeypatch.undo()
    assert main([*run_overrides, "name=x", "train.max_steps=2"]) == 0


@pytest.mark.slow
def test_second_train_py_on_a_running_run_is_refused(run_overrides: list[str], tmp_path: Path) -> None:
    """Two runs of one name: the second stops at once, touching nothing; the first keeps every row."""
    args = [*run_overrides, "name=x", "train.max_steps=100000", "resume=true"]
    first = start_train_py(tmp_path, *args)
    run_dir = tmp_path / "runs" / "x"
    deadline = time.monotonic() + 180
    while not (run_dir / "metrics.jsonl").is_file() and time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()[1]
        time.sleep(0.1)
    second = start_train_py(tmp_path, *args)
    _, err = second.communicate(timeout=300)
    assert second.returncode == 2, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: name: {run_dir} is in use by pid {first.pid} on {HOST} ({run_dir / LOCK_FILE}); wait for that "
        f"run to end, or choose another name="]
    first.send_signal(signal.SIGTERM)
    _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err
    steps = [r["step"] for r in metrics_rows(run_dir, "train")]
    assert steps == list(range(1, len(steps) + 1))  # every row of the first run, once
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.slow
def test_lock_of_a_killed_run_is_taken_over(run_overrides: list[str], tmp_path: Path) -> None:
    args = [*run_overrides, "name=x", "train.max_steps=1000", "resume=true", "train.checkpoint_every=2"]
    killed = start_train_py(tmp_path, *args)
    run_dir = tmp_path / "runs" / "x"
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / "latest").is_file() and time.monotonic() < deadline:
        assert killed.poll() is None
        time.sleep(0.1)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == killed.pid  # left behind by the kill
    resumed = start_train_py(tmp_path, *args[:-3], "train.max_steps=4", "resume=true")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert not (run_dir / LOCK_FILE).exists()


CONTENDER = """
import sys, time
from llm.train.lock import RunLock, RunLockedError
stale = RunLock._stale
RunLock._stale = staticmethod(lambda holder: time.sleep(0.5) or stale(holder))  # widen the race window
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
try:
    lock = RunLock.acquire(sys.argv[1])
except RunLockedError:
    print("refused")
else:
    print("won")
    time.sleep(3)  # hold it while the others try
    lock.release()
"""


@pytest.mark.slow
def test_processes_taking_over_one_stale_lock_at_once_leave_one_holder(tmp_path: Path, dead_pid: int) -> None:
    """Each contender sees the same stale lock; checking, removing and re-creating it is serialised, so
    exactly one of them holds the directory."""
    _write_lock(tmp_path, dead_pid)
    start = time.time() + 3  # every contender has imported by then
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(tmp_path), str(start)],
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    outcomes = sorted(proc.communicate(timeout=120)[0].strip() for proc in procs)
    assert outcomes == ["refused"] * 5 + ["won"]
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_second_prepare_into_one_directory_is_one_line(corpus: Path, bpe: Path, tmp_path: Path, live_pid: int,
                                                         capsys) -> None:
    """``isollm-data prepare`` holds its output directory's lock: one into a directory that another prepare holds
    stops in one line naming it (exit 2) and changes nothing there; a finished prepare leaves no lock. Before, both
    exited 0 and the token files held both writers' tokens."""
    from llm.cli.data import main as data_main

    out = tmp_path / "prepared"
    args = ["prepare", "--out", str(out), "--source", str(corpus), "--tokenizer", str(bpe), "data.val_bucket=10"]
    assert data_main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "index.json" in before and LOCK_FILE not in before
    lock = _write_lock(out, live_pid)  # a prepare at work
    capsys.readouterr()
    assert data_main(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"isollm-data prepare: error: {out} is in use by pid {live_pid} on {HOST} ({lock}); wait for that prepare "
        f"to end, or choose another --out"]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p != lock} == before
