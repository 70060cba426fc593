"""Fixtures of the tests on a real 2-node Slurm cluster (``scripts/slurm_local.sh up``: nodes n1 and n2 on this
machine). Every job runs on CPU, one process per node (``ACCELERATE_USE_CPU=1 GPUS_PER_NODE=1``,
``sbatch --gpus-per-node=0 --cpus-per-task=1``), from a submit directory under ``tmp_path`` whose ``launch/`` and
``train.py`` are this checkout's (so logs/ and runs/ stay out of the repository).

Outside CI the tests skip when no cluster answers; in CI (``CI=true``, where .ci/run brings the cluster up) they
fail instead. Every wait is bounded, and every job a test submitted is cancelled when it ends."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from slurm_cluster import RUN, SLURM_DIR, Cluster, checkout_at
from tiny import REPO, ddp_launch, run, write_docs


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """The environment of the cluster's commands and jobs: SLURM_CONF, this interpreter's venv, this checkout's
    llm, one thread per process, CPU ranks."""
    env = {**os.environ, "SLURM_CONF": str(SLURM_DIR / "slurm.conf"), "PYTHON_ENV": sys.prefix,
           "PYTHONPATH": str(REPO), "ACCELERATE_USE_CPU": "1", "GPUS_PER_NODE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    try:  # without its config file scontrol looks for one elsewhere (DNS included): 30 s to fail
        ping = (subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=30).stdout
                if (SLURM_DIR / "slurm.conf").is_file() else "no such file")
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        ping = str(err)
    if "UP" not in ping:
        said = (ping.strip().splitlines() or ["no answer"])[0]
        reason = f"no Slurm cluster answers at {env['SLURM_CONF']} ({said}): run scripts/slurm_local.sh up"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI brings it up in .ci/run)")
        pytest.skip(reason)
    return env


@pytest.fixture
def cluster(slurm_env: dict[str, str], tmp_path: Path) -> Iterator[Cluster]:
    """The cluster, submitting from ``tmp_path`` (a stand-in checkout); the test's jobs are cancelled after it."""
    slurm = Cluster(slurm_env, checkout_at(tmp_path / "submit"))
    yield slurm
    slurm.cancel_all()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 sample documents in 3 files (one shard each)."""
    return write_docs(tmp_path_factory.mktemp("slurm-corpus"), 300, 3, chars=600)


@pytest.fixture(scope="session")
def run_args(corpus: Path, bpe: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], list[str]]:
    """``run_args(out_dir)``: train.py's arguments of ``RUN`` on the corpus, writing runs/ under ``out_dir``."""
    cache = tmp_path_factory.mktemp("slurm-cache")

    def make(out_dir: Path, *extra: str) -> list[str]:
        return [*RUN, f"data.source={corpus}", f"data.tokenizer={bpe}", f"data.cache_dir={cache}",
                f"out_dir={out_dir}", *extra]

    return make


@pytest.fixture(scope="session")
def reference(slurm_env: dict[str, str], run_args: Callable[..., list[str]],
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``RUN`` under ``accelerate launch`` on this host with 2 processes, uninterrupted: its run directory."""
    out = tmp_path_factory.mktemp("slurm-reference")
    run(ddp_launch(["train.py", *run_args(out)]), env={"ACCELERATE_USE_CPU": "1"})
    return out / "slurm"
