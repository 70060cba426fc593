"""``compare --tune KEY``: each variant at its best value of KEY (issue 26's protocol).

The runs of one variant (a row of ``llm.eval.grouping.group_runs`` with KEY left out of the grouping) fall into
points, one per value of the tuned keys. A point's loss is the mean final validation loss of its complete runs
(``RunRecord.complete``: a diverged or incomplete run never counts); the row takes the point with the lowest mean
among those where no run diverged (an lr that diverged for one seed is not a value to recommend, whatever its
other seeds reached). A best value at the edge of the grid (its smallest or largest
value) is only a bound, and is warned about.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from llm.eval.runs import RunRecord

__all__ = ["TunePoint", "choose", "edge_warning", "tune_points"]


@dataclass
class TunePoint:
    """The runs of one variant at one value of the tuned keys."""

    values: tuple[Any, ...]
    runs: list[RunRecord]

    @property
    def losses(self) -> list[float]:
        return [run.final_val_loss for run in self.runs if run.complete]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.losses) if self.losses else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.losses) if len(self.losses) > 1 else math.nan

    @property
    def diverged(self) -> int:
        return sum(run.diverged for run in self.runs)


def tune_points(runs: Sequence[RunRecord], keys: Sequence[str]) -> list[TunePoint]:
    """``runs`` split by their values of ``keys`` (a key that is no config field is an AttributeError), in
    value order."""
    points: dict[tuple[Any, ...], list[RunRecord]] = {}
    for run in runs:
        points.setdefault(tuple(attrgetter(key)(run.config) for key in keys), []).append(run)
    return [TunePoint(values, points[values]) for values in sorted(points)]


def choose(points: Sequence[TunePoint]) -> TunePoint | None:
    """The point with the lowest mean final validation loss where no run diverged; None when there is none."""
    scored = [point for point in points if point.losses and not point.diverged]
    return min(scored, key=lambda point: point.mean) if scored else None


def edge_warning(label: str, points: Sequence[TunePoint], best: TunePoint | None, keys: Sequence[str]) -> str | None:
    """A warning when ``best`` takes the smallest or largest tried value of a key with 3 or more values."""
    if best is None:
        return None
    for i, key in enumerate(keys):
        grid = sorted({point.values[i] for point in points})
        if len(grid) >= 3 and best.values[i] in (grid[0], grid[-1]):
            side = "smallest" if best.values[i] == grid[0] else "largest"
            return (f"row {label}: the best {key} = {best.values[i]} is the {side} value tried: the optimum may lie "
                    f"beyond the grid; extend it")
    return None
