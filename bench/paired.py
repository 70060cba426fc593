"""Paired ratios and their intervals: how sure a bench is of "row A runs at r x row B's speed".

Every round of a bench times every row once, so the rows of one round share the machine's state (load, clock,
thermals). The ratio of two rows is therefore taken *within* each round, ``reference seconds / row seconds`` (the
row's tokens/s over its reference's, both moving the same tokens), and only then summarised: the median of the
per-round ratios, with the distribution-free 95% interval of that median, the order-statistic (binomial) one
(``scipy.stats.quantile_test``'s, which tests/bench checks it against): with n rounds, [k-th smallest, k-th largest]
for the largest k with P(Binomial(n, 1/2) < k) <= 2.5%. It holds the median with at least 95% probability at every
n, whatever the rounds' distribution, and needs at least ``MIN_ROUNDS`` (6) rounds; with fewer the ratio is printed
with "too few rounds" and gets no verdict. (The percentile bootstrap of the median used before missed it 50% of the
time at 2 rounds, 25% at 3 and 12% at 7: tests/bench/test_bench_step.py simulates both.) A change in load between
rounds cancels in each ratio; an unpaired ratio of two best-of figures does not, and carries no statement of its
noise.

A target is met only when the interval's lower end clears it (``verdict``); when the interval straddles it the
figures do not resolve it.

Also the one place that writes a bench's ``--csv``: one row per variant, ``CSV_COLUMNS``.
"""

from __future__ import annotations

import csv
import functools
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from scipy import stats

CONFIDENCE = 0.95
MIN_ROUNDS = math.ceil(math.log2(2 / (1 - CONFIDENCE)))
"""The fewest rounds whose extremes hold the median with ``CONFIDENCE``: 1 - 2 / 2**n >= 0.95 from n = 6."""
RESAMPLES = 10_000
SEED = 0
CSV_COLUMNS = {"variant": "variant", "reference": "reference",
               "tokens_per_s": "tokens_per_s_median_of_rounds",
               "ratio": "ratio_to_reference_median_of_paired_rounds",
               "ratio_ci_low": "ratio_ci_low", "ratio_ci_high": "ratio_ci_high", "rounds": "rounds", "mfu": "mfu"}
"""Figure key -> CSV header. The header says where each figure comes from, since the two medians need not agree
in direction: ``tokens_per_s`` is the median over rounds of the row's own tokens/s, ``ratio`` the median over
rounds of the row's tokens/s over its reference's in the same round."""


@dataclass(frozen=True)
class PairedRatio:
    """The median over rounds of a row's per-round speed ratio to its reference, with its 95% interval (None
    with fewer than ``MIN_ROUNDS`` rounds)."""

    median: float
    low: float | None
    high: float | None
    rounds: int

    def __str__(self) -> str:
        if self.low is None:
            return f"{self.median:.3f}x (too few rounds: {self.rounds} < {MIN_ROUNDS})"
        return f"{self.median:.3f}x [{self.low:.3f}, {self.high:.3f}]"


def round_ratios(row_seconds: Sequence[float], reference_seconds: Sequence[float]) -> list[float]:
    """Per round, the reference's seconds over the row's: the row's speed over the reference's (pass seconds per
    token where the rows' steps differ in tokens)."""
    if len(row_seconds) != len(reference_seconds):
        raise ValueError(f"paired rounds differ in number: {len(row_seconds)} against {len(reference_seconds)}")
    return [ref / row for row, ref in zip(row_seconds, reference_seconds, strict=True)]


@functools.cache
def order_statistic(n: int) -> int:
    """The k of the interval [k-th smallest, k-th largest] of n values (module docstring); 0 where there is none.
    (A binomial table once per n: ``scipy.stats.quantile_test`` gives the same interval at 6 ms a call.)"""
    return int((stats.binom.cdf(range(n), n, 0.5) <= (1 - CONFIDENCE) / 2).sum())


def median_interval(values: Sequence[float]) -> PairedRatio:
    """The median of ``values`` and its distribution-free order-statistic ``CONFIDENCE`` interval (module
    docstring); no interval where there are too few values for one."""
    if not values:
        raise ValueError("no rounds to summarise")
    ordered, k = sorted(values), order_statistic(len(values))
    low, high = (ordered[k - 1], ordered[-k]) if k else (None, None)
    return PairedRatio(statistics.median(values), low, high, len(values))


def paired_ratio(row_seconds: Sequence[float], reference_seconds: Sequence[float]) -> PairedRatio:
    """``row``'s speed over ``reference``'s, paired per round: median and 95% interval."""
    return median_interval(round_ratios(row_seconds, reference_seconds))


def grouped_interval(groups: Sequence[Sequence[float]]) -> PairedRatio:
    """The median of every group's values pooled, and a two-stage percentile-bootstrap interval of it: each
    resample draws the groups with replacement, then each drawn group's values with replacement (a cluster
    bootstrap, which scipy lacks).

    A group is one process pair's per-round ratios (bench_trees.py ``--processes``). An offset that stays with one
    process for its whole run (its memory placement, say) is the same in every round of its group, so resampling
    rounds alone would read it as signal; drawing the groups puts it into the interval. With two groups the
    interval spans about the two groups' medians. As ``median_interval``, and so as ``verdict`` reads both, it
    gives no interval for fewer than ``MIN_ROUNDS`` values pooled.

    Its coverage is not shown: a percentile bootstrap over the few groups a bench runs (2-3 processes) resamples
    only those groups' medians, so it reads best as the spread between processes, not as an interval that holds the
    true ratio 95% of the time (``median_interval``'s is shown, by simulation, in tests/bench).
    """
    if not groups or not all(groups):
        raise ValueError("no rounds to summarise (an empty group)")
    pooled = [v for group in groups for v in group]
    if len(pooled) < MIN_ROUNDS:
        return PairedRatio(statistics.median(pooled), None, None, len(pooled))
    rng = random.Random(SEED)
    medians = sorted(statistics.median([v for group in rng.choices(groups, k=len(groups))
                                        for v in rng.choices(group, k=len(group))]) for _ in range(RESAMPLES))
    tail = (1 - CONFIDENCE) / 2
    return PairedRatio(statistics.median(pooled), medians[int(tail * RESAMPLES)],
                       medians[min(RESAMPLES - 1, int((1 - tail) * RESAMPLES))], len(pooled))


def verdict(ratio: PairedRatio, target: float, low_floor: float | None = None) -> str:
    """"met" when the interval's lower end is at or above ``target`` (or, given ``low_floor``, when the median is
    and the lower end is at or above ``low_floor``); "NOT met" when its upper end is below ``target``; "not
    resolved" when the interval straddles it; "too few rounds" (no verdict) without an interval."""
    if ratio.low is None:
        return "too few rounds"
    if ratio.low >= target or (low_floor is not None and ratio.median >= target and ratio.low >= low_floor):
        return "met"
    return "NOT met" if ratio.high < target else "not resolved"


def csv_row(variant: str, reference: str | None, tokens_per_s: float, ratio: PairedRatio) -> dict:
    """A row's figures keyed as ``CSV_COLUMNS`` (``mfu`` None: the bench adds it where it has one)."""
    return {"variant": variant, "reference": reference, "tokens_per_s": tokens_per_s, "ratio": ratio.median,
            "ratio_ci_low": ratio.low, "ratio_ci_high": ratio.high, "rounds": ratio.rounds, "mfu": None}


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    """``rows`` (dicts with at least ``CSV_COLUMNS``' keys) to ``path``, one line per row, under its headers."""
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(CSV_COLUMNS.values())
        writer.writerows([row[key] for key in CSV_COLUMNS] for row in rows)
