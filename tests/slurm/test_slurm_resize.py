"""A run resubmitted on another allocation: 2 nodes, then 1, then 2 again. On prepared tokens each start takes
its share of the global order where the last left it (tests/data/test_data_resize.py checks the same under
torchrun): one global epoch, no window twice, the losses of an uninterrupted 2-process run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from slurm_cluster import Cluster
from tiny import ddp_launch, metrics_rows, run

from llm.cli.data import main as data_main

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]


@pytest.fixture
def prepared(corpus: Path, bpe: Path, tmp_path: Path) -> Path:
    """The corpus pre-tokenized (function scope: the footer cache goes under tmp_path, tests/conftest.py)."""
    out = tmp_path / "prepared"
    assert data_main(["prepare", "--source", str(corpus), "--tokenizer", str(bpe), "--val-bucket", "10",
                      "--out", str(out)]) == 0
    return out


def test_resubmitted_on_one_node_then_two_resumes_with_one_global_epoch(
        cluster: Cluster, run_args: Callable[..., list[str]], prepared: Path) -> None:
    # 256 tokens a step: 2 ranks x 4 windows of 32, or 1 rank x 2 micro-batches of 4; a constant lr, the same
    # whatever max_steps each submission gives
    args = run_args(cluster.dir / "runs", f"data.prepared={prepared}", "train.checkpoint_every=4",
                    "train.warmup_steps=1", "train.min_lr_ratio=1")
    for nodes, steps in ((2, 4), (1, 8), (2, 10)):
        job = cluster.sbatch(f"--nodes={nodes}", args=[*args, f"train.max_steps={steps}"])
        (task,) = cluster.wait(job)
        assert (task["JobState"], task["ExitCode"]) == ("COMPLETED", "0:0"), cluster.log(job)
    whole_dir = cluster.dir / "whole"
    run(ddp_launch(["train.py", *run_args(whole_dir, f"data.prepared={prepared}", "train.warmup_steps=1",
                                          "train.min_lr_ratio=1", "train.max_steps=10")]),
        env={"ACCELERATE_USE_CPU": "1"})

    run_dir = cluster.dir / "runs" / "slurm"
    resized, whole = metrics_rows(run_dir, "train"), metrics_rows(whole_dir / "slurm", "train")
    assert [r["step"] for r in resized] == list(range(1, 11))
    # the same 8 windows each step whatever the ranks: equal up to the order of the sums
    torch.testing.assert_close(torch.tensor([r["loss"] for r in resized]), torch.tensor([r["loss"] for r in whole]),
                               rtol=1e-5, atol=0)
    metas = metrics_rows(run_dir, "meta")
    assert [(m["step"], m["world_size"], m["grad_accum"]) for m in metas] == [(0, 2, 1), (4, 1, 2), (8, 2, 1)]
    states = [torch.load(run_dir / "checkpoints" / "step_00000010" / "state" / f"data_rank{r}.pt",
                         weights_only=True)["workers"] for r in range(2)]
    # 64 windows (8 steps x 8) before the last start; since then 2 steps x 4 windows on each of the 2 ranks
    assert [worker["from"] for state in states for worker in state] == [64, 64]
    assert sum(worker["taken"] for state in states for worker in state) == 16
