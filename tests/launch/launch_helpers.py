"""Subprocess helpers of the launch tests: every command has a timeout, and failures show the output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TIMEOUT_S = 420  # 2-process runs take ~15 s on an idle 2-core machine; generous for a loaded one


def run(cmd: list[str], *, env: dict[str, str] | None = None, expect: int | None = 0,
        timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` from the repo root with a timeout; fail with its output unless it exits ``expect``
    (None: any non-zero status)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if (proc.returncode == 0) if expect is None else (proc.returncode != expect):
        wanted = "non-zero" if expect is None else expect
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode} (expected {wanted})\n"
                    f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def torchrun(nproc: int, *args: str) -> list[str]:
    """torchrun with a rendezvous on a free local port (--standalone), so parallel tests cannot clash."""
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
