"""What a row's gap to its baseline resolves over seeds: its 95% interval and p-value (two-sided Welch t-test), the
smallest gap the seeds resolve with 80% power (minimum detectable effect, MDE), the seeds per variant the observed
gap would need, and the paired t-test. Power takes the observed spreads as the true ones: under a true gap d the
Welch statistic is noncentral t (Welch-Satterthwaite df, noncentrality d / se); a normal approximation would
understate the MDE by a quarter at 3 seeds per row (df 4: 2.80 se against 3.76 se)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import optimize, stats

__all__ = ["ALPHA", "MAX_SEEDS", "POWER", "Gap", "Summary", "gap_to_baseline", "minimum_detectable_effect",
           "paired_p_value", "seeds_needed"]

ALPHA, POWER = 0.05, 0.8
MAX_SEEDS = 100_000  # a gap that needs more seeds per variant is too small to resolve


@dataclass(frozen=True)
class Summary:
    """A row's final validation losses over its complete seeds: mean, sample std (ddof=1) and count (NaN: undefined)."""

    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, losses: Sequence[float]) -> Summary:
        return cls(statistics.fmean(losses) if losses else math.nan,
                   statistics.stdev(losses) if len(losses) > 1 else math.nan, len(losses))


@dataclass(frozen=True)
class Gap:
    """A row's mean final validation loss minus its baseline's, and what their seeds resolve of it. The fields
    after ``gap`` are NaN with fewer than 2 seeds in either row, and so are those after ``se`` (0) with no spread."""

    gap: float
    se: float
    ci_low: float
    ci_high: float
    p_value: float
    mde: float
    seeds_needed: float  # inf when the gap is 0 or would need over MAX_SEEDS
    p_paired: float = math.nan  # NaN where the rows' seeds do not pair up


def _power(noncentrality: float, df: float) -> float:
    """Probability that a two-sided t-test at ``ALPHA`` rejects."""
    critical = stats.t.isf(ALPHA / 2, df)  # the lower tail as sf at -noncentrality: nct.cdf gives NaN near df 1
    return float(stats.nct.sf(critical, df, noncentrality) + stats.nct.sf(critical, df, -noncentrality))


def minimum_detectable_effect(se: float, df: float) -> float:
    """The true gap a two-sided t-test with standard error ``se`` and ``df`` degrees of freedom resolves at ``ALPHA``
    with probability ``POWER``. Welch's df is at least 1 (2 seeds a row), where a noncentrality of 30 has power 0.98."""
    return se * optimize.brentq(lambda nc: _power(nc, df) - POWER, 0.0, 100.0, xtol=1e-12)


def seeds_needed(gap: float, std: float, baseline_std: float) -> float:
    """The fewest seeds per variant at which Welch's test resolves a true ``gap`` with probability ``POWER`` when
    the rows' seeds spread by ``std`` and ``baseline_std``; inf when the gap is 0 or needs over ``MAX_SEEDS``."""
    variance, fourth = std**2 + baseline_std**2, std**4 + baseline_std**4

    def shortfall(n: float) -> float:  # grows with n, continuous in it
        return _power(abs(gap) / math.sqrt(variance / n), (n - 1) * variance**2 / fourth) - POWER

    if gap == 0 or shortfall(MAX_SEEDS) < 0:
        return math.inf
    return 2 if shortfall(2) >= 0 else math.ceil(optimize.brentq(shortfall, 2, MAX_SEEDS, xtol=1e-9))


def paired_p_value(sample: Sequence[float], baseline: Sequence[float]) -> float:
    """Two-sided paired t-test of two rows' losses in the same seeds' order; NaN with fewer than 2 pairs or when
    every pair differs alike."""
    differences = [a - b for a, b in zip(sample, baseline, strict=True)]
    if len(differences) < 2 or statistics.pvariance(differences) == 0:
        return math.nan
    return float(stats.ttest_rel(sample, baseline).pvalue)


def gap_to_baseline(row: Summary, baseline: Summary, p_paired: float = math.nan) -> Gap:
    """``row``'s gap to ``baseline`` with its Welch interval and p-value, MDE and seeds needed."""
    gap = row.mean - baseline.mean
    if row.n < 2 or baseline.n < 2 or row.std == baseline.std == 0:
        se = 0.0 if row.n > 1 and baseline.n > 1 else math.nan
        return Gap(gap, se, math.nan, math.nan, math.nan, math.nan, math.nan, p_paired)
    row_var, baseline_var = row.std**2 / row.n, baseline.std**2 / baseline.n
    se = math.sqrt(row_var + baseline_var)
    df = se**4 / (row_var**2 / (row.n - 1) + baseline_var**2 / (baseline.n - 1))
    half = stats.t.isf(ALPHA / 2, df) * se
    return Gap(gap, se, float(gap - half), float(gap + half), float(2 * stats.t.sf(abs(gap) / se, df)),
               minimum_detectable_effect(se, df), seeds_needed(gap, row.std, baseline.std), p_paired)
