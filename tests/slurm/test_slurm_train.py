"""launch/slurm/train.sbatch on a real 2-node Slurm (scripts/slurm_local.sh): 2 nodes x 1 process equal
``accelerate launch`` on one host bitwise; the time-limit signal checkpoints, requeues and resumes exactly; a lost
node ends the job at once with one line naming it, and the run resumes from its last good checkpoint; a time limit
within the signal's lead is refused."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from slurm_cluster import Cluster, train_rows
from tiny import assert_same_weights, metrics_rows, trajectory

from llm.train.checkpoint_files import verify_checkpoint

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

FINAL = "checkpoints/step_00000600"


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Every step's loss, gradient norm and lr, the validation loss and the final weights, bit for bit."""
    assert trajectory(run_dir) == trajectory(reference)
    assert [r["val_loss"] for r in metrics_rows(run_dir, "eval")] == [r["val_loss"] for r in
                                                                      metrics_rows(reference, "eval")]
    assert_same_weights(run_dir / FINAL, reference / FINAL)


def test_two_nodes_equal_accelerate_launch_on_one_host(cluster: Cluster, reference: Path,
                                                       run_args: Callable[..., list[str]]) -> None:
    job = cluster.sbatch("--nodes=2", args=run_args(cluster.dir / "runs"))
    (task,) = cluster.wait(job)
    assert (task["JobState"], task["ExitCode"], task["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), cluster.log(job)
    run_dir = cluster.dir / "runs" / "slurm"
    (meta,) = metrics_rows(run_dir, "meta")
    assert (meta["world_size"], meta["grad_accum"]) == (2, 1)
    assert len(trajectory(run_dir)) == 600
    assert_same_run(run_dir, reference)
    # one rank per node: each node's launcher wrote its rank's logs
    assert sorted(p.name for p in (cluster.dir / "logs" / f"isollm-{job}").iterdir()) == ["node0", "node1"]


def test_time_limit_signal_checkpoints_requeues_and_resumes_exactly(cluster: Cluster, reference: Path,
                                                                    run_args: Callable[..., list[str]]) -> None:
    run_dir = cluster.dir / "runs" / "slurm"
    job = cluster.sbatch("--nodes=2", args=run_args(cluster.dir / "runs", "train.checkpoint_every=1000"))
    cluster.wait_for(lambda: train_rows(run_dir) >= 3, job)
    # what `#SBATCH --signal=B:USR1@600` sends to the batch shell before the time limit
    cluster.command("scancel", "--signal=USR1", "--batch", job)
    (task,) = cluster.wait(job)
    log = cluster.log(job)
    assert (task["JobState"], task["ExitCode"], task["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    assert "time limit near: SIGTERM to the training step, then requeue" in log
    first, second = metrics_rows(run_dir, "meta")
    assert first["step"] == 0
    stopped = second["step"]
    assert 0 < stopped < 600  # the second start resumed from the checkpoint the signal wrote
    assert re.search(rf"resumed from \S+step_{stopped:08d} at step {stopped}", log), log[-3000:]
    assert_same_run(run_dir, reference)


def test_a_lost_node_ends_the_job_and_the_run_resumes_from_its_last_checkpoint(
        cluster: Cluster, reference: Path, run_args: Callable[..., list[str]]) -> None:
    timeout_s = 20
    args = run_args(cluster.dir / "runs", f"train.collective_timeout_s={timeout_s}")
    run_dir = cluster.dir / "runs" / "slurm"
    job = cluster.sbatch("--nodes=2", args=args)
    cluster.wait_for(lambda: (run_dir / "checkpoints" / "latest").is_file(), job)
    # the node is gone: every process of the job's task on n2 dies at once
    pids = [int(line.split()[0]) for line in cluster.command("scontrol", "listpids", job, "n2").splitlines()[1:]]
    assert pids
    killed = time.monotonic()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # a child that ended with its parent
            os.kill(pid, signal.SIGKILL)
    (task,) = cluster.wait(job)
    assert time.monotonic() - killed < timeout_s + 60
    log = cluster.log(job)
    assert task["JobState"] == "FAILED" and task["ExitCode"] != "0:0", log
    # one line names the lost node and its task (= machine rank 1: ranks 1 x GPUS_PER_NODE on)
    assert [line for line in log.splitlines() if "n2: task 1" in line] == ["srun: error: n2: task 1: Killed"], log
    last = (run_dir / "checkpoints" / "latest").read_text().strip()
    verify_checkpoint(run_dir / "checkpoints" / last)
    step = int(last.removeprefix("step_"))
    assert 25 <= step < 600

    again = cluster.sbatch("--nodes=2", args=args)
    (task,) = cluster.wait(again)
    log = cluster.log(again)
    assert (task["JobState"], task["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert re.search(rf"resumed from \S+{last} at step {step}", log), log[-3000:]
    assert_same_run(run_dir, reference)


def test_a_time_limit_within_the_signal_lead_is_refused(cluster: Cluster,
                                                        run_args: Callable[..., list[str]]) -> None:
    """--time=5 (minutes) is under the 600-s lead: the signal would come at every start, a requeue loop."""
    job = cluster.sbatch("--nodes=1", "--time=5", args=run_args(cluster.dir / "runs"))
    (task,) = cluster.wait(job)
    log = cluster.log(job)
    assert (task["JobState"], task["ExitCode"], task["Restarts"]) == ("FAILED", "2:0", "0"), log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors == ["error: the job's time limit (300 s) is within the time-limit signal's lead (600 s): every "
                      "start would stop at once and requeue; submit with --time longer than 600 s, or a shorter "
                      "--signal=B:USR1@<s> and SIGNAL_LEAD_S=<s>"]
    assert not (cluster.dir / "runs").exists()  # refused before anything trained


def test_no_process_per_node_is_refused(cluster: Cluster, run_args: Callable[..., list[str]]) -> None:
    """--gpus-per-node=0 without GPUS_PER_NODE=1 would launch 0 processes a node (and divide by 0)."""
    job = cluster.sbatch("--nodes=1", args=run_args(cluster.dir / "runs"), env={"GPUS_PER_NODE": "0"})
    (task,) = cluster.wait(job)
    log = cluster.log(job)
    assert (task["JobState"], task["ExitCode"]) == ("FAILED", "2:0"), log
    assert [line for line in log.splitlines() if line.startswith("error:")] == [
        "error: GPUS_PER_NODE=0: one process per GPU needs at least 1 "
        "(CPU nodes: ACCELERATE_USE_CPU=1 GPUS_PER_NODE=1)"]
