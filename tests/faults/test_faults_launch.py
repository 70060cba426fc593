"""Launchers: the sweep runs in the checkout it is invoked from, never in the installed ``llm``'s location (two
clones sharing one environment); the Slurm script binds CPUs per task; a SIGTERM to the launcher process
(torchrun.sh, accelerate launch), not to a rank, ends in a checkpoint and exit code 0."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tiny import REPO, TINY_MODEL, free_port, metrics_rows

from llm.cli.sweep import main as sweep_main
from llm.train.checkpoint_files import verify_checkpoint

STUB_TRAIN_PY = """import json, os, sys
from pathlib import Path
import llm
with open(Path(__file__).parent / "ran.jsonl", "a") as f:
    f.write(json.dumps({"cwd": os.getcwd(), "llm": llm.__file__, "args": sys.argv[1:]}) + "\\n")
"""


@pytest.fixture
def other_clone(tmp_path: Path) -> Path:
    """Clone B: its own launch/sweep.py, llm/ and a train.py that records where it ran and which llm it got."""
    clone = tmp_path / "clone-b"
    (clone / "launch").mkdir(parents=True)
    shutil.copy(REPO / "launch" / "sweep.py", clone / "launch" / "sweep.py")
    (clone / "llm").symlink_to(REPO / "llm", target_is_directory=True)
    (clone / "train.py").write_text(STUB_TRAIN_PY)
    (clone / "configs").mkdir()
    overrides = dict(item.split("=", 1) for item in TINY_MODEL if not item.startswith("trackers"))
    (clone / "configs" / "tiny.yaml").write_text(yaml.safe_dump(
        {"model": {k.split(".")[1]: int(v) for k, v in overrides.items() if k.startswith("model.")},
         "data": {"seq_len": 32}, "train": {"max_steps": 2, "global_batch_tokens": 256}}))
    return clone


def _sweep_file(directory: Path) -> Path:
    path = directory / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "b", "configs": ["configs/tiny.yaml"], "grid": {"seed": [3]},
                                    "command": f"{sys.executable} train.py"}))
    return path


def _runs_in(clone: Path) -> list[dict]:
    """The runs clone B's train.py recorded (the sweep has one: seed 3)."""
    rows = [json.loads(line) for line in (clone / "ran.jsonl").read_text().splitlines()]
    assert [r["args"][-2:] for r in rows] == [["seed=3", "name=3"]]
    return rows


@pytest.mark.slow
def test_launch_sweep_py_runs_its_own_checkout(other_clone: Path, tmp_path: Path) -> None:
    """Invoked from elsewhere with clone A first on the path (A's llm installed): B's code runs, in B."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(other_clone / "launch" / "sweep.py"), str(_sweep_file(elsewhere)),
                           "--mode", "local"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for row in _runs_in(other_clone):
        assert row["cwd"] == str(other_clone)
        assert row["llm"] == str(other_clone / "llm" / "__init__.py")


@pytest.mark.slow
def test_sweep_root_flag_and_current_checkout(other_clone: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert sweep_main([str(_sweep_file(tmp_path)), "--mode", "local", "--root", str(other_clone)]) == 0
    assert {row["cwd"] for row in _runs_in(other_clone)} == {str(other_clone)}
    (other_clone / "ran.jsonl").unlink()
    monkeypatch.chdir(other_clone / "configs")  # inside clone B: its checkout, not this test's
    assert sweep_main([str(_sweep_file(tmp_path)), "--mode", "local"]) == 0
    assert {row["cwd"] for row in _runs_in(other_clone)} == {str(other_clone)}
    monkeypatch.chdir(tmp_path)
    assert sweep_main([str(_sweep_file(tmp_path)), "--mode", "print"]) == 2  # no checkout here: one line, exit 2


LAUNCHERS = {
    "torchrun.sh": lambda: ["bash", "launch/torchrun.sh", "2"],
    "accelerate launch": lambda: ["bash", "launch/supervise.sh", sys.executable, "-m", "accelerate.commands.launch",
                                  "--config_file", "launch/accelerate/ddp.yaml", "--num_processes", "2",
                                  "--main_process_port", str(free_port()), "train.py"],
}
"""The launch lines of docs/distributed.md (``accelerate launch`` through launch/supervise.sh, as documented),
with this interpreter. Slurm's train.sbatch runs the same supervise.sh line on each node
(tests/launch/test_scripts.py: its srun also binds --cpus-per-task)."""


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "target"), [("torchrun.sh", "launcher"), ("torchrun.sh", "process group"),
                                                  ("accelerate launch", "process group")])
def test_sigterm_to_the_launcher_checkpoints_and_exits_0(launcher: str, target: str, run_overrides: list[str],
                                                          tmp_path: Path) -> None:
    """SIGTERM to the launcher's process (``kill <pid>``), or to its whole process group (a terminal's Ctrl-C
    or a scheduler signalling every process, which reaches torch elastic's agent itself): both ranks checkpoint
    the same step and the launcher line exits 0."""
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "ACCELERATE_USE_CPU": "1"}
    command = [*LAUNCHERS[launcher](), *run_overrides, "name=sig", "train.max_steps=100000",
               "train.checkpoint_every=100000"]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    run_dir = tmp_path / "runs" / "sig"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and len(metrics_rows(run_dir, "train")) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    if target == "launcher":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    # signalled itself, torch elastic's agent exits 1 after its ranks' clean stop; supervise.sh says it exits 0
    mapped = "exited 1, but every rank on this node exited 0 (a stop by signal that ended in a checkpoint)" in err
    assert mapped == (target == "process group")
    last = metrics_rows(run_dir, "train")[-1]["step"]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{last:08d}"
    verify_checkpoint(ckpts / f"step_{last:08d}")
    assert sorted(p.name for p in (ckpts / f"step_{last:08d}" / "state").glob("data_rank*.pt")) == [
        "data_rank0.pt", "data_rank1.pt"]
