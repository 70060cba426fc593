"""A failed or stuck rank ends the whole run within a bounded time, with one line: ranks that disagree on
the steps or micro-batches stop before the first step, ranks that fall out of step stop at the collective timeout,
SIGTERM ends a rank blocked in a collective after the grace time, and a tracker failure on rank 0 is a warning."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny import metrics_rows, run, torchrun

from llm.cli.train import _report

WORKER = str(Path(__file__).with_name("rank_fault_worker.py"))


def _launch(fault: str, overrides: list[str], *extra: str, expect: int | None) -> tuple[str, float]:
    started = time.monotonic()
    proc = run(torchrun(2, WORKER, fault, *overrides, "name=faulty", "train.max_steps=4", *extra), expect=expect,
               timeout=240)
    return proc.stderr, time.monotonic() - started


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_an_error_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank reports its error to torchrun's shared stderr; unbuffered (``PYTHONUNBUFFERED``), a ``print``
    writes the text and its newline separately, and two ranks' lines interleaved (CI, 2026-11-26)."""
    writes: list[str] = []

    class Stream:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr("sys.stderr", Stream())
    _report(ValueError("rank 1 disagrees"))
    assert writes == ["error: rank 1 disagrees\n"]


@pytest.mark.slow
def test_ranks_that_disagree_on_micro_batches_stop_before_the_first_step(
        overrides_under: Callable[[Path], list[str]], tmp_path: Path) -> None:
    stderr, _ = _launch("disagree", overrides_under(tmp_path), expect=None)
    assert _errors(stderr) == ["error: rank 1 disagrees with rank 0 on micro_batches (2 vs 1): every rank must run "
                               "the same steps and micro-batches"] * 2
    assert metrics_rows(tmp_path / "runs" / "faulty", "train") == []


@pytest.mark.slow
def test_a_rank_out_of_step_ends_the_run_at_the_collective_timeout(
        overrides_under: Callable[[Path], list[str]], tmp_path: Path) -> None:
    stderr, seconds = _launch("extra_batch", overrides_under(tmp_path), "train.collective_timeout_s=10",
                              expect=None)
    assert any("another rank stopped or is stuck" in line for line in _errors(stderr)), stderr[-3000:]
    assert seconds < 120


@pytest.mark.slow
def test_sigterm_ends_a_rank_blocked_in_a_collective(overrides_under: Callable[[Path], list[str]],
                                                     tmp_path: Path) -> None:
    """The collective timeout is 10 minutes: the grace time after SIGTERM (3 s) is what ends the run."""
    stderr, seconds = _launch("sigterm_blocked", overrides_under(tmp_path), "train.collective_timeout_s=600",
                              "train.stop_grace_s=3", expect=None)
    assert any(line.startswith("error: still running 3 s after signal 15 (train.stop_grace_s)")
               for line in _errors(stderr)), stderr[-3000:]
    assert seconds < 120


@pytest.mark.slow
def test_a_tracker_failure_on_rank_0_is_a_warning(overrides_under: Callable[[Path], list[str]],
                                                  tmp_path: Path) -> None:
    stderr, _ = _launch("tracker", overrides_under(tmp_path), "trackers=[tensorboard]", expect=0)
    assert "warning: tracker tensorboard failed at step 2 (OSError: [Errno 28] No space left on device); it is " \
           "off for the rest of the run (metrics.jsonl keeps every row)" in stderr
    assert [row["step"] for row in metrics_rows(tmp_path / "runs" / "faulty", "train")] == [1, 2, 3, 4]
