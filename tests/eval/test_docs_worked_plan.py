"""The worked seed-planning example of docs/comparison.md (and its summary in the README) quotes what the code
computes: ``eval.py compare --plan 0.02`` run here on run directories rebuilt from the stored per-seed losses of
docs/results/replicate-cpu, and ``llm.eval.plan.design`` for the counts the text gives beside it (Welch's design at
the shipped min(pilot) - 1 degrees of freedom, and a plan of every row of that comparison)."""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import pytest
from test_compare import write_run
from tiny import REPO

from llm.cli.eval import main
from llm.eval.plan import design

sys.path.insert(0, str(REPO / "docs" / "results"))
from restat import per_seed_losses

GAP, BASELINE, ROW = 0.02, "swiglu+softmax", "iso_ln[pathway=false]+softmax"
LOSSES = dict(per_seed_losses([str(REPO / "docs" / "results" / "replicate-cpu" / "stats.md")]))
RUN_NAMES = {BASELINE: "rerun-swiglu", ROW: "rerun-iso_ln-no-pathway"}


def _text(path: Path) -> str:
    """The page with its lines joined, so a figure wrapped over two lines is still one phrase."""
    return re.sub(r"\s*\n\s*", " ", path.read_text())


def _counts(variant: str) -> tuple[int, int]:
    """The seeds per arm a row of the stored comparison needs for GAP from its 3 pilot seeds: Welch's design, paired."""
    row, base = LOSSES[variant], LOSSES[BASELINE]
    variances = (statistics.variance(row), statistics.variance(base))
    differences = statistics.variance([a - b for a, b in zip(row, base, strict=True)])
    return int(design(GAP, (3, 3), variances)[1]), int(design(GAP, (3, 3), variances, differences)[1])


def test_the_worked_plan_is_compares_own_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [write_run(tmp_path / "runs", variant, seed, loss, dirname=f"{RUN_NAMES[variant]}-s{seed}",
                      **({"model__iso_ln_pathway": False} if variant == ROW else {}))
            for variant in (BASELINE, ROW) for seed, loss in enumerate(LOSSES[variant])]
    assert main(["compare", *map(str, runs), "--plan", str(GAP), "--out", str(tmp_path / "plan"), "--no-plots"]) == 0
    plan = capsys.readouterr().out.split("plan for a ")[1]
    lines = [line for line in plan.splitlines() if line.startswith("  ")]
    assert len(lines) == 2  # the baseline's line and the row's
    page, readme = (REPO / "docs" / "comparison.md").read_text(), _text(REPO / "README.md")
    assert all(f"\n{line}\n" in page for line in lines), lines
    paired = re.search(r"paired, 3 pilot seeds -> (\d+) per arm \((\d+) more\), resolved if \|final gap\| > (\S+)",
                       lines[1])
    seeds, more, threshold = paired.groups()
    assert f"beyond ±{threshold} it reads" in _text(REPO / "docs" / "comparison.md")
    assert f"needs {seeds} seeds per arm paired ({more} more each) and is resolved if the final gap is beyond " \
           f"{threshold}" in readme
    differences = [a - b for a, b in zip(LOSSES[ROW], LOSSES[BASELINE], strict=True)]
    spread = f"{statistics.stdev(differences):.4f}"
    assert f"a spread of {spread} " in page and f"spread {spread} nats" in readme
    assert "Their final losses differ by " + ", ".join(f"{d:.4f}" for d in differences[:2]) + \
           f" and {differences[2]:.4f}" in _text(REPO / "docs" / "comparison.md")


def test_the_worked_plans_welch_and_joint_counts_are_the_shipped_rules() -> None:
    welch, paired = _counts(ROW)
    assert paired == 4  # the plan's own count, checked against compare's output above
    every_row = {variant: _counts(variant) for variant in LOSSES if variant != BASELINE}
    assert len(every_row) == 7
    most_welch, most_paired = (max(every_row, key=lambda v, i=i: every_row[v][i]) for i in (0, 1))
    assert most_welch == most_paired == "isogmlp+softmax"
    page, readme = _text(REPO / "docs" / "comparison.md"), _text(REPO / "README.md")
    assert f"By Welch's design the same question would take {welch} seeds per arm from this pilot." in page
    assert f"by Welch's test it would take {welch} per arm" in readme
    assert f"the baseline would run {every_row[most_paired][1]} seeds (isogmlp's paired count)" in page
    assert f"by Welch's design, {every_row[most_welch][0]} (isogmlp's Welch count)" in page
