"""Paired ratios and their intervals: how sure a bench is of "row A runs at r x row B's speed".

Every round of a bench times every row once, so the rows of one round share the machine's state (load, clock,
thermals). The ratio of two rows is therefore taken *within* each round, ``baseline seconds / row seconds`` (the
row's tokens/s over the baseline's, both moving the same tokens), and only then summarised: the median of the
per-round ratios, with a 95% percentile-bootstrap interval of that median (resampling rounds with a fixed seed,
so the same times always print the same interval). A change in load between rounds cancels in each ratio; an
unpaired ratio of two best-of figures does not, and carries no statement of its noise.

A target is met only when the interval's lower end clears it (``verdict``); when the interval straddles it the
figures do not resolve it.

Also the one place that writes a bench's ``--csv``: one row per variant, ``CSV_COLUMNS``.
"""

from __future__ import annotations

import csv
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CONFIDENCE = 0.95
RESAMPLES = 10_000
SEED = 0
CSV_COLUMNS = ("variant", "tokens_per_s", "ratio", "ratio_ci_low", "ratio_ci_high", "rounds", "mfu")


@dataclass(frozen=True)
class PairedRatio:
    """The median over rounds of a row's per-round speed ratio to a baseline, with its bootstrap interval."""

    median: float
    low: float
    high: float
    rounds: int

    def __str__(self) -> str:
        return f"{self.median:.3f}x [{self.low:.3f}, {self.high:.3f}]"


def round_ratios(row_seconds: Sequence[float], baseline_seconds: Sequence[float]) -> list[float]:
    """Per round, the baseline's seconds over the row's: the row's speed over the baseline's (pass seconds per
    token where the rows' steps differ in tokens)."""
    if len(row_seconds) != len(baseline_seconds):
        raise ValueError(f"paired rounds differ in number: {len(row_seconds)} against {len(baseline_seconds)}")
    return [base / row for row, base in zip(row_seconds, baseline_seconds, strict=True)]


def bootstrap_medians(values: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED) -> list[float]:
    """The medians of ``resamples`` resamples (with replacement, of the same size) of ``values``, sorted."""
    rng = random.Random(seed)
    n = len(values)
    return sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))


def _percentile_interval(sorted_medians: Sequence[float], confidence: float) -> tuple[float, float]:
    """The percentile interval that holds ``confidence`` of the sorted bootstrap medians."""
    tail, n = (1 - confidence) / 2, len(sorted_medians)
    return sorted_medians[int(tail * n)], sorted_medians[min(n - 1, int((1 - tail) * n))]


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                    seed: int = SEED) -> PairedRatio:
    """The median of ``values`` and the percentile-bootstrap ``confidence`` interval of the median."""
    if not values:
        raise ValueError("no rounds to summarise")
    return PairedRatio(statistics.median(values), *_percentile_interval(bootstrap_medians(values, resamples, seed),
                                                                        confidence), len(values))


def paired_ratio(row_seconds: Sequence[float], baseline_seconds: Sequence[float]) -> PairedRatio:
    """``row``'s speed over ``baseline``'s, paired per round: median and 95% interval."""
    return median_interval(round_ratios(row_seconds, baseline_seconds))


def grouped_interval(groups: Sequence[Sequence[float]], confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                     seed: int = SEED) -> PairedRatio:
    """The median of every group's values pooled, and a two-stage bootstrap interval of it: each resample draws
    the groups with replacement, then each drawn group's values with replacement (a cluster bootstrap).

    A group is one process pair's per-round ratios (bench_trees.py ``--processes``). An offset that stays with one
    process for its whole run (its memory placement, say) is the same in every round of its group, so resampling
    rounds alone would read it as signal; drawing the groups puts it into the interval. With two groups the
    interval spans about the two groups' medians.
    """
    if not groups or not all(groups):
        raise ValueError("no rounds to summarise (an empty group)")
    rng = random.Random(seed)

    def resample() -> float:
        return statistics.median([v for group in rng.choices(groups, k=len(groups))
                                  for v in rng.choices(group, k=len(group))])

    pooled = [v for group in groups for v in group]
    medians = sorted(resample() for _ in range(resamples))
    return PairedRatio(statistics.median(pooled), *_percentile_interval(medians, confidence), len(pooled))


def verdict(ratio: PairedRatio, target: float) -> bool | None:
    """True (met) when the interval's lower end is at or above ``target``; False (not met) when its upper end is
    below it; None (not resolved) when the interval straddles it."""
    if ratio.low >= target:
        return True
    if ratio.high < target:
        return False
    return None


VERDICTS = {True: "met", False: "NOT met", None: "not resolved"}


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    """``rows`` (dicts with at least ``CSV_COLUMNS``) to ``path``, one line per variant, columns in that order."""
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
