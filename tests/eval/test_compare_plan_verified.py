"""A plan verifies itself: ``--planned`` recomputes every derived column of plan.csv from the file's own gap and pilot
pairs by the code ``--plan`` wrote it with, and refuses in one line (naming the line, the column and what it should
be) a file that does not agree, a row planned twice, or a planned row missing while runs of it name the plan. Whatever
the file says, the verdict is on the planned seeds with the plan's threshold."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import pytest
from test_compare import run_config, write_run
from test_compare_plan import BASE, SPREAD
from test_compare_planned import _error, _pilot_and_plan, _planned, _train_planned

from llm.cli.eval import main

Rows = list[dict[str, str]]


def _edit(plan: Path, change: Callable[[Rows], Rows]) -> Rows:
    with plan.open() as f:
        rows = list(csv.DictReader(f))
    edited = change([dict(row) for row in rows])
    with plan.open("w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(edited)
    return rows


def _set(index: int, column: str, value: str) -> Callable[[Rows], Rows]:
    def change(rows: Rows) -> Rows:
        rows[index][column] = value
        return rows
    return change


@pytest.mark.parametrize(("change", "expected"), [
    # the threshold edited (it read "resolved (Stein)"): the pilot in the same file decides it
    (_set(1, "threshold", "0.005"), "line 3, column threshold: expected {threshold} (what --plan computes from this "
                                    "row's gap and pilot), got '0.005'"),
    # the seeds cut back to the pilot: the pilot alone was decided with the 8-seed threshold
    (_set(1, "seeds", "0 1 2"), "line 3, column seeds: expected the pilot's seeds, then the plan's 5 new ones, one "
                                "run of numbers above every pilot seed (0 1 2 3 4 5 6 7), got '0 1 2'"),
    # an unplanned seed added: a second look decided with the planned threshold
    (_set(1, "seeds", "0 1 2 3 4 5 6 7 8"), "line 3, column seeds: expected the pilot's seeds, then the plan's 5 new"),
    (_set(1, "seeds", "0 1 2 3 4 5 6 9"), "line 3, column seeds: expected the pilot's seeds, then the plan's 5 new"),
    # the gap edited: the conclusion claimed 80% power at it
    (_set(1, "gap", "0.001"), "line 3, column gap: expected 0.15, the plan's one gap (line 2), got '0.001'"),
    (lambda rows: [{**row, "gap": "0.001"} for row in rows], "line 2, column seeds_per_arm: expected "),
    # a column nothing read
    (_set(1, "pilot_seeds", "three"), "line 3, column pilot_seeds: expected 3 (what --plan computes from this row's "
                                      "gap and pilot), got 'three'"),
    (_set(1, "design", "Welch"), "line 3, column design: expected paired (what --plan computes"),
    (_set(0, "more_seeds", "4"), "line 2, column more_seeds: expected 5 (what --plan computes"),
    # a planned row duplicated: the last copy won
    (lambda rows: [*rows, {**rows[1], "threshold": "0.5"}], "line 4: row isogmlp+softmax is planned twice (lines 3 "
                                                            "and 4); a plan plans each row once"),
    (_set(1, "pilot", "0:4.8 0:4.99 2:4.85"), "line 3, column pilot: expected the pilot's seed:loss pairs, 2 or more, "
                                              "each seed once"),
])
def test_a_plan_csv_that_its_own_pilot_does_not_give_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Callable[[Rows], Rows], expected: str) -> None:
    runs, plan = _pilot_and_plan(tmp_path)
    _train_planned(runs)
    written = _edit(plan, change)
    capsys.readouterr()
    assert _planned(runs, plan, tmp_path / "final") == 2
    assert expected.format(threshold=written[1]["threshold"]) in _error(capsys)
    assert not (tmp_path / "final").exists()


def test_a_planned_row_missing_while_its_runs_name_the_plan_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its row fell back to the ordinary Welch test over every seed, unplanned ones included. (Two rows that need as
    many seeds: without either, the baseline's count is the same.)"""
    runs, plan = tmp_path / "runs", tmp_path / "plan" / "plan.csv"
    losses = {"swiglu+softmax": BASE, "isogmlp+softmax": SPREAD, "iso_ln+softmax": [loss + 0.01 for loss in SPREAD]}
    for variant, pilot in losses.items():
        for seed, loss in enumerate(pilot):
            write_run(runs, variant, seed, loss)
    assert main(["compare", str(runs / "*"), "--out", str(plan.parent), "--no-plots", "--plan", "0.15"]) == 0
    for variant in losses:
        for seed in range(3, 8):
            write_run(runs, variant, seed, 4.9, config={**run_config(variant, seed), "planned_by": str(plan.resolve())})
    _edit(plan, lambda rows: [row for row in rows if row["variant"] != "iso_ln+softmax"])
    assert _planned(runs, plan, tmp_path / "final") == 2
    assert _error(capsys).endswith("iso_ln_softmax_s3 was trained from it (planned_by), and its row is not in it; a "
                                   "plan.csv as compare --plan wrote it has that row")


def test_a_repeated_pilot_seed_is_no_independent_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Seed 0 run twice: the plan listed seeds "0 0 1 2" and asked for none more."""
    runs = tmp_path / "runs"
    for variant, losses in (("swiglu+softmax", [4.9, 4.95, 4.93]), ("isogmlp+softmax", [4.8, 4.99, 4.85])):
        for seed, loss in enumerate(losses):
            write_run(runs, variant, seed, loss)
    write_run(runs, "isogmlp+softmax", 0, 4.81, dirname="isogmlp_softmax_s0_again")
    assert main(["compare", str(runs / "*"), "--out", str(tmp_path / "plan"), "--no-plots", "--plan", "0.15"]) == 2
    assert _error(capsys) == ("error: --plan: row isogmlp+softmax ran seed 0 more than once; a repeat is no "
                              "independent seed: compare without all but one")
    assert not (tmp_path / "plan").exists()
