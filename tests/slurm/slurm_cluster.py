"""The test cluster's commands and what the tests marked ``slurm`` share (tests/slurm/conftest.py has the
fixtures; a module of its own, since ``conftest`` names a module of every test folder)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny import REPO, TINY_TRAIN, free_port, metrics_rows

SLURM_DIR = Path(os.environ.get("ISOLLM_SLURM_DIR", "/tmp/isollm-slurm"))
"""Where scripts/slurm_local.sh keeps the cluster's config, state and logs."""
SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}
JOB_TIMEOUT_S = 240
"""Longest wait for one job (a tiny run takes 10-30 s from submission on a loaded 2-core machine)."""
JOB = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=20:00"]
"""sbatch options of every CPU job (20 minutes: over train.sbatch's 600-s signal lead)."""
RUN = [*TINY_TRAIN, "data.val_bucket=10", "data.val_tokens=330", "train.max_steps=600", "train.checkpoint_every=25",
       "name=slurm"]
"""A tiny run of 600 steps (a few seconds on 2 ranks): long enough to signal or kill it mid-run."""


class Cluster:
    """sbatch / squeue / scontrol on the test cluster, from one submit directory; remembers its jobs."""

    def __init__(self, env: dict[str, str], submit_dir: Path) -> None:
        self.env = env
        self.dir = submit_dir
        self.jobs: list[str] = []

    def command(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(args, cwd=self.dir, env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            pytest.fail(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, *options: str, script: Path = SBATCH, args: list[str] | tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> str:
        """Submit ``script args`` with ``JOB`` and ``options``; its job id. A fresh rendezvous port per job."""
        extra = {"MASTER_PORT": str(free_port()), **(env or {})}
        proc = subprocess.run(["sbatch", "--parsable", *JOB, *options, str(script), *args], cwd=self.dir,
                              env={**self.env, **extra}, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        job = proc.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def tasks(self, job: str) -> list[dict[str, str]]:
        """``scontrol show job``'s fields, one dict per task of ``job`` (one, unless it is an array)."""
        out = self.command("scontrol", "show", "job", "-o", job)
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]

    def wait(self, job: str, timeout: float = JOB_TIMEOUT_S) -> list[dict[str, str]]:
        """Wait until every task of ``job`` has ended; their fields. A requeued job is made eligible 5 s on
        (Slurm holds a requeued batch job for about 2 minutes; one started in the second of its requeue is
        refused by slurmd, "Job credential revoked", and fails)."""
        deadline = time.monotonic() + timeout
        released: set[tuple[str, str]] = set()
        while time.monotonic() < deadline:
            tasks = self.tasks(job)
            if all(t["JobState"] in ENDED for t in tasks):
                return tasks
            for t in tasks:
                restart = (t["JobId"], t["Restarts"])
                if t["JobState"] == "PENDING" and t["Reason"] == "BeginTime" and restart not in released:
                    self.command("scontrol", "update", f"JobId={t['JobId']}", "StartTime=now+5", check=False)
                    released.add(restart)
            time.sleep(1)
        pytest.fail(f"job {job} still {[t['JobState'] for t in self.tasks(job)]} after {timeout:.0f} s\n"
                    f"{self.log(job)[-4000:]}")

    def wait_for(self, condition: Callable[[], bool], job: str, timeout: float = JOB_TIMEOUT_S) -> None:
        """Poll ``condition`` until it holds while ``job`` runs; fail if the job ends first or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if all(t["JobState"] in ENDED for t in self.tasks(job)):
                pytest.fail(f"job {job} ended before the test could act on it\n{self.log(job)[-4000:]}")
            time.sleep(0.2)
        pytest.fail(f"job {job}: condition not met within {timeout:.0f} s\n{self.log(job)[-4000:]}")

    def log(self, job: str, name: str = "isollm") -> str:
        """The job's output file (train.sbatch's --output, logs/%x-%j.out)."""
        path = self.dir / "logs" / f"{name}-{job}.out"
        return path.read_text(errors="replace") if path.is_file() else f"(no {path})"

    def cancel_all(self) -> None:
        if self.jobs:
            self.command("scancel", "--full", *self.jobs, check=False)


def checkout_at(directory: Path) -> Path:
    """A directory that runs as this checkout (its launch/, llm/, train.py, eval.py), with its own logs/."""
    directory.mkdir()
    for name in ("launch", "llm", "train.py", "eval.py"):
        (directory / name).symlink_to(REPO / name)
    (directory / "logs").mkdir()
    return directory




def train_rows(run_dir: Path) -> int:
    """How many train rows ``run_dir/metrics.jsonl`` holds so far (0 before it exists or while a row is half
    written)."""
    try:
        return len(metrics_rows(run_dir, "train"))
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
