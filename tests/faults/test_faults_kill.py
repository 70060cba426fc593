"""Fault-injection suite: no run is lost to a kill, a crash, a bad batch, a bad file.

Which test covers which fault:

- kill -9 at a random moment, then resume: this file (bitwise-equal losses and final weights).
- a streaming read that fails (connection drop, timeout, corrupt file): tests/faults/test_faults_stream.py.
- disk full half-way through the model save: tests/faults/test_faults_disk.py.
- SIGTERM mid-run -> checkpoint + exit 0: tests/train/test_cli.py::test_sigterm_checkpoints_and_exits_0.
- a checkpoint truncated on disk is skipped on resume:
  tests/train/test_checkpoint.py::test_keep_k_pointer_and_truncated_checkpoint_fallback.
- non-finite (NaN) batches are skipped and counted, and too many in a row stop the run with state saved:
  tests/train/test_fit.py::test_nonfinite_step_is_skipped_and_counted and
  ::test_consecutive_nonfinite_steps_stop_with_state_saved.
- a full disk as each writer reports it, on one rank of two, on resume, while logging: test_faults_save.py.
- same-size corruption of each checkpoint file, the pointer, the validation cache; no usable checkpoint:
  test_faults_corrupt.py.
- two runs of one name, stale locks: test_faults_lock.py.
- non-finite parameters after an update, NaN metrics, eval.py on NaN / altered checkpoints, config gaps:
  test_faults_nonfinite.py.
- SIGTERM to the launcher (torchrun.sh, accelerate launch), the sweep's checkout: test_faults_launch.py.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
from tiny import assert_same_weights, metrics_rows, start_train_py, trajectory

from llm.config import load_config
from llm.train.trainer import fit

SEED = 8
"""Seed of the kill moment (which checkpoint arms it, and the delay after it)."""
MAX_STEPS = 12
TIMEOUT_S = 300


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_resume_equals_uninterrupted_run(run_overrides: list[str],
                                                                         tmp_path: Path) -> None:
    rng = random.Random(SEED)
    armed_by = rng.randint(1, MAX_STEPS - 4)
    delay = rng.uniform(0.0, 0.3)
    print(f"kill seed {SEED}: SIGKILL {delay:.3f} s after checkpoint step {armed_by} appears")
    args = [*run_overrides, f"train.max_steps={MAX_STEPS}", "train.checkpoint_every=1", "train.keep_checkpoints=2"]
    log = tmp_path / "killed.log"
    killed = start_train_py(tmp_path, *args, "name=killed", log=log)

    ckpts = tmp_path / "runs" / "killed" / "checkpoints"
    armed = ckpts / f"step_{armed_by:08d}"
    deadline = time.monotonic() + TIMEOUT_S
    while not armed.is_dir() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay)
    assert killed.poll() is None, f"the run ended before the kill:\n{log.read_text()}"
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(timeout=60) == -signal.SIGKILL
    print(f"left on disk by the kill: {sorted(p.name for p in ckpts.iterdir())}")

    resumed = start_train_py(tmp_path, *args, "name=killed", "resume=true", log=log)
    fit(load_config(None, [*args, "name=whole"]))  # the uninterrupted reference, in-process meanwhile
    assert resumed.wait(timeout=TIMEOUT_S) == 0, log.read_text()[-3000:]

    resumed_from = [r["resumed_from"] for r in metrics_rows(tmp_path / "runs" / "killed", "meta")]
    assert len(resumed_from) == 2 and int(resumed_from[1][-8:]) >= armed_by  # it did resume, not restart
    reference = trajectory(tmp_path / "runs" / "whole")
    assert [row[0] for row in reference] == list(range(1, MAX_STEPS + 1))
    assert trajectory(tmp_path / "runs" / "killed") == reference  # bitwise: each step once, same numbers

    last = f"step_{MAX_STEPS:08d}"
    assert_same_weights(tmp_path / "runs" / "whole" / "checkpoints" / last, ckpts / last)
    assert not list(ckpts.glob("*.tmp"))  # a checkpoint torn by the kill was cleaned up
