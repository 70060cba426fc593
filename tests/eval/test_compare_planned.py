"""``eval.py compare --planned plan.csv`` holds a finished plan to what it was made for: exactly its planned seeds,
its pilot, its baseline; a damaged plan.csv, ``--plan`` with ``--planned``, and the plan's sweep layout each refused
or handled as a researcher trusting the numbers would expect."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml
from test_compare import run_config, write_run
from test_compare_plan import BASE, SPREAD

from llm.cli.eval import main
from llm.config import load_config


def _pilot_and_plan(tmp_path: Path, gap: str = "0.15") -> tuple[Path, Path]:
    """A pilot of 3 seeds each and its plan (8 seeds per arm, paired), every planned seed trained at 4.9 / 5.1."""
    runs = tmp_path / "runs"
    for variant, losses in (("swiglu+softmax", BASE), ("isogmlp+softmax", SPREAD)):
        for seed, loss in enumerate(losses):
            write_run(runs, variant, seed, loss)
    assert main(["compare", str(runs / "*"), "--out", str(tmp_path / "plan"), "--no-plots", "--plan", gap]) == 0
    return runs, tmp_path / "plan" / "plan.csv"


def _train_planned(runs: Path, seeds: range = range(3, 8)) -> None:
    for variant, loss in (("swiglu+softmax", 4.9), ("isogmlp+softmax", 5.1)):
        for seed in seeds:
            write_run(runs, variant, seed, loss)


def _planned(runs: Path, plan: Path, out: Path, *extra: str) -> int:
    return main(["compare", str(runs / "*"), "--out", str(out), "--no-plots", "--planned", str(plan), *extra])


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in "".join(lines)
    return lines[-1]


def test_plan_csv_records_the_baseline_the_planned_seeds_and_the_pilot(tmp_path: Path) -> None:
    _, plan = _pilot_and_plan(tmp_path)
    with plan.open() as f:
        rows = {row["variant"]: row for row in csv.DictReader(f)}
    for variant, losses in (("swiglu+softmax", BASE), ("isogmlp+softmax", SPREAD)):
        assert rows[variant]["baseline"] == "swiglu+softmax"
        assert rows[variant]["seeds"] == "0 1 2 3 4 5 6 7"
        assert {int(s): float(v) for s, v in (p.split(":") for p in rows[variant]["pilot"].split())} == \
            dict(enumerate(losses))


def test_a_seed_beyond_the_plan_is_left_out_of_the_planned_test_by_name(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """"Add a seed and look again": a 9th seed (of the baseline only, which would unpair the rows) is named and left
    out; the verdict is Stein's on exactly the 8 planned seeds, still paired."""
    runs, plan = _pilot_and_plan(tmp_path)
    _train_planned(runs)
    write_run(runs, "swiglu+softmax", 8, 3.0)  # would pull the baseline's mean down by 0.2
    capsys.readouterr()
    assert _planned(runs, plan, tmp_path / "final") == 0
    assert "swiglu_softmax_s8: seed 8 is no planned seed of its row; left out of the planned test" in \
        capsys.readouterr().err
    with (tmp_path / "final" / "comparison.csv").open() as f:
        final = {row["variant"]: row for row in csv.DictReader(f)}
    assert final["swiglu+softmax"]["n_seeds"] == "8" and final["isogmlp+softmax"]["p_value_paired"] != ""
    expected = (sum(SPREAD) + 5 * 5.1 - sum(BASE) - 5 * 4.9) / 8
    assert float(final["isogmlp+softmax"]["gap"]) == pytest.approx(expected, abs=1e-12)


def test_a_changed_pilot_a_missing_seed_and_a_seed_of_another_config_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs, plan = _pilot_and_plan(tmp_path)
    _train_planned(runs, range(3, 7))
    write_run(runs, "swiglu+softmax", 7, 4.9)
    write_run(runs, "isogmlp+softmax", 7, 5.1, train__lr=1e-2)  # at another lr: a row of its own
    assert _planned(runs, plan, tmp_path / "final") == 2
    error = _error(capsys)
    assert "isogmlp+softmax has 7 of its 8 planned seeds complete (seed 7 ran with another config (train.lr=0.01))" \
        in error
    runs2, plan2 = _pilot_and_plan(tmp_path / "b")
    _train_planned(runs2)
    write_run(runs2, "isogmlp+softmax", 1, 4.0, dirname="isogmlp_softmax_s1b")  # a pilot seed run again: changed
    (runs2 / "isogmlp_softmax_s1" / "metrics.jsonl").unlink()
    (runs2 / "isogmlp_softmax_s1").rmdir()
    assert _planned(runs2, plan2, tmp_path / "b" / "final") == 2
    assert "isogmlp+softmax's pilot changed (seed 1: planned at loss 4.99, now 4.0)" in _error(capsys)


def test_another_baseline_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs, plan = _pilot_and_plan(tmp_path)
    _train_planned(runs)
    assert _planned(runs, plan, tmp_path / "final", "--baseline", "isogmlp+softmax") == 2
    assert "was planned against swiglu+softmax, and is compared against isogmlp+softmax" in _error(capsys)


def test_a_row_whose_seeds_now_mean_other_things_than_its_baselines_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The variant's runs, its pilot's included (same losses), trained again on another data order (data.seed 1): its
    row is no longer compared with the baseline (``incomparable``), so the plan made against it cannot decide it;
    the line names why, not only that the baseline is gone."""
    runs, plan = _pilot_and_plan(tmp_path)
    for seed in range(3):
        (runs / f"isogmlp_softmax_s{seed}" / "metrics.jsonl").unlink()
        (runs / f"isogmlp_softmax_s{seed}").rmdir()
        write_run(runs, "isogmlp+softmax", seed, SPREAD[seed], data__seed=1)
    for seed in range(3, 8):
        write_run(runs, "swiglu+softmax", seed, 4.9)
        write_run(runs, "isogmlp+softmax", seed, 5.1, data__seed=1)
    assert _planned(runs, plan, tmp_path / "final") == 2
    assert _error(capsys) == (f"error: --planned {plan}: isogmlp+softmax was planned against swiglu+softmax, and its "
                              f"seeds now mean other things than its baseline's (data.seed 1, its baseline's 0)")


def test_plan_with_planned_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs, plan = _pilot_and_plan(tmp_path)
    with pytest.raises(SystemExit) as refused:
        _planned(runs, plan, tmp_path / "final", "--plan", "0.1")
    assert refused.value.code == 2
    assert "argument --plan: not allowed with argument --planned" in capsys.readouterr().err


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda text: "", "no planned rows"),
    (lambda text: "hello world\n", "no planned rows"),
    (lambda text: text.replace(",threshold,", ",thresh,"), "line 2, column threshold: expected empty (what --plan"),
    (lambda text: text.replace(",baseline,", ",base,", 1), "column baseline: expected the baseline's row label"),
    (lambda text: text.replace(",paired,", ",maybe,"), "column design: expected paired (what --plan computes"),
    (lambda text: text.replace(",8,5,", ",eight,5,"), "column seeds_per_arm: expected 8 (what --plan computes"),
])
def test_a_damaged_plan_csv_is_one_line_naming_file_and_column(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               damage: object, expected: str) -> None:
    runs, plan = _pilot_and_plan(tmp_path)
    _train_planned(runs)
    plan.write_text(damage(plan.read_text()))  # type: ignore[operator]
    assert _planned(runs, plan, tmp_path / "final") == 2
    error = _error(capsys)
    assert str(plan) in error and expected in error


@pytest.mark.parametrize("threshold", ["-0.5", "nan", "inf", "0"])
def test_a_threshold_that_is_no_threshold_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     threshold: str) -> None:
    runs, plan = _pilot_and_plan(tmp_path)
    _train_planned(runs)
    with plan.open() as f:
        rows = list(csv.reader(f))
    planned, rows[2][rows[0].index("threshold")] = rows[2][rows[0].index("threshold")], threshold
    with plan.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    assert _planned(runs, plan, tmp_path / "final") == 2
    assert f"line 3, column threshold: expected {planned} (what --plan computes from this row's gap and pilot), " \
        f"got '{threshold}'" in _error(capsys)


def test_rows_laid_out_by_directory_get_every_planned_run_with_absolute_data(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """runs/sw/s0 and runs/iso/s0: both rows' new runs are s3...; each gets its own name, so none is dropped; a
    relative data.source is made absolute, so a sweep started elsewhere trains on the pilot's data."""
    monkeypatch.chdir(tmp_path)
    Path("data.txt").write_text("text")
    for folder, variant, losses in (("sw", "swiglu+softmax", BASE), ("iso", "isogmlp+softmax", SPREAD)):
        for seed, loss in enumerate(losses):
            write_run(tmp_path / "runs" / folder, variant, seed, loss, dirname=f"s{seed}", data__source="data.txt")
    assert main(["compare", "runs/*/*", "--out", "plan", "--no-plots", "--plan", "0.15"]) == 0
    assert "the 10 missing seeds" in capsys.readouterr().out
    files = yaml.safe_load(Path("plan/plan-sweep.yaml").read_text())["files"]["run"]
    assert sorted(files) == sorted(f"{folder}-s{seed}" for folder in ("sw", "iso") for seed in range(3, 8))
    config = load_config([files["iso-s3"]])
    assert (config.data.source, config.out_dir) == (str(tmp_path / "data.txt"), str(tmp_path / "runs" / "iso"))


def test_rows_left_out_of_the_plan_are_named_and_a_huge_gap_plans_no_seed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    for variant, losses in (("swiglu+softmax", BASE), ("isogmlp+softmax", SPREAD), ("iso_ln+softmax", [4.9])):
        for seed, loss in enumerate(losses):
            write_run(runs, variant, seed, loss)
    assert main(["compare", str(runs / "*"), "--out", str(tmp_path / "plan"), "--no-plots", "--plan", "1e308"]) == 0
    printed = capsys.readouterr().out
    assert "iso_ln+softmax: not planned (fewer than 2 seeds" in printed
    assert "isogmlp+softmax: paired, 3 pilot seeds -> 3 per arm (0 more)" in printed
    assert main(["compare", str(runs / "*"), "--out", str(tmp_path / "plan"), "--no-plots", "--plan", "0.1"]) == 0
    assert "existed and is replaced; planning again from seeds a plan added is a second look" in \
        capsys.readouterr().out


def test_a_planned_row_has_one_verdict_steins_with_its_interval_resolved_or_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not resolved: Stein's interval and what the plan established, never the post-hoc MDE's seed advice."""
    runs, plan = _pilot_and_plan(tmp_path)
    for variant in ("swiglu+softmax", "isogmlp+softmax"):
        for seed in range(3, 8):
            write_run(runs, variant, seed, 4.9)
    with plan.open() as f:
        threshold = float(next(row for row in csv.DictReader(f) if row["variant"] == "isogmlp+softmax")["threshold"])
    assert _planned(runs, plan, tmp_path / "final") == 0
    table = (tmp_path / "final" / "comparison.md").read_text()
    gap = (sum(SPREAD) - sum(BASE)) / 8
    assert abs(gap) < threshold and "| not resolved (Stein) |" in table
    assert (f"isogmlp+softmax {gap:+.4f} not resolved (Stein) [{gap - threshold:+.4f}, {gap + threshold:+.4f}], "
            "although a true gap of 0.15 or more would have been resolved with 80% power") in table
    assert "would need" not in table and "this comparison resolves gaps above" not in table


def test_planning_from_seeds_a_plan_added_names_the_second_look_whatever_the_out_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each planned config records its plan.csv (``planned_by``), so a new plan over runs trained from it says it is a
    second look even when written to another --out (where no plan.csv existed)."""
    runs, plan = _pilot_and_plan(tmp_path)
    files = yaml.safe_load((plan.parent / "plan-sweep.yaml").read_text())["files"]["run"]
    planned = load_config([next(iter(files.values()))])
    assert planned.planned_by == str(plan.resolve())
    for variant, loss in (("swiglu+softmax", 4.9), ("isogmlp+softmax", 5.1)):
        write_run(runs, variant, planned.seed, loss,
                  config={**run_config(variant, planned.seed), "planned_by": planned.planned_by})
    capsys.readouterr()
    assert main(["compare", str(runs / "*"), "--out", str(tmp_path / "other"), "--no-plots", "--plan", "0.15"]) == 0
    assert f"note: seeds of these runs were added by {plan.resolve()}; planning again from seeds a plan added is a " \
        "second look" in capsys.readouterr().out
