"""What a comparison can resolve: each gap's interval, the minimum detectable effect (MDE), the seeds a gap needs and
the paired test, on synthetic runs whose answers are known from scipy, a simulation and published power tables."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from test_compare import write_run

from llm.cli.eval import main
from llm.eval.compare import compare_runs
from llm.eval.report import format_table
from llm.eval.runs import load_run
from llm.eval.stats import (
    Summary,
    gap_to_baseline,
    minimum_detectable_effect,
    paired_p_value,
    seeds_needed,
    welch_power,
)

BASE = [4.90, 4.92, 4.94]  # std 0.02
ROW = [4.91, 4.93, 4.95]  # std 0.02; a gap of +0.01 = 0.5 std
UNEQUAL = [4.86, 4.89, 4.95, 4.99]  # a fourth seed, another spread


def _runs(root: Path, losses: dict[str, list[float]], **changes: object) -> Path:
    for variant, values in losses.items():
        for seed, loss in enumerate(values):
            write_run(root, variant, seed, loss, **changes)
    return root


def _csv(out: Path) -> dict[str, dict[str, str]]:
    with (out / "comparison.csv").open() as f:
        return {row["variant"]: row for row in csv.DictReader(f)}


def test_interval_and_p_are_scipys_welch_test(tmp_path: Path) -> None:
    root = _runs(tmp_path / "runs", {"swiglu+softmax": BASE, "isogmlp+softmax": UNEQUAL})
    out = tmp_path / "out"
    assert main(["compare", str(root / "*"), "--out", str(out), "--no-plots"]) == 0
    row, base = _csv(out)["isogmlp+softmax"], _csv(out)["swiglu+softmax"]
    welch = stats.ttest_ind(UNEQUAL, BASE, equal_var=False)
    interval = welch.confidence_interval(0.95)
    assert float(row["gap"]) == pytest.approx(np.mean(UNEQUAL) - np.mean(BASE), abs=1e-12)
    assert float(row["gap_ci_low"]) == pytest.approx(interval.low, rel=1e-9)
    assert float(row["gap_ci_high"]) == pytest.approx(interval.high, rel=1e-9)
    assert float(row["p_value"]) == pytest.approx(welch.pvalue, rel=1e-9)
    paired = ("p_value_paired", "paired_ci_low", "paired_ci_high", "paired_mde", "paired_seeds_needed")
    assert [row[c] for c in paired] == [""] * 5  # 4 seeds against 3: no pairs
    welch_columns = ("gap", "gap_ci_low", "gap_ci_high", "p_value", "mde", "seeds_needed")
    assert [base[c] for c in (*welch_columns, *paired)] == [""] * 11
    table = (out / "comparison.md").read_text()
    assert f"| {np.mean(UNEQUAL) - np.mean(BASE):+.4f} [{interval.low:+.4f}, {interval.high:+.4f}] | n/a | " \
           f"{welch.pvalue:.3g} | n/a | not resolved | " in table  # no paired test


def test_seeds_needed_match_power_tables_at_many_seeds(tmp_path: Path) -> None:
    """Equal spreads and many seeds: Welch's test is the two-sample t-test, so the seeds per arm are its power
    tables' (Cohen 1988; statsmodels' TTestIndPower gives the same): a gap of d = 0.5 standard deviations needs 64
    seeds per arm, 0.8 needs 26, 0.2 needs 394."""
    root = _runs(tmp_path / "runs", {"swiglu+softmax": BASE, "isogmlp+softmax": ROW})
    (gap,) = [row.gap for row in compare_runs([load_run(run) for run in sorted(root.iterdir())]).rows if row.gap]
    assert gap.seeds_needed == 64
    assert seeds_needed(0.8, 1.0, 1.0) == 26 and seeds_needed(-0.2, 1.0, 1.0) == 394
    # unequal spreads: the seeds needed grow with the summed variance, as the normal approximation says at large n,
    # plus the few seeds that t's heavier tails cost (about z_0.975^2 / 4 = 1 with equal spreads)
    normal = (stats.norm.isf(0.025) + stats.norm.isf(0.2)) ** 2 * (0.02**2 + 0.04**2) / 0.01**2
    assert normal < seeds_needed(0.01, 0.02, 0.04) <= normal + 3


def welch_power_by_simulation(gap: float, std: float, n: int, baseline_std: float, baseline_n: int,
                              seed: int, reps: int = 200_000) -> float:
    """The share of ``reps`` simulated comparisons (normal seeds of known spread, true gap ``gap``) that scipy's
    Welch test resolves at p < 0.05: independent of llm.eval.stats (standard error of the share below 0.001)."""
    rng = np.random.default_rng(seed)
    sample, baseline = rng.normal(gap, std, (reps, n)), rng.normal(0.0, baseline_std, (reps, baseline_n))
    return float(np.mean(stats.ttest_ind(sample, baseline, axis=1, equal_var=False).pvalue < 0.05))


@pytest.mark.parametrize(("n", "baseline_n", "std", "baseline_std"),
                         [(2, 2, 1.0, 1.0), (3, 3, 1.0, 1.0), (5, 5, 1.0, 1.0),
                          (2, 2, 1.0, 3.0), (3, 3, 0.5, 2.0), (5, 5, 1.0, 3.0), (3, 5, 2.0, 1.0)])
def test_the_mde_has_80_percent_power_for_the_test_the_table_runs(n: int, baseline_n: int, std: float,
                                                                  baseline_std: float) -> None:
    """The table runs Welch's test with its df estimated from the seeds: at the reported MDE that test resolves 80%
    of simulated comparisons, with equal and unequal spreads. (The population's df, which the MDE used before,
    gave 48% at 2 seeds per arm and 70-75% at 3.)"""
    mde = minimum_detectable_effect(std, n, baseline_std, baseline_n)
    simulated = welch_power_by_simulation(mde, std, n, baseline_std, baseline_n, seed=n * 100 + baseline_n)
    assert simulated == pytest.approx(0.8, abs=0.02)
    assert welch_power(std, n, baseline_std, baseline_n)(mde) == pytest.approx(0.8, abs=1e-9)


def test_the_mde_in_seed_spreads_and_the_seeds_a_gap_needs_hold_in_simulation() -> None:
    """With one spread s in both arms, Welch's test at 80% power resolves about 10.4 s at 2 seeds per arm and 3.5 s
    at 3 (docs/comparison.md); a gap of 1.5 s needs the seeds per arm that seeds_needed gives, and one fewer falls
    short."""
    assert [round(minimum_detectable_effect(1.0, n, 1.0, n), 2) for n in (2, 3, 5, 10)] == [10.39, 3.51, 2.08, 1.33]
    needed = int(seeds_needed(1.5, 1.0, 1.0))
    assert welch_power_by_simulation(1.5, 1.0, needed, 1.0, needed, seed=1) >= 0.8 - 0.01
    assert welch_power_by_simulation(1.5, 1.0, needed - 1, 1.0, needed - 1, seed=2) < 0.8


def test_paired_test_is_scipys_on_the_seeds_both_rows_ran(tmp_path: Path) -> None:
    """Seeds 0-2 of both rows on the same data: the paired test of the per-seed differences (0.010, 0.012, 0.009)
    resolves what Welch's does not."""
    row = [4.91, 4.932, 4.949]
    root = _runs(tmp_path / "runs", {"swiglu+softmax": BASE, "isogmlp+softmax": row})
    out = tmp_path / "out"
    assert main(["compare", str(root / "*"), "--out", str(out), "--no-plots"]) == 0
    found = _csv(out)["isogmlp+softmax"]
    paired, welch = stats.ttest_rel(row, BASE).pvalue, stats.ttest_ind(row, BASE, equal_var=False).pvalue
    assert float(found["p_value_paired"]) == pytest.approx(paired, rel=1e-9)
    assert paired < 0.05 < welch == pytest.approx(float(found["p_value"]), rel=1e-9)
    table = (out / "comparison.md").read_text()
    ci = stats.ttest_rel(row, BASE).confidence_interval(0.95)
    assert f"| {welch:.3g} | {paired:.3g} | resolved (paired) |" in table and "p paired ⁵" in table
    assert f"Conclusion: at p < 0.05, isogmlp+softmax +0.0103 resolved (paired) [{ci.low:+.4f}, {ci.high:+.4f}]; " \
           in table


def test_no_gap_across_data_orders(tmp_path: Path) -> None:
    """The same seeds on another fixed data order are no pairs, and no sample of the baseline's either: each row's
    seeds average over initialisations only, so its order's effect would be tested with the variant's. No gap, no
    p-value: the row is listed with the reason (it was given Welch's test)."""
    root = _runs(tmp_path / "runs", {"swiglu+softmax": BASE})
    for seed, loss in enumerate(ROW):
        write_run(root, "isogmlp+softmax", seed, loss, data__seed=1)
    comparison = compare_runs([load_run(run) for run in sorted(root.iterdir())], baseline="swiglu+softmax")
    (row,) = [row for row in comparison.rows if row.variant == "isogmlp+softmax"]
    assert row.gap is None and row.not_compared == "data.seed 1, its baseline's 0"
    assert "row isogmlp+softmax: not compared with swiglu+softmax: their seeds mean different things (data.seed 1, " \
        "its baseline's 0); no gap, p-value or plan" in comparison.warnings


def test_the_line_under_the_table_says_what_can_be_concluded(tmp_path: Path) -> None:
    root = _runs(tmp_path / "runs", {"swiglu+softmax": BASE, "isogmlp+softmax": ROW,
                                     "iso_ln+softmax": [4.95, 4.97, 4.99], "iso_mlp+softmax": [4.9]})
    comparison = compare_runs([load_run(run) for run in sorted(root.iterdir())])
    table = format_table(comparison)
    gaps = {row.variant: row.gap for row in comparison.rows if row.gap}
    mde = gaps["isogmlp+softmax"].mde
    assert gaps["iso_ln+softmax"].mde == pytest.approx(mde, rel=1e-12)  # both spreads 0.02
    ci = stats.ttest_ind([4.95, 4.97, 4.99], BASE, equal_var=False).confidence_interval(0.95)
    # the seeds of ROW and BASE differ alike (0.01, up to rounding): no paired figures
    assert (f"\n\nConclusion: at p < 0.05, iso_ln+softmax +0.0500 resolved (Welch) [{ci.low:+.4f}, "
            f"{ci.high:+.4f}]; isogmlp+softmax +0.0100 not resolved (Welch: MDE {mde:.3g}, as a true gap it would "
            f"need 64 seeds per arm); with 3 seeds per arm this comparison resolves gaps above {mde:.3g} nats by "
            "Welch's test with 80% power at the observed spread (taken as true: about 73% on average at 2-5 seeds per "
            "arm by Welch's test, 58-69% paired; see Assumptions), and a smaller true gap can go unseen; not testable "
            "(fewer than 2 seeds, or no spread): iso_mlp+softmax.\n\n") in table
    assert " tie" not in table and "indistinguishable" not in table


def test_a_gap_of_zero_and_a_zero_spread_say_so(tmp_path: Path) -> None:
    root = _runs(tmp_path / "runs", {"swiglu+softmax": BASE, "isogmlp+softmax": BASE})
    _runs(tmp_path / "runs", {"iso_ln+softmax": [5.0, 5.0]})
    (tmp_path / "flat").mkdir()
    flat = _runs(tmp_path / "flat", {"swiglu+softmax": [4.9, 4.9], "isogmlp+softmax": [5.0, 5.0]})
    out = tmp_path / "out"
    assert main(["compare", str(root / "*"), "--out", str(out), "--no-plots"]) == 0
    table, rows = (out / "comparison.md").read_text(), _csv(out)
    assert "| +0.0000 [" in table and "| never: the gap is 0 |" in table  # it printed "none: the gap is 0"
    assert "isogmlp+softmax +0.0000 not resolved (Welch: MDE " in table
    assert ", no number of seeds resolves a gap of 0)" in table and "need none" not in table
    assert rows["isogmlp+softmax"]["seeds_needed"] == "inf"
    assert float(rows["iso_ln+softmax"]["gap"]) == pytest.approx(0.08, abs=1e-12)  # the baseline's spread alone
    assert main(["compare", str(flat / "*"), "--out", str(out), "--no-plots"]) == 0
    table, rows = (out / "comparison.md").read_text(), _csv(out)
    assert "| +0.1000 | n/a | n/a | n/a | n/a | zero spread | n/a | zero spread | zero spread |" in table
    assert "Conclusion: no gap can be tested" in table and rows["isogmlp+softmax"]["mde"] == ""


def test_summaries_alone_give_the_welch_figures() -> None:
    """The stored mean, std and n of two rows give the interval, p, MDE and seeds needed (no raw losses)."""
    gap = gap_to_baseline(Summary.of(UNEQUAL), Summary.of(BASE))
    welch = stats.ttest_ind(UNEQUAL, BASE, equal_var=False)
    assert (gap.ci_low, gap.ci_high, gap.p_value) == pytest.approx(
        (welch.confidence_interval().low, welch.confidence_interval().high, welch.pvalue), rel=1e-9)
    assert math.isnan(gap.p_paired) and gap.p_value > 0.05


def test_a_shift_constant_up_to_rounding_is_no_paired_test() -> None:
    """Every seed shifted by 0.01 exactly, or by 0.01 up to float rounding (2.1 + 0.01 - 2.1 is not 4.3 + 0.01 - 4.3 in
    binary): no spread to test the mean shift against, so no paired p either way (it was 2e-30, "resolved")."""
    baseline = [1.9, 2.1, 4.3]
    shifted = [loss + 0.01 for loss in baseline]
    assert len({a - b for a, b in zip(shifted, baseline, strict=True)}) > 1  # not exactly constant
    assert math.isnan(paired_p_value(shifted, baseline))
    assert math.isnan(paired_p_value([4.0, 5.0, 6.0], [3.5, 4.5, 5.5]))  # exactly constant
    assert paired_p_value([4.9, 5.1, 5.3], [4.89, 5.0905, 5.29]) < 0.05  # a shift that varies is tested


def test_target_gap_gives_the_seeds_per_arm_it_needs(tmp_path: Path) -> None:
    """compare --target-gap 0.01: each row's seeds per arm for that gap at its and the baseline's spreads."""
    root = _runs(tmp_path / "runs", {"swiglu+softmax": BASE, "isogmlp+softmax": UNEQUAL})
    out = tmp_path / "out"
    assert main(["compare", str(root / "*"), "--out", str(out), "--no-plots", "--target-gap", "0.01"]) == 0
    needed = seeds_needed(0.01, float(np.std(UNEQUAL, ddof=1)), 0.02)
    assert float(_csv(out)["isogmlp+softmax"]["seeds_for_target_gap"]) == needed
    table = (out / "comparison.md").read_text()
    assert "| Seeds needed ⁶ | Pairs needed ⁵ ⁶ | Seeds for gap 0.01 ⁶ | Pairs for gap 0.01 ⁵ ⁶ |" in table
    assert f"| {needed:,.0f} | n/a |" in table
    assert "⁶ Seeds per arm (pairs, paired) at 80% power" in table
    assert "a gap of 0.01 (--target-gap)" in table
    for bad in ("0", "-0.01", "inf", "nan"):  # inf was accepted and needed "2" seeds per arm
        with pytest.raises(SystemExit) as refused:
            main(["compare", str(root / "*"), "--out", str(out), "--no-plots", "--target-gap", bad])
        assert refused.value.code == 2
