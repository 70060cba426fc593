"""launch/slurm/train.sbatch and launch/torchrun.sh, run with stand-ins for srun / scontrol / scancel /
accelerate / python on PATH: the rendezvous comes from the Slurm environment, one task per node, logs per
rank, and a time-limit signal ends in SIGTERM to the trainer followed by a requeue."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from tiny import REPO

SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
TORCHRUN = REPO / "launch" / "torchrun.sh"
FAKES = {
    "scontrol": 'if [[ "$1 $2" == "show hostnames" ]]; then printf "node001\\nnode002\\n"; '
                'else echo "scontrol $*" >> "$FAKE_LOG"; fi',
    "scancel": 'echo "scancel $*" >> "$FAKE_LOG"; kill -TERM "$(cat "$FAKE_PID")"',
    # srun: drop its own options, run the task here as node 0 (one task per node).
    "srun": 'echo "srun $*" >> "$FAKE_LOG"; while [[ "$1" == --* ]]; do shift; done; '
            'SLURM_NODEID=0 exec "$@"',
    # accelerate: record the arguments; with FAKE_SLEEP, "train" until SIGTERM, then "checkpoint" and exit 0.
    # (The pid file is written last, atomically, so the test signals only a fully set-up fake.)
    "accelerate": 'trap \'kill $!; echo "trainer got SIGTERM" >> "$FAKE_LOG"; exit 0\' TERM; '
                  'printf "%s\\n" "$@" > "$FAKE_ARGS"; '
                  'echo $$ > "$FAKE_PID.tmp"; mv "$FAKE_PID.tmp" "$FAKE_PID"; '
                  'if [[ -n "${FAKE_SLEEP:-}" ]]; then sleep 60 > /dev/null 2>&1 & wait; fi',
}


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, str]:
    """Environment of a 2-node job (id 1234) with the stand-in commands first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "launch").symlink_to(REPO / "launch")  # the submit directory is a checkout
    for name, body in FAKES.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(tmp_path / "log"),
            "FAKE_ARGS": str(tmp_path / "args"), "FAKE_PID": str(tmp_path / "pid"),
            "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "1234", "SLURM_JOB_NAME": "isollm",
            "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_NNODES": "2", "GPUS_PER_NODE": "8",
            "SLURM_CPUS_PER_TASK": "64",
            "PYTHON_ENV": str(tmp_path / "no-venv")}


def test_sbatch_rendezvous_from_slurm_environment(slurm: dict[str, str], tmp_path: Path) -> None:
    subprocess.run(["bash", str(SBATCH), "--config", "x.yaml", "name=a b"], env=slurm, check=True,
                   capture_output=True, timeout=60)
    args = Path(slurm["FAKE_ARGS"]).read_text().splitlines()
    assert args == ["launch", "--config_file", "launch/accelerate/ddp.yaml",
                    "--num_machines", "2", "--num_processes", "16", "--machine_rank", "0",
                    "--main_process_ip", "node001", "--main_process_port", str(20000 + 1234),
                    "--rdzv_backend", "static", "--same_network", "--tee", "3",
                    "--log_dir", "logs/isollm-1234/node0",
                    "train.py", "--config", "x.yaml", "name=a b", "resume=true"]
    log = Path(slurm["FAKE_LOG"]).read_text()
    # srun binds the batch job's CPUs per task explicitly (Slurm >= 22.05 no longer passes them on)
    assert "srun --ntasks-per-node=1 --cpus-per-task=64 " in log and "requeue" not in log  # finished: no requeue
    assert (tmp_path / "logs" / "isollm-1234").is_dir()


def test_sbatch_time_limit_checkpoints_then_requeues(slurm: dict[str, str]) -> None:
    job = subprocess.Popen(["bash", str(SBATCH), "--config", "x.yaml"], env={**slurm, "FAKE_SLEEP": "1"},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not Path(slurm["FAKE_PID"]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(job.pid, signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@600` sends before the limit
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 0, err
    log = Path(slurm["FAKE_LOG"]).read_text().splitlines()
    # SIGTERM reaches the training step (which checkpoints and exits), and only then is the job requeued.
    assert log[-3:] == ["scancel --signal=TERM 1234", "trainer got SIGTERM", "scontrol requeue 1234"]


def test_torchrun_sh(tmp_path: Path) -> None:
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/usr/bin/env bash\necho "$OMP_NUM_THREADS $*"\n')
    fake_python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake_python)}
    out = subprocess.run(["bash", str(TORCHRUN), "2", "--config", "c.yaml", "seed=1"], env=env, check=True,
                         capture_output=True, text=True, timeout=30).stdout.split()
    assert int(out[0]) >= 1  # OMP threads: cores / processes, at least 1
    assert out[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       "train.py", "--config", "c.yaml", "seed=1"]
    bad = subprocess.run(["bash", str(TORCHRUN), "--config", "c.yaml"], env=env, capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "usage:" in bad.stderr
