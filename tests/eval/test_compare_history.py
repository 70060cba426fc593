"""compare reads a run by its whole metrics history: each start (the first and every resume) appends a meta row with
the config and max_steps in force, and the run is what its segments say together, not what its first one said."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_compare import run_config

from llm.cli.eval import main
from llm.eval.compare import compare_runs
from llm.eval.runs import load_run

Segment = tuple[int, int, dict[str, Any]]
"""(max_steps in force, the step the segment stopped at, its ``train`` config edits); each resumes where the last
stopped, as the trainer writes it (llm.train.setup: a meta row at the resume step; rows past the checkpoint are
dropped before it)."""


def resumed_run(root: Path, name: str, seed: int, segments: list[Segment]) -> Path:
    run = root / name
    run.mkdir(parents=True)
    rows: list[dict[str, Any]] = []
    start = 0
    for max_steps, stop, edits in segments:
        config = run_config("swiglu+softmax", seed)
        config["train"].update(max_steps=max_steps, **edits)
        rows.append({"kind": "meta", "step": start, "tokens": start * 100, "variant": "swiglu+softmax", "seed": seed,
                     "params_total": 1000, "params_non_embedding": 500, "max_steps": max_steps, "config": config})
        for step in range(start + 1, stop + 1):
            rows.append({"kind": "train", "step": step, "tokens": step * 100, "loss": 6.0 - step / 10,
                         "grad_norm": 1.0, "grad_norm_var_run": 0.01, "tokens_per_s": 1000.0})
            if step % 2 == 0:
                rows.append({"kind": "eval", "step": step, "tokens": step * 100, "layers": [],
                             "val_loss": 5.0 - step / 100 + seed / 1000 + config["train"]["lr"]})
        start = stop
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run


def test_a_run_extended_then_killed_is_incomplete(tmp_path: Path) -> None:
    """Trained to 6, resumed to 12, killed at 10: it was to end at 12, so it is incomplete, not complete with its
    step-6 loss. Extended and finished, its final loss is step 12's, in a row labelled with the extension (a
    schedule decayed to step 6 and then continued is not a fresh 12-step run)."""
    killed = load_run(resumed_run(tmp_path, "killed", 0, [(6, 6, {}), (12, 10, {})]))
    assert (killed.status, killed.last_step, killed.evals[-1]["step"]) == ("incomplete", 12, 10)
    done = [load_run(resumed_run(tmp_path, f"done{s}", s, [(6, 6, {}), (12, 12, {})])) for s in range(2)]
    assert done[0].status == "complete" and done[0].final_val_loss == pytest.approx(5.0 - 0.12 + 0.003)
    comparison = compare_runs([killed, *done])
    (row,) = comparison.rows
    assert row.variant == "swiglu+softmax (train.max_steps=6 -> 12@6)"
    assert [run.path.name for run in row.runs] == ["done0", "done1"] and row.incomplete == [killed]


def test_a_resume_with_another_lr_is_never_pooled_silently(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """Seed 1 trains 3 steps at lr 3e-3 and resumes at 3e-2: its row is labelled with the change, and the change is
    named in comparison.md and on the console; with --tune train.lr it has no one value and is left out."""
    dirs = [resumed_run(tmp_path / "runs", f"s{s}", s, [(6, 6, {})]) for s in range(3)]
    dirs.append(resumed_run(tmp_path / "runs", "changed", 1, [(6, 3, {}), (6, 6, {"lr": 3e-2})]))
    out = tmp_path / "out"
    assert main(["compare", *map(str, dirs), "--out", str(out), "--no-plots", "--baseline",
                 "swiglu+softmax (train.lr=0.003)"]) == 0
    warning = ("changed: its config changed on resume at step 3 (train.lr=0.003 -> 0.03@3): a row of its own, "
               "labelled with the change, never pooled with runs of one configuration")
    assert f"warning: {warning}\n" in capsys.readouterr().err
    table = (out / "comparison.md").read_text()
    assert f"- Warning: {warning}\n" in table
    assert "| swiglu+softmax (train.lr=0.003 -> 0.03@3) [" in table and "| swiglu+softmax (train.lr=0.003) [" in table
    tuned = compare_runs([load_run(d) for d in dirs], tune=["train.lr"])
    assert [run.path.name for row in tuned.rows for run in row.runs] == ["s0", "s1", "s2"]
    assert "changed: --tune at train.lr=0.003 -> 0.03@3, no one value; left out" in tuned.warnings


def test_a_resume_that_trained_nothing_is_no_segment(tmp_path: Path) -> None:
    """Started again at or past its end (a finished run relaunched, or asked for fewer steps than it ran), a run
    trains nothing: its meta row changes neither its end nor its config."""
    runs = [load_run(resumed_run(tmp_path, "again", 0, [(6, 6, {}), (6, 6, {"lr": 1e-3})])),
            load_run(resumed_run(tmp_path, "fewer", 1, [(6, 6, {}), (3, 6, {})]))]
    assert [(run.status, run.last_step, run.changed) for run in runs] == [("complete", 6, {})] * 2
    assert [row.variant for row in compare_runs(runs).rows] == ["swiglu+softmax"]
