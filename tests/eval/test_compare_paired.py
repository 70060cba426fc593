"""The paired design's figures (interval, MDE, pairs needed) against scipy and simulation, the words that say which
design resolved a gap, Welch's rounding guard, and the cosmetics of compare's table and csv."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from test_compare import write_run
from tiny import REPO

from llm.cli.eval import main
from llm.eval.compare import compare_runs
from llm.eval.errors import EvalError
from llm.eval.report import _resolved, format_table
from llm.eval.runs import load_run
from llm.eval.stats import (
    Gap,
    Summary,
    gap_to_baseline,
    paired_interval,
    paired_mde,
    paired_power,
    pairs_needed,
)

BASE = [4.90, 4.92, 4.94]
PAIRED = [4.91, 4.932, 4.949]  # differences 0.010, 0.012, 0.009: Welch leaves the gap open, pairing resolves it
FAR = [4.95, 4.97, 4.99]  # a gap Welch's test resolves


def _compare(root: Path, losses: dict[str, list[float]], *extra: str) -> tuple[str, dict[str, dict[str, str]]]:
    for variant, values in losses.items():
        for seed, loss in enumerate(values):
            write_run(root / "runs", variant, seed, loss)
    out = root / "out"
    assert main(["compare", str(root / "runs" / "*"), "--out", str(out), "--no-plots", *extra]) == 0
    with (out / "comparison.csv").open() as f:
        return (out / "comparison.md").read_text(), {row["variant"]: row for row in csv.DictReader(f)}


def test_the_paired_interval_is_the_textbook_one() -> None:
    """mean(d) -+ t_{0.975, n-1} * sd(d) / sqrt(n) over the per-seed differences d (scipy's call is the
    implementation, so the reference is the formula)."""
    rng = np.random.default_rng(0)
    for n in (2, 3, 7):
        sample, baseline = rng.normal(5.0, 0.1, n), rng.normal(5.0, 0.1, n)
        d = sample - baseline
        half = stats.t.ppf(0.975, n - 1) * d.std(ddof=1) / math.sqrt(n)
        assert paired_interval(list(sample), list(baseline)) == pytest.approx((d.mean() - half, d.mean() + half),
                                                                              rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("sd", "n", "gap"), [(1.0, 2, 3.0), (0.3, 3, 0.2), (2.0, 5, -1.5), (1.0, 40, 0.4),
                                              (1.0, 4, 0.0)])
def test_paired_power_is_the_noncentral_t(sd: float, n: int, gap: float) -> None:
    """power = P(T > t_c) + P(T < -t_c), T noncentral t with n - 1 df and noncentrality gap * sqrt(n) / sd."""
    critical, shift = stats.t.isf(0.025, n - 1), gap * math.sqrt(n) / sd
    exact = stats.nct.sf(critical, n - 1, shift) + stats.nct.cdf(-critical, n - 1, shift)
    assert paired_power(sd, n)(gap) == pytest.approx(exact, rel=1e-12, abs=1e-15)


def test_paired_power_holds_far_in_the_tail() -> None:
    """scipy's nct.cdf is NaN at 1 df and shift 40; the power there is finite and near 1."""
    assert math.isnan(stats.nct.cdf(-stats.t.isf(0.025, 1), 1, 40.0))
    assert 0.99 < paired_power(1.0, 2)(40.0 / math.sqrt(2)) <= 1.0


def paired_power_by_simulation(gap: float, sd: float, n: int, seed: int, reps: int = 200_000) -> float:
    """The share of simulated paired comparisons (a shared seed effect, normal differences of spread ``sd``, true
    gap ``gap``) that scipy's paired t-test resolves at p < 0.05 (standard error below 0.001)."""
    rng = np.random.default_rng(seed)
    baseline = rng.normal(5.0, 1.0, (reps, n))  # the seed's effect, shared by both runs of a pair
    sample = baseline + rng.normal(gap, sd, (reps, n))
    return float(np.mean(stats.ttest_rel(sample, baseline, axis=1).pvalue < 0.05))


@pytest.mark.parametrize(("n", "sd"), [(2, 1.0), (3, 0.5), (5, 2.0), (10, 1.0)])
def test_the_paired_mde_has_80_percent_power(n: int, sd: float) -> None:
    mde = paired_mde(sd, n)
    assert paired_power(sd, n)(mde) == pytest.approx(0.8, abs=1e-9)
    assert paired_power_by_simulation(mde, sd, n, seed=n) == pytest.approx(0.8, abs=0.02)


def test_pairs_needed_are_the_fewest_with_80_percent_power() -> None:
    """A gap of half the differences' spread needs 34 pairs (the one-sample t-test's power tables, Cohen 1988);
    the count found has 80% power exactly and in simulation, one pair fewer falls short."""
    assert pairs_needed(0.5, 1.0) == 34 == pairs_needed(-0.5, 1.0)
    for gap, sd in ((0.5, 1.0), (1.2, 1.0), (0.03, 0.02)):
        needed = int(pairs_needed(gap, sd))
        assert paired_power(sd, needed)(gap) >= 0.8 > paired_power(sd, needed - 1)(gap)
    needed = int(pairs_needed(1.2, 1.0))
    assert paired_power_by_simulation(1.2, 1.0, needed, seed=11) >= 0.8 - 0.01
    assert paired_power_by_simulation(1.2, 1.0, needed - 1, seed=12) < 0.8
    assert pairs_needed(0.0, 1.0) == math.inf and pairs_needed(1e-4, 1.0) == math.inf  # over MAX_SEEDS
    assert pairs_needed(20.0, 1.0) == 2  # never fewer than 2 pairs: 1 has no spread to test against


def test_paired_figures_in_the_csv_and_next_to_welchs(tmp_path: Path) -> None:
    table, rows = _compare(tmp_path, {"swiglu+softmax": BASE, "isogmlp+softmax": PAIRED, "iso_ln+softmax": FAR},
                           "--target-gap", "0.005")
    row = rows["isogmlp+softmax"]
    differences = [a - b for a, b in zip(PAIRED, BASE, strict=True)]
    sd, gap = statistics.stdev(differences), statistics.fmean(PAIRED) - statistics.fmean(BASE)
    interval = stats.ttest_rel(PAIRED, BASE).confidence_interval(0.95)
    assert float(row["paired_ci_low"]) == pytest.approx(interval.low, rel=1e-12)
    assert float(row["paired_ci_high"]) == pytest.approx(interval.high, rel=1e-12)
    assert float(row["paired_mde"]) == pytest.approx(paired_mde(sd, 3), rel=1e-12)
    assert float(row["paired_seeds_needed"]) == pairs_needed(gap, sd) == 3
    assert float(row["paired_seeds_for_target_gap"]) == pairs_needed(0.005, sd)
    assert float(row["mde"]) > 10 * float(row["paired_mde"])  # the seed's share of the spread cancels in a pair
    assert [rows["swiglu+softmax"][c] for c in ("paired_ci_low", "paired_mde", "paired_seeds_for_target_gap")] == \
        [""] * 3
    assert (f"| [{interval.low:+.4f}, {interval.high:+.4f}] | {float(row['p_value']):.3g} | "
            f"{float(row['p_value_paired']):.3g} | resolved (paired) | {float(row['mde']):.4f} | "
            f"{float(row['paired_mde']):.4f} | {float(row['seeds_needed']):,.0f} | 3 | ") in table
    assert "| resolved (Welch) |" in table  # iso_ln's: a constant shift up to rounding, no paired test
    assert "isogmlp+softmax +0.0103 resolved (paired) [" in table and "iso_ln+softmax +0.0500 resolved (Welch) [" \
        in table
    assert "80% power at the observed spread (taken as true: about 73% on average" in table
    # the notes link it ("Method: docs/comparison.md."); its text compared with line breaks as spaces
    method = " ".join((REPO / "docs" / "comparison.md").read_text().split())
    assert "- Method: docs/comparison.md." in table
    assert "so a seed fixes the initialisation" in method and "The verdict is one test fixed in advance" in method
    assert "pairs of different seeds are" in method and "Not valid, so n/a, where" in method
    assert "- Assumptions: normal seed effects; MDEs take the observed spreads as true" in table


def test_the_notes_are_one_short_line_per_mark(tmp_path: Path) -> None:
    """A researcher reads the table, not paragraphs: each note (warnings aside) fits one line of 130 characters."""
    root = tmp_path / "runs"
    for variant, losses in (("swiglu+softmax", [4.9, 4.95, 4.93]), ("isogmlp+softmax", [4.92, 4.96, 4.96])):
        for seed, loss in enumerate(losses):
            write_run(root, variant, seed, loss)
    table = format_table(compare_runs([load_run(run) for run in sorted(root.iterdir())], target_gap=0.05))
    notes = [line for line in table.splitlines() if line.startswith("- ") and not line.startswith("- Warning")]
    assert len(notes) >= 8 and all(len(note) <= 130 for note in notes), max(notes, key=len)


def test_the_verdict_is_one_test_fixed_in_advance() -> None:
    """Where rows pair, the paired test decides, whatever Welch's says; a gap only Welch's test resolves is not
    resolved there (taking either test's rejection would be two tries at 5%)."""
    welch_only = Gap(0.1, 0.02, 0.05, 0.15, 0.01, 0.06, 3, p_paired=0.2, paired_ci_low=-0.1, paired_ci_high=0.3)
    paired_only = replace(welch_only, p_value=0.2, ci_low=-0.1, ci_high=0.3, p_paired=0.01, paired_ci_low=0.05,
                          paired_ci_high=0.15)
    unpaired = replace(welch_only, p_paired=math.nan, paired_ci_low=math.nan, paired_ci_high=math.nan)
    assert [_resolved(gap) for gap in (welch_only, paired_only, unpaired)] == \
        ["not resolved", "resolved (paired)", "resolved (Welch)"]


def test_rows_that_do_not_pair_have_no_paired_figures(tmp_path: Path) -> None:
    """Another set of seeds: every paired column empty (another data order is not compared at all:
    test_compare_comparable.py)."""
    for seed, loss in enumerate(BASE):
        write_run(tmp_path, "swiglu+softmax", seed, loss)
        write_run(tmp_path, "isogmlp+softmax", seed + 1, PAIRED[seed])
    (gap,) = [row.gap for row in compare_runs([load_run(run) for run in sorted(tmp_path.iterdir())]).rows if row.gap]
    assert all(math.isnan(getattr(gap, field)) for field in ("p_paired", "paired_ci_low", "paired_ci_high",
                                                             "paired_mde", "paired_seeds_needed"))


def test_rounding_is_no_spread_for_welch_either(tmp_path: Path) -> None:
    """Seeds 2e-15 apart are rounding: "no gap can be tested", as with exactly equal seeds (it printed p 9.9e-28,
    MDE 1.3e-14 and "gaps resolved")."""
    gap = gap_to_baseline(Summary.of([6.7, 6.7 + 2e-15]), Summary.of([6.66, 6.66 + 2e-15]))
    assert gap.se == 0 and all(math.isnan(x) for x in (gap.ci_low, gap.p_value, gap.mde, gap.seeds_needed))
    table, rows = _compare(tmp_path, {"swiglu+softmax": [6.66, 6.66 + 2e-15], "isogmlp+softmax": [6.7, 6.7 + 2e-15]})
    assert "Conclusion: no gap can be tested" in table and "resolved" not in table.split("Conclusion")[1][:80]
    assert rows["isogmlp+softmax"]["p_value"] == rows["isogmlp+softmax"]["mde"] == ""
    # a real spread next to a rounding-level one is still tested
    assert gap_to_baseline(Summary.of([6.7, 6.7 + 2e-15]), Summary.of([6.6, 6.62])).se > 0


def test_welch_figures_from_summaries_equal_scipys_on_the_losses() -> None:
    """p from scipy's ttest_ind_from_stats, the interval written out: both equal ttest_ind's on the losses."""
    rng = np.random.default_rng(3)
    for n, baseline_n in ((2, 2), (3, 5), (6, 4)):
        sample, baseline = rng.normal(5.0, 0.1, n), rng.normal(5.05, 0.3, baseline_n)
        gap = gap_to_baseline(Summary.of(list(sample)), Summary.of(list(baseline)))
        welch = stats.ttest_ind(sample, baseline, equal_var=False)
        interval = welch.confidence_interval(0.95)
        assert (gap.ci_low, gap.ci_high, gap.p_value) == pytest.approx((interval.low, interval.high, welch.pvalue),
                                                                        rel=1e-12)


def test_the_summary_names_the_runs_left_out(tmp_path: Path) -> None:
    """A row compared on 2 of its 3 seeds says which one diverged (it reported "gaps resolved" without a word)."""
    table, _ = _compare(tmp_path, {"swiglu+softmax": BASE, "isogmlp+softmax": [4.99, 5.01, math.nan]})
    conclusion = table.split("Conclusion: ")[1].split("\n")[0]
    assert "resolved (Welch)" in conclusion
    assert conclusion.endswith("; the figures rest on complete seeds only, left out: isogmlp_softmax_s2 (diverged).")


def test_target_gap_must_be_finite_and_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "runs", "swiglu+softmax", 0, 5.0)
    with pytest.raises(SystemExit) as refused:
        main(["compare", str(tmp_path / "runs" / "*"), "--out", str(tmp_path / "out"), "--target-gap", "inf"])
    assert refused.value.code == 2 and not (tmp_path / "out").exists()
    assert "argument --target-gap: expected a finite gap > 0 nats, got inf" in capsys.readouterr().err
    with pytest.raises(EvalError, match="finite gap > 0"):
        compare_runs([load_run(tmp_path / "runs" / "swiglu_softmax_s0")], target_gap=math.inf)


def test_the_stated_true_power_of_a_plugged_in_paired_mde() -> None:
    """The table states that an MDE from the observed spread of 2-5 pairs has 58-69% true power on average: the
    exact power at the true spread, averaged over the chi law of the observed one (midpoint rule)."""
    quantiles = (np.arange(2000) + 0.5) / 2000
    measured = []
    for n in (2, 3, 4, 5):
        observed = np.sqrt(stats.chi2.ppf(quantiles, n - 1) / (n - 1))  # observed spread / true spread
        measured.append(np.mean([paired_power(1.0, n)(s * paired_mde(1.0, n)) for s in observed]))
    assert np.round(measured, 2).tolist() == [0.58, 0.63, 0.66, 0.69]
