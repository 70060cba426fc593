"""``eval.py compare --plan GAP`` (llm.eval.plan): the plan's counts
and thresholds against Stein's rule from scipy, and its sweep file as the launcher reads and runs it."""

from __future__ import annotations

import csv
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from test_compare import write_run
from tiny import REPO

from llm.cli.eval import main
from llm.cli.sweep import main as sweep_main
from llm.cli.sweep_spec import load_sweep
from llm.config import load_config
from llm.eval.compare import compare_runs
from llm.eval.errors import EvalError
from llm.eval.plan import plan_seeds
from llm.eval.runs import load_run
from llm.eval.stats import MAX_SEEDS

BASE = [4.900, 4.950, 4.930]
PAIRED = [4.920, 4.960, 4.960]  # differences 0.02, 0.01, 0.03: SD 0.01
SPREAD = [4.800, 4.990, 4.850]  # differences -0.10, 0.04, -0.08: SD 0.0757
UNPAIRED = [4.86, 4.89, 4.95, 4.99]  # a fourth seed: Welch's design


def _stein(gap: float, variance: float, df: float) -> int:
    return math.ceil(((stats.t.ppf(0.975, df) + stats.t.ppf(0.8, df)) / gap) ** 2 * variance)


def _plan(tmp_path: Path, losses: dict[str, list[float]], gap: float) -> tuple[dict[str, dict[str, str]], Path]:
    for variant, values in losses.items():
        for seed, loss in enumerate(values):
            write_run(tmp_path / "runs", variant, seed, loss)
    out = tmp_path / "out"
    assert main(["compare", str(tmp_path / "runs" / "*"), "--out", str(out), "--no-plots", "--plan", str(gap)]) == 0
    with (out / "plan.csv").open() as f:
        return {row["variant"]: row for row in csv.DictReader(f)}, out


def test_plan_takes_the_paired_design_where_rows_pair_with_steins_counts(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    rows, _ = _plan(tmp_path, {"swiglu+softmax": BASE, "isogmlp+softmax": PAIRED, "iso_ln+softmax": SPREAD}, 0.05)
    printed = capsys.readouterr().out
    d_paired, d_spread = np.subtract(PAIRED, BASE), np.subtract(SPREAD, BASE)
    assert _stein(0.05, np.var(d_paired, ddof=1), 2) <= 3  # resolved by the pilot: no seed more for it
    needed = _stein(0.05, np.var(d_spread, ddof=1), 2)
    assert needed == 66 < _stein(0.05, np.var(SPREAD, ddof=1) + np.var(BASE, ddof=1), 2.35)  # paired is cheaper
    assert [rows[v]["design"] for v in ("swiglu+softmax", "isogmlp+softmax", "iso_ln+softmax")] == \
        ["baseline", "paired", "paired"]
    for row in rows.values():  # a paired row runs all its baseline's seeds: compare pairs only the same seeds
        assert (row["pilot_seeds"], float(row["seeds_per_arm"]), row["more_seeds"]) == ("3", needed, str(needed - 3))
    for variant, diffs in (("isogmlp+softmax", d_paired), ("iso_ln+softmax", d_spread)):
        assert float(rows[variant]["threshold"]) == pytest.approx(
            stats.t.ppf(0.975, 2) * np.std(diffs, ddof=1) / math.sqrt(needed), rel=1e-12)
    assert "assumes normal seed effects" in printed and f"{needed} per arm ({needed - 3} more)" in printed


def test_a_row_that_does_not_pair_is_planned_by_welch(tmp_path: Path) -> None:
    rows, _ = _plan(tmp_path, {"swiglu+softmax": BASE, "isogmlp+softmax": UNPAIRED}, 0.1)
    variances = (np.var(UNPAIRED, ddof=1), np.var(BASE, ddof=1))
    needed = _stein(0.1, sum(variances), 2)  # min(pilot) - 1 degrees of freedom
    assert (rows["isogmlp+softmax"]["design"], float(rows["isogmlp+softmax"]["seeds_per_arm"])) == ("Welch", needed)
    assert float(rows["swiglu+softmax"]["seeds_per_arm"]) == needed  # the baseline is the other arm
    parts = (variances[0] / needed, variances[1] / needed)
    assert float(rows["isogmlp+softmax"]["threshold"]) == pytest.approx(
        stats.t.ppf(0.975, 2) * math.sqrt(sum(parts)), rel=1e-12)


def test_the_sweep_adds_exactly_the_missing_seeds_and_then_the_rows_pair(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    rows, out = _plan(tmp_path, {"swiglu+softmax": BASE, "isogmlp+softmax": PAIRED, "iso_ln+softmax": SPREAD}, 0.15)
    needed = _stein(0.15, np.var(np.subtract(SPREAD, BASE), ddof=1), 2)
    assert needed == 8 and rows["swiglu+softmax"]["more_seeds"] == "5"
    sweep = load_sweep(out / "plan-sweep.yaml", root=REPO)  # resolves and checks every run's config
    expected = {f"{stem}_s{seed}" for stem in ("swiglu_softmax", "isogmlp_softmax", "iso_ln_softmax")
                for seed in range(3, needed)}
    assert {run.name for run in sweep.runs} == expected and len(sweep.runs) == 3 * 5
    for run in sweep.runs:
        config = load_config([run.configs[0] if Path(run.configs[0]).is_absolute() else REPO / run.configs[0]])
        pilot = load_run(tmp_path / "runs" / f"{run.name.rsplit('_s', 1)[0]}_s0").config
        assert (config.seed, config.name, config.out_dir) == (int(run.name.rsplit("_s", 1)[1]), run.name,
                                                               str((tmp_path / "runs").resolve()))
        assert [asdict(config.model), asdict(config.data), asdict(config.train)] == \
            [asdict(pilot.model), asdict(pilot.data), asdict(pilot.train)]  # every row's config unchanged
    capsys.readouterr()
    assert sweep_main([str(out / "plan-sweep.yaml"), "--mode", "local", "--dry-run"], root=REPO) == 0
    assert capsys.readouterr().out.count("python train.py --config ") == 3 * 5
    assert sweep_main([str(out / "plan-sweep.yaml"), "--mode", "slurm", "--dry-run", "--script-dir",
                       str(tmp_path / "sbatch")], root=REPO) == 0
    assert "--array=0-14" in (tmp_path / "sbatch" / "plan-0.15.sbatch").read_text()
    for run in sweep.runs:  # the planned runs, as if trained: the final compare pairs every row with the baseline
        variant = {"swiglu": "swiglu+softmax", "isogmlp": "isogmlp+softmax", "iso": "iso_ln+softmax"}
        write_run(tmp_path / "runs", variant[run.name.split("_")[0]], int(run.name.rsplit("_s", 1)[1]), 4.9,
                  dirname=run.name)
    assert main(["compare", str(tmp_path / "runs" / "*"), "--out", str(tmp_path / "final"), "--no-plots"]) == 0
    with (tmp_path / "final" / "comparison.csv").open() as f:
        final = {row["variant"]: row for row in csv.DictReader(f)}
    assert final["iso_ln+softmax"]["n_seeds"] == "8" and final["iso_ln+softmax"]["p_value_paired"] != ""


def test_a_resolved_pilot_needs_no_sweep_and_a_hopeless_gap_says_so(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rows, out = _plan(tmp_path / "a", {"swiglu+softmax": BASE, "isogmlp+softmax": PAIRED}, 0.05)
    assert rows["isogmlp+softmax"]["more_seeds"] == rows["swiglu+softmax"]["more_seeds"] == "0"
    assert not (out / "plan-sweep.yaml").exists()
    rows, out = _plan(tmp_path / "b", {"swiglu+softmax": BASE, "isogmlp+softmax": SPREAD}, 1e-5)
    assert (rows["isogmlp+softmax"]["seeds_per_arm"], rows["isogmlp+softmax"]["more_seeds"]) == ("inf", "0")
    assert not (out / "plan-sweep.yaml").exists()
    assert f"over {MAX_SEEDS} per arm: not launched" in capsys.readouterr().out


@pytest.mark.parametrize("gap", ["0", "-0.1", "nan", "inf"])
def test_a_bad_gap_fails_in_one_line_before_writing(tmp_path: Path, gap: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "runs", "swiglu+softmax", 0, 4.9)
    with pytest.raises(SystemExit) as refused:
        main(["compare", str(tmp_path / "runs" / "*"), "--out", str(tmp_path / "out"), "--plan", gap])
    assert refused.value.code == 2
    assert f"argument --plan: expected a finite gap > 0 nats, got {gap}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    comparison = compare_runs([load_run(run) for run in (tmp_path / "runs").iterdir()])
    with pytest.raises(EvalError, match=f"--plan {float(gap)}: expected a finite gap > 0 nats"):
        plan_seeds(comparison, float(gap))  # the library refuses it too


def test_rows_without_spread_are_not_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Seeds that all give one loss (in a row and its baseline) leave no spread to plan from: the row is left out of
    the plan, as the table leaves it untested (it raised ZeroDivisionError)."""
    rows, _ = _plan(tmp_path, {"swiglu+softmax": [4.9] * 3, "isogmlp+softmax": [5.0] * 3,
                                 "iso_ln+softmax": SPREAD}, 0.05)
    assert set(rows) == {"swiglu+softmax", "iso_ln+softmax"}


def test_a_planned_run_directory_that_exists_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for variant, values in {"swiglu+softmax": BASE, "isogmlp+softmax": SPREAD}.items():
        for seed, loss in enumerate(values):
            write_run(tmp_path / "runs", variant, seed, loss)
    (tmp_path / "runs" / "swiglu_softmax_s3").mkdir()  # not among the runs compared: seed 3 looks free
    out = tmp_path / "out"
    assert main(["compare", str(tmp_path / "runs" / "*_s[0-2]"), "--out", str(out), "--no-plots",
                 "--plan", "0.05"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'runs' / 'swiglu_softmax_s3'}: a run directory the plan would train into exists already")
    assert not (out / "plan.csv").exists() and not (out / "plan-configs").exists()
    assert not (out / "comparison.md").exists()  # refused before anything is written


def test_planned_rows_are_decided_by_steins_final_test(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``compare --planned plan.csv``: refused until every planned seed is complete; then a planned row's verdict is
    its gap over all seeds beyond the plan's threshold, with the interval gap +- threshold, not the t-tests'."""
    rows, out = _plan(tmp_path, {"swiglu+softmax": BASE, "isogmlp+softmax": PAIRED, "iso_ln+softmax": SPREAD}, 0.15)
    planned = ["compare", str(tmp_path / "runs" / "*"), "--out", str(tmp_path / "final"), "--no-plots", "--planned",
               str(out / "plan.csv")]
    capsys.readouterr()
    assert main(planned) == 2
    assert "swiglu+softmax has 3 of its 8 planned seeds complete" in capsys.readouterr().err
    final = {"swiglu+softmax": 4.9, "isogmlp+softmax": 5.1, "iso_ln+softmax": 4.9}
    for variant, loss in final.items():
        for seed in range(3, 8):
            write_run(tmp_path / "runs", variant, seed, loss)
    assert main(planned) == 0
    table = (tmp_path / "final" / "comparison.md").read_text()
    gaps = {v: (sum(losses) + 5 * final[v] - sum(BASE) - 5 * 4.9) / 8 for v, losses in (("isogmlp+softmax", PAIRED),
                                                                                          ("iso_ln+softmax", SPREAD))}
    threshold = float(rows["isogmlp+softmax"]["threshold"])
    assert abs(gaps["iso_ln+softmax"]) < float(rows["iso_ln+softmax"]["threshold"]) < 0.15
    assert f"isogmlp+softmax {gaps['isogmlp+softmax']:+.4f} resolved (Stein) " \
           f"[{gaps['isogmlp+softmax'] - threshold:+.4f}, {gaps['isogmlp+softmax'] + threshold:+.4f}]" in table
    assert "| resolved (Stein) |" in table and "| not resolved (Stein) |" in table
    assert "- ⁷ Stein: a planned row's verdict is the plan's final test" in table
