"""What a row's gap to its baseline resolves over seeds: its 95% interval and p-value (two-sided Welch t-test), the
smallest gap the seeds resolve with 80% power (minimum detectable effect, MDE), the seeds per arm a gap would need,
and the same figures by the paired t-test where two rows ran the same seeds on the same data.

Welch's power is that of the test the table runs: Welch's, with its degrees of freedom estimated from the two samples'
variances, taking the observed spreads as the true ones. The population's Welch-Satterthwaite df would overstate
it (48% power at the MDE it gives at 2 seeds per arm, 70-75% at 3). With normal seeds the mean gap is independent
of the two sample variances, so conditional on them the test rejects with probability
``Phi((d - c) / se) + Phi((-d - c) / se)`` (true gap d, true standard error se, c = t_{1-ALPHA/2}(df^) * se^, the
critical gap of that draw); the power is its mean over the two variances' scaled chi-square laws, here a
midpoint rule on ``QUADRATURE_POINTS`` quantiles of each (deterministic; the MDE within 0.1% of the exact one).
The paired test's power is exact: its statistic is noncentral t (``paired_power``).

Both take the observed spread as the true one, which is optimistic at few seeds. An MDE from 2-5 seeds' observed
spreads has about 73% true power on average, not 80%, by Welch's test (equal spreads, 1,000 simulated pilots per
seed count: 71% at 2 and 3 seeds per arm, 75% at 4 and 5), and 58%, 63%, 66%, 69% at 2-5 pairs by the paired test
(exact: ``paired_power`` at the true spread averaged over the chi law of the observed one; Monte Carlo agrees)."""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass

import numpy as np
from scipy import optimize, stats

__all__ = ["ALPHA", "MAX_SEEDS", "POWER", "Gap", "Summary", "gap_to_baseline", "minimum_detectable_effect",
           "paired_interval", "paired_mde", "paired_p_value", "paired_power", "pairs_needed", "seeds_needed",
           "welch_df", "welch_power"]

ALPHA, POWER = 0.05, 0.8
Array = np.ndarray | float
MAX_SEEDS = 100_000  # a gap that needs more seeds per arm is too small to resolve
QUADRATURE_POINTS = 100
# A spread below this fraction of the losses' size is rounding (of one shift in every pair, or of one loss).
ROUNDING = 64 * sys.float_info.epsilon


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
    """A row's mean final validation loss minus its baseline's, and what their seeds resolve of it, by Welch's test
    and, where the rows pair by seed, the paired one. The fields after ``gap`` are NaN with fewer than 2 seeds in
    either row, and so are those after ``se`` (0) with no spread; the paired ones are NaN where the rows do not pair
    or their differences do not vary. Seeds needed are inf when the gap is 0 or would need over MAX_SEEDS."""

    gap: float
    se: float
    ci_low: float
    ci_high: float
    p_value: float
    mde: float
    seeds_needed: float
    target_seeds: float = math.nan
    """Seeds per arm for ``compare --target-gap``; NaN without one."""
    p_paired: float = math.nan
    paired_ci_low: float = math.nan
    paired_ci_high: float = math.nan
    paired_mde: float = math.nan
    paired_seeds_needed: float = math.nan
    """Pairs: a seed of the row and the same seed of the baseline."""
    paired_target_seeds: float = math.nan
    stein_threshold: float = math.nan
    """With ``compare --planned plan.csv``: the planned row's final test is Stein's, ``|gap|`` beyond this
    (``llm.eval.plan``), not the t-tests above; NaN otherwise."""
    planned_gap: float = math.nan
    """The gap that plan resolves with ``POWER``."""
    undecided: str = ""
    """With ``--planned``: why Stein's test cannot decide the row (a planned seed diverged: ``llm.eval.planned``)."""


def welch_df(variances: tuple[Array, Array], counts: tuple[int, int]) -> Array:
    """Satterthwaite's degrees of freedom of the sum of two arms' variances of the mean, each estimated from its
    arm's ``counts`` seeds (arrays: one per draw)."""
    return sum(variances) ** 2 / (variances[0] ** 2 / (counts[0] - 1) + variances[1] ** 2 / (counts[1] - 1))


def welch_power(std: float, n: int, baseline_std: float, baseline_n: int) -> Callable[[float], float]:
    """The power of the two-sided Welch test at ``ALPHA`` between ``n`` normal seeds of spread ``std`` and
    ``baseline_n`` of spread ``baseline_std``, as a function of the true gap (module docstring)."""
    quantiles = (np.arange(QUADRATURE_POINTS) + 0.5) / QUADRATURE_POINTS
    mine = (std**2 / n * stats.chi2.ppf(quantiles, n - 1) / (n - 1))[None, :]  # the arm's se^2 at each quantile
    theirs = (baseline_std**2 / baseline_n * stats.chi2.ppf(quantiles, baseline_n - 1) / (baseline_n - 1))[:, None]
    df = welch_df((mine, theirs), (n, baseline_n))  # sampled
    critical = stats.t.isf(ALPHA / 2, df) * np.sqrt(mine + theirs)  # the gap estimate each draw rejects above
    se = math.sqrt(std**2 / n + baseline_std**2 / baseline_n)
    return lambda gap: float(np.mean(stats.norm.cdf((abs(gap) - critical) / se)
                                     + stats.norm.cdf((-abs(gap) - critical) / se)))


def minimum_detectable_effect(std: float, n: int, baseline_std: float, baseline_n: int) -> float:
    """The true gap Welch's test resolves at ``ALPHA`` with probability ``POWER`` between ``n`` seeds of spread
    ``std`` and ``baseline_n`` of spread ``baseline_std``. At 2 seeds a row the df can be near 1, where the critical
    t is 12.7: the upper bracket 10^4 standard errors has power 1."""
    power, se = welch_power(std, n, baseline_std, baseline_n), math.sqrt(std**2 / n + baseline_std**2 / baseline_n)
    return optimize.brentq(lambda gap: power(gap) - POWER, 0.0, 1e4 * se, xtol=1e-12 * se)


def _fewest(resolves: Callable[[int], bool], gap: float, variance: float) -> float:
    """The fewest seeds n >= 2 that ``resolves`` a true ``gap`` (power grows with n) when one seed's estimate of it
    has ``variance``; inf when the gap is 0 or needs over ``MAX_SEEDS``. The search steps up from the normal
    approximation's count (the test with known spreads, which needs a few fewer) until a count resolves, then
    bisects."""
    if gap == 0 or not resolves(MAX_SEEDS):
        return math.inf
    normal = (stats.norm.isf(ALPHA / 2) + stats.norm.isf(1 - POWER)) ** 2 * variance / gap**2
    low, high, step = 1, min(max(2, math.ceil(normal)), MAX_SEEDS), 1  # low never resolves, high is a first guess
    while not resolves(high):  # widened upwards by doubling steps (the guess rarely falls short by more than 3)
        low, high, step = high, min(high + step, MAX_SEEDS), 2 * step
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if resolves(middle) else (middle, high)
    return high


def seeds_needed(gap: float, std: float, baseline_std: float) -> float:
    """The fewest seeds per arm (the variant and the baseline each) at which Welch's test resolves a true ``gap``
    with probability ``POWER`` when the arms' seeds spread by ``std`` and ``baseline_std``; inf when the gap is 0
    or needs over ``MAX_SEEDS``."""
    return _fewest(lambda n: welch_power(std, n, baseline_std, n)(gap) >= POWER, gap, std**2 + baseline_std**2)


def paired_interval(sample: Sequence[float], baseline: Sequence[float]) -> tuple[float, float]:
    """The ``1 - ALPHA`` interval of the mean difference of losses paired by position (scipy's paired t-test)."""
    interval = stats.ttest_rel(sample, baseline).confidence_interval(1 - ALPHA)
    return float(interval.low), float(interval.high)


def paired_power(sd: float, n: int) -> Callable[[float], float]:
    """The power of the two-sided paired t-test at ``ALPHA`` over ``n`` pairs whose differences are normal with
    true spread ``sd``, as a function of the true gap: exact, the t statistic being noncentral t with n - 1 df
    and noncentrality gap * sqrt(n) / sd. Its lower tail P(T < -t_c) is taken as P(T > t_c) at the opposite
    noncentrality, equal by symmetry: scipy's ``nct.cdf`` returns NaN far in that tail (e.g. 1 df, shift 40)."""
    critical = stats.t.isf(ALPHA / 2, n - 1)

    def power(gap: float) -> float:
        shift = gap * math.sqrt(n) / sd
        return float(stats.nct.sf(critical, n - 1, shift) + stats.nct.sf(critical, n - 1, -shift))
    return power


def paired_mde(sd: float, n: int) -> float:
    """The true gap the paired t-test over ``n`` pairs of difference spread ``sd`` resolves with probability
    ``POWER``. At 2 pairs (1 df) it is about 16 standard errors: the bracket 10^3 has power 1."""
    power, se = paired_power(sd, n), sd / math.sqrt(n)
    return optimize.brentq(lambda gap: power(gap) - POWER, 0.0, 1e3 * se, xtol=1e-12 * se)


def pairs_needed(gap: float, sd: float) -> float:
    """The fewest pairs n >= 2 at which the paired t-test resolves a true ``gap`` with probability ``POWER`` when
    the differences spread by ``sd``; inf when the gap is 0 or needs over ``MAX_SEEDS``."""
    return _fewest(lambda n: paired_power(sd, n)(gap) >= POWER, gap, sd**2)


def paired_p_value(sample: Sequence[float], baseline: Sequence[float]) -> float:
    """Two-sided paired t-test of two rows' losses in the same seeds' order; NaN with fewer than 2 pairs or when
    every pair differs alike, exactly or up to rounding (``ROUNDING``: the test would divide by rounding noise)."""
    differences = [a - b for a, b in zip(sample, baseline, strict=True)]
    scale = max(map(abs, [*sample, *baseline]), default=0.0)
    if len(differences) < 2 or statistics.pstdev(differences) <= ROUNDING * scale:
        return math.nan
    return float(stats.ttest_rel(sample, baseline).pvalue)


def _paired_figures(sample: Sequence[float], baseline: Sequence[float], gap: float,
                    target_gap: float | None) -> dict[str, float]:
    """``Gap``'s paired fields for losses paired by position; none (NaN) where ``paired_p_value`` is undefined."""
    if math.isnan(p := paired_p_value(sample, baseline)):
        return {}
    low, high = paired_interval(sample, baseline)
    sd = statistics.stdev(a - b for a, b in zip(sample, baseline, strict=True))
    return {"p_paired": p, "paired_ci_low": low, "paired_ci_high": high, "paired_mde": paired_mde(sd, len(sample)),
            "paired_seeds_needed": pairs_needed(gap, sd),
            "paired_target_seeds": math.nan if target_gap is None else pairs_needed(target_gap, sd)}


def gap_to_baseline(row: Summary, baseline: Summary, pairs: tuple[Sequence[float], Sequence[float]] | None = None,
                    target_gap: float | None = None) -> Gap:
    """``row``'s gap to ``baseline`` with its Welch interval and p-value, MDE and seeds needed (for the observed
    gap and, when given, for ``target_gap``), and with ``pairs`` (the two rows' losses in one seed order, where
    the rows pair) the paired figures. Spreads at rounding level (``ROUNDING``) are no spread: nothing is tested.
    Only the summaries are at hand, so scipy gives the p-value from them and the interval is written out: scipy's
    (``ttest_ind(..., equal_var=False).confidence_interval()``) needs the losses."""
    gap = row.mean - baseline.mean
    if row.n < 2 or baseline.n < 2 or max(row.std, baseline.std) <= ROUNDING * max(abs(row.mean), abs(baseline.mean)):
        return Gap(gap, 0.0 if row.n > 1 and baseline.n > 1 else math.nan, *[math.nan] * 5)
    welch = stats.ttest_ind_from_stats(*astuple(row), *astuple(baseline), equal_var=False)
    row_var, baseline_var = row.std**2 / row.n, baseline.std**2 / baseline.n
    se = math.sqrt(row_var + baseline_var)
    df = welch_df((row_var, baseline_var), (row.n, baseline.n))
    half = stats.t.isf(ALPHA / 2, df) * se
    return Gap(gap, se, float(gap - half), float(gap + half), float(welch.pvalue),
               minimum_detectable_effect(row.std, row.n, baseline.std, baseline.n),
               seeds_needed(gap, row.std, baseline.std),
               math.nan if target_gap is None else seeds_needed(target_gap, row.std, baseline.std),
               **({} if pairs is None else _paired_figures(*pairs, gap, target_gap)))
