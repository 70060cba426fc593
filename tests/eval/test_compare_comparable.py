"""Comparability is one predicate over two rows (``llm.eval.grouping.incomparable``): every field that changes what a
seed means, the seed scope included, equal. A row of the other seed scope is listed with the reason, never given a
gap, a p-value or a plan; with the baseline in both scopes, each scope's rows are compared with their own."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from test_compare import write_run

from llm.cli.eval import main
from llm.eval.compare import compare_runs
from llm.eval.runs import load_run

BASE = [4.900, 4.950, 4.930]
ROW = [4.920, 4.960, 4.950]
SCOPE = "seed scope run, its baseline's init; data.seed run, its baseline's 0"


def _runs(root: Path, rows: dict[tuple[str, object], list[float]]) -> Path:
    for (variant, data_seed), losses in rows.items():
        for seed, loss in enumerate(losses):
            write_run(root, variant, seed, loss, data__seed=data_seed, dirname=f"{variant}-{data_seed}-s{seed}")
    return root


def test_a_row_of_the_other_seed_scope_is_listed_with_the_reason_and_neither_tested_nor_planned(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run-scope seeds against a baseline whose seeds all read data order 0: the order's effect is in every baseline
    seed and in none of the row's (and at seed 0 the two arms are one run's data). It was given a gap, a paired
    p-value and a plan."""
    runs = _runs(tmp_path / "runs", {("swiglu+softmax", 0): BASE, ("isogmlp+softmax", "run"): ROW})
    assert main(["compare", str(runs / "*"), "--out", str(tmp_path / "out"), "--no-plots", "--plan", "0.05"]) == 0
    printed = capsys.readouterr()
    assert f"isogmlp+softmax: not planned (not compared: {SCOPE})" in printed.out
    assert (f"row isogmlp+softmax: not compared with swiglu+softmax: their seeds mean different things ({SCOPE}); no "
            "gap, p-value or plan") in printed.err
    with (tmp_path / "out" / "plan.csv").open() as f:
        assert [row["variant"] for row in csv.DictReader(f)] == ["swiglu+softmax"]
    with (tmp_path / "out" / "comparison.csv").open() as f:
        row = next(row for row in csv.DictReader(f) if row["variant"] == "isogmlp+softmax")
    assert (row["gap"], row["p_value"], row["p_value_paired"], row["not_compared"]) == ("", "", "", SCOPE)
    assert f"| not compared: {SCOPE} |" in (tmp_path / "out" / "comparison.md").read_text()


def test_with_the_baseline_in_both_scopes_each_row_is_compared_with_its_own(tmp_path: Path) -> None:
    """The default baseline names a row in each scope (it was refused as naming two rows): each row's gap is to the
    baseline of its scope, paired there."""
    runs = _runs(tmp_path, {("swiglu+softmax", 0): BASE, ("swiglu+softmax", "run"): [b + 0.1 for b in BASE],
                            ("isogmlp+softmax", 0): ROW, ("isogmlp+softmax", "run"): [r + 0.3 for r in ROW]})
    comparison = compare_runs([load_run(run) for run in sorted(runs.iterdir())])
    gaps = {row.variant: (row.baseline, row.gap.gap, row.gap.p_paired > 0) for row in comparison.rows if row.gap}
    assert gaps == {"isogmlp+softmax (data.seed=0)": ("swiglu+softmax (data.seed=0)", pytest.approx(0.05 / 3), True),
                    "isogmlp+softmax (data.seed=run)": ("swiglu+softmax (data.seed=run)", pytest.approx(0.2 + 0.05 / 3),
                                                        True)}
    assert comparison.baseline == "swiglu+softmax"


def test_the_predicate_covers_every_field_but_the_treatments_and_a_declared_few(tmp_path: Path) -> None:
    """Derived from the whole config: any compared field outside the model and train sections (a new one too) sets
    what a seed means; the exempt ones are declared with why. World size deals the data out."""
    from llm.eval.grouping import SEED_MEANING_EXEMPT, incomparable, seed_meaning  # new API: imported here

    base = load_run(write_run(tmp_path, "swiglu+softmax", 0, 4.9))
    assert set(SEED_MEANING_EXEMPT) == {"data.document_masking", "data.tokenize_batch"}
    assert {key for key in seed_meaning(base) if key.startswith(("model.", "train."))} == set()
    for i, (change, differs) in enumerate(((dict(data__val_bucket=7), True), (dict(data__seq_len=64), True),
                            (dict(data__document_masking=False), False), (dict(train__lr=0.1), False),
                            (dict(model__intermediate_size=96), False))):
        other = load_run(write_run(tmp_path, "isogmlp+softmax", 0, 4.9, dirname=f"change{i}", **change))
        assert bool(incomparable([other], [base])) == differs, change
    world = load_run(write_run(tmp_path, "isogmlp+softmax", 1, 4.9, dirname="world"))
    world.meta["world_size"] = 2
    assert incomparable([world], [base]) == "world size 2, its baseline's None"
