"""``launch/sweep.py --mode slurm`` on a real cluster: one array task per run of the grid, each through
launch/slurm/train.sbatch, and ``eval.py compare`` over the runs they wrote gives the table."""

from __future__ import annotations

import csv
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from slurm_cluster import RUN, Cluster
from tiny import PYTHON, REPO, metrics_rows

from llm.cli.eval import main as eval_main

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]


def test_sweep_submits_a_job_array_and_compare_tables_its_runs(cluster: Cluster, corpus: Path, bpe: Path,
                                                               tmp_path: Path) -> None:
    (cluster.dir / "configs").mkdir()
    tiny = [item for item in RUN if not item.startswith(("name=", "train.max_steps=", "train.checkpoint_every="))]
    OmegaConf.save(OmegaConf.from_dotlist(tiny), cluster.dir / "configs" / "tiny.yaml")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "sweep", "configs": ["configs/tiny.yaml"], "grid": {"model.ffn": ["swiglu", "isogmlp"]},
        "overrides": {"data.source": str(corpus), "data.tokenizer": str(bpe), "data.cache_dir": str(tmp_path / "cache"),
                      "out_dir": str(cluster.dir / "runs"), "train.max_steps": 8, "train.eval_every": 4,
                      "train.checkpoint_every": 8},
        "run_name": "sw-{model.ffn}",
        # CPU nodes: no GPUs requested, one process per node (GPUS_PER_NODE=1 in the submitting environment)
        "slurm": {"nodes": 1, "gpus_per_node": 0, "cpus_per_task": 1, "time": "20:00"}}))
    proc = subprocess.run([PYTHON, str(REPO / "launch" / "sweep.py"), str(sweep), "--mode", "slurm",
                           "--root", str(cluster.dir)], cwd=cluster.dir, env=cluster.env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert job, proc.stdout
    cluster.jobs.append(job[1])
    tasks = cluster.wait(job[1])
    logs = {t["ArrayTaskId"]: cluster.log(f"{job[1]}_{t['ArrayTaskId']}", "sweep") for t in tasks}
    assert sorted((t["ArrayTaskId"], t["JobState"], t["ExitCode"]) for t in tasks) == [
        ("0", "COMPLETED", "0:0"), ("1", "COMPLETED", "0:0")], logs

    runs = cluster.dir / "runs"
    assert sorted(p.name for p in runs.iterdir() if p.name != "sweeps") == ["sw-isogmlp", "sw-swiglu"]
    out = tmp_path / "compare"
    assert eval_main(["compare", str(runs / "sw-*"), "--out", str(out), "--no-plots"]) == 0
    with (out / "comparison.csv").open() as f:
        rows = {row["variant"]: row for row in csv.DictReader(f)}
    assert sorted(rows) == ["isogmlp+softmax", "swiglu+softmax"]
    for ffn in ("swiglu", "isogmlp"):
        last_eval = metrics_rows(runs / f"sw-{ffn}", "eval")[-1]
        assert last_eval["step"] == 8
        assert float(rows[f"{ffn}+softmax"]["val_loss_mean"]) == pytest.approx(last_eval["val_loss"], rel=1e-9)
