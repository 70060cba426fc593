"""What several test folders share: the real FineWeb sample beside the checkout, slices of it, the
overrides of a tiny run (2 layers, width 32, vocabulary 512) that takes well under a second a step,
train.py and multi-process commands in subprocesses, and readers of what a run writes (metrics.jsonl,
checkpoint weights)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import llm.data.pieces

REPO = Path(__file__).resolve().parents[1]
FINEWEB = REPO.parent / "shared" / "data" / "fineweb-sample"

TINY_MODEL = [
    "model.vocab_size=512", "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.max_position_embeddings=64",
    "data.seq_len=32", "data.shuffle_block=8", "trackers=[]",
]
"""Model and data-shape overrides of the tiny run; each folder adds its validation and train settings."""

TINY_TRAIN = [
    *TINY_MODEL, "train.lr=3e-3", "train.warmup_steps=5", "train.micro_batch_size=4", "train.global_batch_tokens=256",
    "train.log_every=1", "train.eval_every=1000", "train.isotropy_samples=128", "train.grad_norm_window=10",
]
"""``TINY_MODEL`` plus the train settings of the trainer and fault tests (a train row every step, no eval);
each folder adds its validation-set size and step counts."""


def fineweb_files() -> list[Path]:
    files = sorted(FINEWEB.glob("*.parquet"))
    if not files:
        pytest.skip(f"no FineWeb sample at {FINEWEB} (shared/data beside the checkout)")
    return files


def write_docs(directory: Path, count: int, num_files: int, chars: int | None = None) -> Path:
    """The first ``count`` sample documents (text cut to ``chars`` when given), as ``num_files`` parquet
    files with FineWeb's columns text and id, under ``directory``."""
    rows = pq.read_table(fineweb_files()[0], columns=["text", "id"]).slice(0, count).to_pylist()
    if chars is not None:
        rows = [{"text": row["text"][:chars], "id": row["id"]} for row in rows]
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(rows) // num_files)
    for i in range(num_files):
        table = pa.Table.from_pylist(rows[i * per_file : (i + 1) * per_file])
        pq.write_table(table, directory / f"train-{i:05d}-of-{num_files:05d}.parquet")
    return directory


def start_train_py(cwd: Path, *args: str, log: Path | None = None) -> subprocess.Popen:
    """``train.py args`` in a subprocess run from ``cwd`` on one thread, like the in-process runs (the
    conftest's ``one_thread``): CPU runs are then bitwise reproducible. Output is appended to ``log``, or
    readable through pipes (text) without one."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(REPO / "train.py"), *args]
    if log is None:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with open(log, "a") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


PYTHON = sys.executable
TIMEOUT_S = 420
"""Limit of a multi-process test command: 2-process runs take ~15 s on an idle 2-core machine."""


def run(cmd: list[str], *, env: dict[str, str] | None = None, expect: int | None = 0,
        timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` from the repo root on one thread per process, with a timeout; fail with its output unless
    it exits ``expect`` (None: any non-zero status)."""
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_launch(args: list[str]) -> list[str]:
    """``args`` under ``accelerate launch`` with launch/accelerate/ddp.yaml on 2 processes. Run it with
    ACCELERATE_USE_CPU=1: gloo DDP on CPU (``--cpu`` would start one process: verified with accelerate 1.15)."""
    return [PYTHON, "-m", "accelerate.commands.launch", "--config_file", "launch/accelerate/ddp.yaml",
            "--num_processes", "2", "--main_process_port", str(free_port()), *args]


def metrics_rows(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` (only those of ``kind`` when given)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if kind is None or r["kind"] == kind]


def trajectory(run_dir: Path) -> list[tuple[int, float, float, float]]:
    """``(step, loss, grad_norm, lr)`` of every train row: what a resumed run must reproduce bit for bit."""
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in metrics_rows(run_dir, "train")]


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The weights a checkpoint saved (its HF ``model/`` directory)."""
    return load_file(checkpoint / "model" / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    """Checkpoints ``a`` and ``b`` hold bitwise-equal weights under the same names."""
    wa, wb = checkpoint_weights(a), checkpoint_weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def fail_reads(monkeypatch: pytest.MonkeyPatch, fail: set[int], error: Exception) -> dict[str, int]:
    """Make the n-th batch read of any piece reader (1-based, counted over all readers) raise ``error``
    after the underlying reader has consumed the batch (the worst case: that position is gone)."""
    reads = {"n": 0}
    real = llm.data.pieces.read_piece

    def flaky(*args, **kwargs) -> Iterator[tuple]:
        for batch in real(*args, **kwargs):
            reads["n"] += 1
            if reads["n"] in fail:
                raise error
            yield batch

    monkeypatch.setattr(llm.data.pieces, "read_piece", flaky)
    return reads


def record_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The read retries' backoff sleeps, recorded instead of slept."""
    sleeps: list[float] = []
    monkeypatch.setattr(llm.data.pieces.time, "sleep", sleeps.append)
    return sleeps


def forget_sources() -> None:
    """Clear what a process caches of its data sources (resolved sources, their fingerprints, parquet footers), as
    a new process starts: for tests that change a source's files between two in-process runs."""
    from llm.data import files, footers, sources

    for cached in (sources._resolve_once, sources.source_fingerprint, sources._repository_files,
                   footers.parquet_metadata, files.file_size):
        cached.cache_clear()


LONGEST = ("tests/test_readme.py", "tests/launch/test_gpu_check.py")
"""The files of the longest single tests (``--durations`` on a quiet 2-core machine: the README's commands ~3.5
minutes; the GPU check's dry run ~5.5, in three parts): their ``slow`` tests start first, in this order."""


def longest_first(items: list[pytest.Item]) -> None:
    """The suite's order (tests/conftest.py's ``pytest_collection_modifyitems``), in place: the longest tests first,
    then the other ``slow`` ones, then the rest, each in collection order. xdist (``make test``'s ``-n 2 --dist
    loadgroup``) hands tests out in this order, so the short ones fill the end on both workers instead of one long
    test started last keeping a worker busy alone (the README's test, collected near the end, could start last and
    run its ~3.5 minutes alone)."""
    def rank(item: pytest.Item) -> tuple[int, bool]:
        slow, path = item.get_closest_marker("slow") is not None, item.nodeid.split("::")[0]
        return LONGEST.index(path) if slow and path in LONGEST else len(LONGEST), not slow

    items.sort(key=rank)
