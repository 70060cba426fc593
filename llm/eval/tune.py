"""``compare --tune KEY``: each variant at its own best value of KEY, not at one value for all.

The runs of one variant (a row of ``llm.eval.grouping.group_runs`` with KEY left out of the grouping) fall into
points, one per value of the tuned keys. A point's loss is the mean final validation loss of its complete runs
(``RunRecord.complete``: a diverged or incomplete run never counts); the row takes the point with the lowest mean
among those where no run diverged (an lr that diverged for one seed is not a value to recommend, whatever its
other seeds reached), the means taken over the seeds those points share where they share any: like for like, so
that a value confirmed on more seeds, as the warnings below ask, is not judged on another draw of initialisations
than the values beside it. A best value at the edge of the grid (its smallest or largest
value) is only a bound, and is warned about. So is a best value that may sit at the edge of stability: one chosen
on a single seed, or one where a run spiked after warmup (``RunRecord.grad_norm_spike``). In the tuned replication
(docs/results/replicate-cpu-tuned) a one-seed grid chose lrs whose fresh seeds spiked, one grid step too high.
A key at one value in every run is no choice, and is warned about too.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llm.eval.runs import RunRecord
from llm.eval.stats import Summary

__all__ = ["TunePoint", "at_values", "choice_warnings", "choose", "edge_warning", "one_seed_warning",
           "scored", "shared_seeds", "spike_warnings", "tune_points", "values_of"]


@dataclass
class TunePoint:
    """The runs of one variant at one value of the tuned keys."""

    values: tuple[Any, ...]
    runs: list[RunRecord]

    @property
    def losses(self) -> list[float]:
        return [run.final_val_loss for run in self.runs if run.complete]

    @property
    def summary(self) -> Summary:
        return Summary.of(self.losses)

    def mean_over(self, seeds: set[int]) -> float:
        """The mean final validation loss of its complete runs of ``seeds``."""
        return statistics.fmean(run.final_val_loss for run in self.runs if run.complete and run.seed in seeds)

    @property
    def diverged(self) -> int:
        return sum(run.diverged for run in self.runs)

    @property
    def incomplete(self) -> int:
        return sum(run.status == "incomplete" for run in self.runs)


def values_of(run: RunRecord, keys: Sequence[str]) -> tuple[Any, ...]:
    """The run's values of ``keys`` (``RunRecord.setup``: ``compare_runs`` checks they are compared fields and
    leaves out a run where one changed on resume or was not recorded)."""
    return tuple(run.setup[key] for key in keys)


def at_values(keys: Sequence[str], values: Sequence[Any]) -> str:
    """``key = value, ...`` for a warning."""
    return ", ".join(f"{key} = {value}" for key, value in zip(keys, values, strict=True))


def tune_points(runs: Sequence[RunRecord], keys: Sequence[str]) -> list[TunePoint]:
    """``runs`` split by their values of ``keys``, in value order."""
    points: dict[tuple[Any, ...], list[RunRecord]] = {}
    for run in runs:
        points.setdefault(values_of(run, keys), []).append(run)
    return [TunePoint(values, points[values]) for values in sorted(points)]


def scored(points: Sequence[TunePoint]) -> list[TunePoint]:
    """The points ``choose`` chooses among: those with a complete run and no diverged one."""
    return [point for point in points if point.losses and not point.diverged]


def shared_seeds(points: Sequence[TunePoint]) -> set[int]:
    """The seeds with a complete run at every scored point: those ``choose`` compares the points on (none where no
    point is scored)."""
    seeds = [{run.seed for run in point.runs if run.complete} for point in scored(points)]
    return set.intersection(*seeds) if seeds else set()


def choose(points: Sequence[TunePoint]) -> TunePoint | None:
    """The point with the lowest mean final validation loss where no run diverged, over the seeds all such points
    share (over each point's own where they share none); None when there is none."""
    candidates, shared = scored(points), shared_seeds(points)
    return min(candidates, key=lambda point: point.mean_over(shared) if shared else point.summary.mean,
               default=None)


def choice_warnings(label: str, points: Sequence[TunePoint], best: TunePoint | None, keys: Sequence[str]
                    ) -> list[str]:
    """``edge_warning`` and ``spike_warnings`` about row ``label``'s choice ``best``; without one, why: no complete
    run at any value, or a diverged run beside the complete ones at each."""
    if best is not None:
        return [*filter(None, [edge_warning(label, points, best, keys)]), *spike_warnings(label, best, keys)]
    complete = "; ".join(at_values(keys, point.values) for point in points if point.losses)
    return [f"row {label}: " + (f"no {', '.join(keys)} tried was stable in every seed: each value with a complete run "
                                f"({complete}) has a diverged one too; no value chosen" if complete else
                                "no complete run at any value") + "; compared without it"]


def edge_warning(label: str, points: Sequence[TunePoint], best: TunePoint, keys: Sequence[str]) -> str | None:
    """A warning when ``best`` takes the smallest or largest tried value of a key with 3 or more values."""
    for i, key in enumerate(keys):
        grid = sorted({point.values[i] for point in points})
        if len(grid) >= 3 and best.values[i] in (grid[0], grid[-1]):
            side = "smallest" if best.values[i] == grid[0] else "largest"
            return (f"row {label}: the best {key} = {best.values[i]} is the {side} value tried: the optimum may lie "
                    f"beyond the grid; extend it")
    return None


def one_seed_warning(points: dict[str, list[TunePoint]], chosen: dict[str, TunePoint | None], keys: Sequence[str]
                     ) -> str | None:
    """One warning naming the rows whose chosen value rests on a single seed: one complete run, or one seed shared
    with the other values (row label -> its points, and its choice)."""
    rows = [label for label, best in chosen.items()
            if best is not None and len(shared_seeds(points[label]) or best.losses) == 1]
    if not rows:
        return None
    return (f"{'row' if len(rows) == 1 else 'rows'} {', '.join(rows)}: the chosen {', '.join(keys)} rests on one "
            f"seed; a one-seed grid can choose a value at the edge of stability: confirm it and the next smaller "
            f"value on 2 or more seeds")


def spike_warnings(label: str, best: TunePoint, keys: Sequence[str]) -> list[str]:
    """A warning for each run of ``best`` that spiked after warmup (``RunRecord.grad_norm_spike``): its value may
    be at the edge of stability, and its loss a draw that fresh seeds do not repeat."""
    at = at_values(keys, best.values)
    warnings = []
    for run in best.runs:
        if (spike := run.grad_norm_spike) is not None:
            step, norm, ratio = spike
            warnings.append(f"row {label}: at the chosen {at}, {run.path.name} spiked after warmup (pre-clip "
                            f"gradient norm {norm:.3g} at step {step}, {ratio:.0f}x the norms logged before it): the "
                            f"value may be at the edge of stability; compare it with the next smaller value")
    return warnings
