"""SIGTERM on one rank of a 2-process (gloo) run stops every rank after the same step, with one checkpoint
written together; the stop flag rides on the loss's all-reduce, one collective per step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import metrics_rows, run, torchrun

from llm.train.checkpoint_files import verify_checkpoint

WORKER = Path(__file__).with_name("stop_worker.py")
SIGNAL_STEP = 3


@pytest.mark.slow
def test_signal_on_one_rank_stops_every_rank_after_that_step(run_overrides: list[str], tmp_path: Path) -> None:
    run(torchrun(2, str(WORKER), str(tmp_path), str(SIGNAL_STEP), *run_overrides, "train.max_steps=1000"))

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["step"], r["signalled"]) for r in ranks] == [(SIGNAL_STEP, True), (SIGNAL_STEP, True)]
    for r in ranks:  # the loss and the stop flag share one all-reduce (steps 1 and 2: no eval, no checkpoint)
        assert r["all_reduces_per_step"] == [1] * (SIGNAL_STEP - 1)
    run_dir = tmp_path / "runs" / "tiny"
    assert [row["step"] for row in metrics_rows(run_dir, "train")] == [1, 2, 3]
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", f"step_{SIGNAL_STEP:08d}"]
    verify_checkpoint(ckpts / f"step_{SIGNAL_STEP:08d}")
    assert sorted(p.name for p in (ckpts / f"step_{SIGNAL_STEP:08d}" / "state").glob("data_rank*.pt")) == [
        "data_rank0.pt", "data_rank1.pt"]
