"""What ``--planned`` reports: a planned seed that diverged is an outcome (the row "not decidable (Stein)", the
divergence counted), every refusal names its cause, a planned table and comparison.csv read as Stein's test, and
planning again over planned seeds trained by hand is named a second look."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from test_compare import write_run
from test_compare_plan import BASE, SPREAD
from test_compare_planned import _error, _pilot_and_plan, _planned, _train_planned

from llm.cli.eval import main


def _rows(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as f:
        return {row["variant"]: row for row in csv.DictReader(f)}


def _threshold(plan: Path) -> float:
    return float(_rows(plan)["isogmlp+softmax"]["threshold"])


def test_a_diverged_planned_seed_makes_its_row_not_decidable_and_is_counted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was refused forever as "7 of its 8 planned seeds complete (not seed 3)"."""
    runs, plan = _pilot_and_plan(tmp_path)
    _train_planned(runs, range(4, 8))
    write_run(runs, "swiglu+softmax", 3, 4.9)
    write_run(runs, "isogmlp+softmax", 3, math.nan)
    assert _planned(runs, plan, tmp_path / "final") == 0
    table = (tmp_path / "final" / "comparison.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| isogmlp+softmax |"))
    assert "| 1 / 0 |" in row and "| not decidable (Stein): seed 3 diverged (isogmlp_softmax_s3) | n/a |" in row
    assert ("isogmlp+softmax not decidable (Stein): seed 3 diverged (isogmlp_softmax_s3); the rest of its planned "
            "seeds would be chosen by their outcome, so no loss verdict: report how often it diverged") in table
    final = _rows(tmp_path / "final" / "comparison.csv")["isogmlp+softmax"]
    assert (final["diverged"], final["stein_verdict"], final["stein_ci_low"]) == (
        "1", "not decidable (Stein): seed 3 diverged (isogmlp_softmax_s3)", "")
    assert float(final["planned_threshold"]) == _threshold(plan)


def test_a_diverged_planned_seed_of_the_baseline_leaves_every_row_against_it_undecided(tmp_path: Path) -> None:
    runs, plan = _pilot_and_plan(tmp_path)
    _train_planned(runs, range(4, 8))
    write_run(runs, "swiglu+softmax", 3, math.inf)
    write_run(runs, "isogmlp+softmax", 3, 5.1)
    assert _planned(runs, plan, tmp_path / "final") == 0
    assert _rows(tmp_path / "final" / "comparison.csv")["isogmlp+softmax"]["stein_verdict"] == \
        "not decidable (Stein): its baseline's seed 3 diverged (swiglu_softmax_s3)"


@pytest.mark.parametrize(("run", "cause"), [
    # with another config, then diverged: it lost the "ran with another config" reason
    ({"final_loss": math.nan, "train__lr": 1e-2}, "seed 7 ran with another config (train.lr=0.01) and is diverged"),
    ({"final_loss": 5.1, "truncate": True}, "seed 7 is incomplete (isogmlp_softmax_s7: finish it)"),
    (None, "no run of seed 7 is among the compared runs"),
])
def test_a_missing_planned_seed_is_refused_naming_its_cause(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             run: dict[str, object] | None, cause: str) -> None:
    runs, plan = _pilot_and_plan(tmp_path)
    _train_planned(runs, range(3, 7))
    write_run(runs, "swiglu+softmax", 7, 4.9)
    if run is not None:
        truncate = run.pop("truncate", False)
        path = write_run(runs, "isogmlp+softmax", 7, **run)  # type: ignore[arg-type]
        if truncate:  # stopped before its last eval (the file's last line)
            lines = (path / "metrics.jsonl").read_text().splitlines()
            (path / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert _planned(runs, plan, tmp_path / "final") == 2
    assert f"isogmlp+softmax has 7 of its 8 planned seeds complete ({cause}), and Stein's final test needs them " \
           "all" in _error(capsys)


def test_a_pilot_seed_run_again_at_another_lr_is_a_changed_pilot(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """It read "its row is not among the compared rows" (both rows relabelled by their lr)."""
    runs, plan = _pilot_and_plan(tmp_path)
    _train_planned(runs)
    (runs / "isogmlp_softmax_s1" / "metrics.jsonl").unlink()
    (runs / "isogmlp_softmax_s1").rmdir()
    write_run(runs, "isogmlp+softmax", 1, SPREAD[1], train__lr=1e-2)
    assert _planned(runs, plan, tmp_path / "final") == 2
    assert _error(capsys).endswith(f"isogmlp+softmax's pilot changed (seed 1: planned at loss {SPREAD[1]!r}, now seed "
                                   "1 ran with another config (train.lr=0.01))")


def test_a_planned_table_and_csv_read_as_steins_test(tmp_path: Path) -> None:
    """The verdict under a header that points to the Stein note, its interval in a column of its own, no Welch
    interval, p-values or "Seeds needed" beside it; comparison.csv carries the threshold, verdict and interval (it
    was byte-identical to an unplanned one)."""
    runs, plan = _pilot_and_plan(tmp_path)
    for variant, loss in (("swiglu+softmax", 4.9), ("isogmlp+softmax", 5.3)):
        for seed in range(3, 8):
            write_run(runs, variant, seed, loss)
    assert _planned(runs, plan, tmp_path / "final") == 0
    table = (tmp_path / "final" / "comparison.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| Variant |"))
    assert "| At p < 0.05 ¹ ⁵ / Stein ⁷ | Stein interval ⁷ | MDE ⁶ |" in header
    threshold, gap = _threshold(plan), (sum(SPREAD) + 5 * 5.3 - sum(BASE) - 5 * 4.9) / 8
    assert abs(gap) > threshold
    row = next(line for line in table.splitlines() if line.startswith("| isogmlp+softmax |"))
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    start = header.split("|").index(" Gap (95% CI) ¹ ") - 1
    assert cells[start:start + 10] == [f"{gap:+.4f}", "", "", "", "resolved (Stein)",
                                       f"[{gap - threshold:+.4f}, {gap + threshold:+.4f}]", "", "", "", ""]
    assert "- ⁷ Stein: a planned row's verdict is the plan's final test" in table
    final = _rows(tmp_path / "final" / "comparison.csv")["isogmlp+softmax"]
    assert final["stein_verdict"] == "resolved (Stein)"
    assert float(final["planned_threshold"]) == threshold
    assert float(final["stein_ci_low"]) == pytest.approx(gap - threshold, abs=1e-12)
    assert float(final["stein_ci_high"]) == pytest.approx(gap + threshold, abs=1e-12)


def test_planning_again_over_planned_seeds_trained_by_hand_is_a_second_look(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The planned seeds trained from their own configs (no planned_by) and planned again elsewhere: no note."""
    runs, plan = _pilot_and_plan(tmp_path)
    _train_planned(runs)
    capsys.readouterr()
    assert main(["compare", str(runs / "*"), "--out", str(tmp_path / "again"), "--no-plots", "--plan", "0.05"]) == 0
    assert f"note: seeds of these runs were added by {plan.resolve()}; planning again from seeds a plan added is a " \
        "second look" in capsys.readouterr().out
