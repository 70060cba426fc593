"""The seeds each row needs to resolve a gap, planned from the seeds already run (``eval.py compare --plan GAP``).

The seeds run so far are a pilot: per row, the seeds per arm at which a true gap of GAP nats is resolved with
``POWER`` under the design its structure fixes before any loss is seen (``design``: paired where the row pairs with
its baseline, ``llm.eval.compare``; Welch otherwise), by Stein's two-stage rule: n >= ((t_{1-ALPHA/2,df} +
t_{POWER,df}) * s / GAP)^2 with the pilot's SD s and df its pilot seeds less one (Welch's: the smaller arm's). The
final test is Stein's too: the mean gap over exactly the planned seeds (pilot and new) resolves when beyond
``RowPlan.threshold``, t_{1-ALPHA/2,df} times the pilot's SD over sqrt(n). For normal seeds its Type I error is
ALPHA (Welch's: at most) and its power at least ``POWER`` whatever the pilot's spread, because the mean is
independent of the pilot's SD that set n; tests/eval/test_compare_plan_simulation.py simulates the procedure on a
grid of pilots, seed correlations and spreads. A row whose pilot already has the seeds needs no more.

The ordinary t-test on all seeds (compare's p-values) rejects a true gap of 0 too often after a plan: its spread
includes the pilot's, which set how many seeds there are. Stopping where the pilot's p-value is already below ALPHA
would add a second look. A paired row runs every seed its baseline runs (compare pairs only the same seeds), so the
baseline runs the most that any row of its size needs.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import yaml
from scipy import stats

from llm.config import read_saved, save_config
from llm.eval.compare import Comparison, VariantSummary
from llm.eval.errors import EvalError
from llm.eval.stats import ALPHA, MAX_SEEDS, POWER, Array

ASSUMPTION = ("assumes normal seed effects; Stein's rule: the pilot's t quantiles, not its SD taken as true; the final "
              "test is Stein's (the mean gap over all seeds beyond the threshold), not compare's p-value")


def stein_seeds(gap: float, variance: Array, df: Array) -> Array:
    """The fewest seeds per arm with (t_{1-ALPHA/2,df} + t_{POWER,df}) * sqrt(variance / n) <= gap."""
    return np.ceil((stats.t.isf(ALPHA / 2, df) + stats.t.isf(1 - POWER, df)) ** 2 * variance / gap**2)


def design(gap: float, pilot: tuple[int, int], variances: tuple[Array, Array], difference: Array = math.nan,
           ) -> tuple[Array, Array]:
    """Whether each pilot takes the paired design and its seeds per arm (at least the pilot's), from the pilot
    counts of a row and its baseline, their losses' variances and their differences' (NaN: they do not pair).
    The design is fixed by structure, paired wherever the rows pair: taking whichever the pilot's variances make
    cheaper takes the paired one exactly where the pilot underestimates the differences' spread (a true gap of 0
    rejected in 6-7% of pilots). Welch's counts take min(pilot) - 1 degrees of freedom, not Satterthwaite's, which
    are liberal at 2-3 pilot seeds and unequal spreads."""
    paired = ~np.isnan(difference)
    seeds = np.where(paired, stein_seeds(gap, difference, pilot[0] - 1),
                     stein_seeds(gap, sum(variances), min(pilot) - 1))
    return paired, np.maximum(pilot[0], seeds)


def threshold(paired: Array, pilot: tuple[int, int], seeds: tuple[Array, Array], variances: tuple[Array, Array],
              difference: Array = math.nan) -> Array:
    """Stein's final test: the mean gap over all ``seeds`` of the row and of its baseline resolves beyond this."""
    parts = (variances[0] / seeds[0], variances[1] / seeds[1])
    return np.where(paired, stats.t.isf(ALPHA / 2, pilot[0] - 1) * np.sqrt(difference / seeds[0]),
                    stats.t.isf(ALPHA / 2, min(pilot) - 1) * np.sqrt(sum(parts)))


@dataclass
class RowPlan:
    row: VariantSummary
    design: str
    """Paired, Welch, or baseline."""
    seeds_per_arm: float
    """Inf: over MAX_SEEDS, not launched."""
    threshold: float = math.nan

    @property
    def more_seeds(self) -> int:
        return 0 if math.isinf(self.seeds_per_arm) else int(self.seeds_per_arm) - self.row.n


def plan_seeds(comparison: Comparison, gap: float) -> list[RowPlan]:
    """Each baseline, then each row with a gap to it that can be tested (2 or more seeds each, losses that vary:
    ``Gap.se`` > 0), planned for ``gap`` (module docstring)."""
    if not 0 < gap < math.inf:
        raise EvalError(f"--plan {gap}: expected a finite gap > 0 nats (the smallest worth detecting)")
    plans = []
    for base in (row for row in comparison.rows if row.variant in comparison.baselines):
        theirs, found = {run.seed: run.final_val_loss for run in base.runs}, []
        for row in (row for row in comparison.rows if row.gap and row.gap.se > 0 and row.size == base.size):
            variances = (row.val_loss_std**2, base.val_loss_std**2)
            difference = math.nan if math.isnan(row.gap.p_paired) else \
                statistics.variance([run.final_val_loss - theirs[run.seed] for run in row.runs])
            paired, seeds = design(gap, (row.n, base.n), variances, difference)
            found.append((row, bool(paired), float(seeds) if seeds <= MAX_SEEDS else math.inf, variances, difference))
        most = max([base.n, *(seeds for _, paired, seeds, *_ in found if math.isfinite(seeds))])
        plans.append(RowPlan(base, "baseline", most))
        for row, paired, seeds, variances, difference in found:
            seeds = most if paired and math.isfinite(seeds) else seeds
            plans.append(RowPlan(row, "paired" if paired else "Welch", seeds, float(threshold(
                paired, (row.n, base.n), (seeds, most), variances, difference)) if seeds <= MAX_SEEDS else math.nan))
    return plans


def write_plan(comparison: Comparison, plans: list[RowPlan], gap: float, out: str | Path) -> tuple[str, list[Path]]:
    """The ``plans`` for ``gap`` as text, and the files written under ``out``: plan.csv and, when seeds are missing,
    plan-sweep.yaml (``launch/sweep.py``) with one config under plan-configs/ per new run: the row's saved config
    at a seed no run of the comparison has used, its run directory beside the row's first run's."""
    out = Path(out)
    first = 1 + max(run.seed for row in comparison.rows for run in [*row.runs, *row.diverged, *row.incomplete])
    new = []  # (the pilot run whose config it takes, seed, run name)
    for pilot, seeds in ((p.row.runs[0], range(first, first + p.more_seeds)) for p in plans if p.more_seeds):
        stem = pilot.path.name.removesuffix(str(pilot.seed))
        new += [(pilot, seed, f"{stem}{seed}" if stem != pilot.path.name else f"{stem}-s{seed}") for seed in seeds]
    if taken := [str(pilot.path.parent / name) for pilot, _, name in new if (pilot.path.parent / name).exists()]:
        raise EvalError(f"{taken[0]}: a run directory the plan would train into exists already")
    (out / "plan-configs" if new else out).mkdir(parents=True, exist_ok=True)
    with (out / "plan.csv").open("w", newline="") as f:
        csv.writer(f).writerows([["variant", "design", "pilot_seeds", "seeds_per_arm", "more_seeds", "threshold"],
                                 *([p.row.variant, p.design, p.row.n, f"{p.seeds_per_arm:g}", p.more_seeds,
                                    "" if math.isnan(p.threshold) else p.threshold] for p in plans)])
    files = {name: str((out / "plan-configs" / f"{name}.yaml").resolve()) for _, _, name in new}
    for pilot, seed, name in new:
        save_config(replace(read_saved(pilot.meta["config"]), seed=seed, name=name,
                            out_dir=str(pilot.path.parent.resolve())), files[name])
    text = [f"plan for a {gap:g}-nat gap at {POWER:.0%} power ({ASSUMPTION}):", *(
        f"  {p.row.variant}: {p.design}, {p.row.n} pilot seeds -> " + (f"over {MAX_SEEDS} per arm: not launched"
        if math.isinf(p.seeds_per_arm) else f"{p.seeds_per_arm:g} per arm ({p.more_seeds} more)" + (
            "" if math.isnan(p.threshold) else f", resolved if |final gap| > {p.threshold:.4f}")) for p in plans)]
    if files:
        (out / "plan-sweep.yaml").write_text(yaml.safe_dump({"name": f"plan-{gap:g}", "files": {"run": files},
                                                             "run_name": "{run}"}, sort_keys=False))
        text.append(f"the {len(files)} missing seeds: python launch/sweep.py {out / 'plan-sweep.yaml'} --mode local")
    return "\n".join(text), [out / "plan.csv", *([out / "plan-sweep.yaml"] if files else [])]


def apply_plan(comparison: Comparison, plan_csv: str | Path) -> None:
    """``compare --planned plan.csv``: each planned row's verdict becomes Stein's final test (``Gap.stein_threshold``),
    once every row of the plan has its planned seeds complete."""
    with open(plan_csv, newline="") as f:
        planned = list(csv.DictReader(f))
    rows = {row.variant: row for row in comparison.rows}
    for entry in planned:
        if (row := rows.get(entry["variant"])) is None:
            raise EvalError(f"--planned {plan_csv}: its row {entry['variant']!r} is not among the compared rows")
        if math.isfinite(seeds := float(entry["seeds_per_arm"])) and row.n < seeds:
            raise EvalError(f"--planned {plan_csv}: {entry['variant']} has {row.n} of its {seeds:g} planned seeds "
                            "complete, and Stein's final test needs them all")
        if entry["threshold"] and row.gap is not None:
            row.gap = replace(row.gap, stein_threshold=float(entry["threshold"]))
