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
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy import stats

from llm.config import RunConfig, read_saved, save_config
from llm.eval.compare import Comparison, VariantSummary
from llm.eval.errors import EvalError
from llm.eval.runs import RunRecord
from llm.eval.stats import ALPHA, MAX_SEEDS, POWER, Array

ASSUMPTION = ("assumes normal seed effects; Stein's rule: the pilot's t quantiles, not its SD taken as true; the final "
              "test is Stein's (the mean gap over exactly the planned seeds beyond the threshold), not compare's "
              "p-value")


def stein_seeds(gap: float, variance: Array, df: Array) -> Array:
    """The fewest seeds per arm with (t_{1-ALPHA/2,df} + t_{POWER,df}) * sqrt(variance / n) <= gap."""
    # variance / gap / gap, not / gap**2: the square of a finite gap such as 1e308 overflows
    return np.ceil((stats.t.isf(ALPHA / 2, df) + stats.t.isf(1 - POWER, df)) ** 2 * (variance / gap) / gap)


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


def stein_resolves(gap: Array, threshold: Array) -> Array:
    """Stein's final verdict: the mean gap over exactly the planned seeds lies beyond the plan's ``threshold`` (the
    decision compare prints for a planned row, and the one the simulation in the tests runs, replicate by replicate)."""
    return np.abs(gap) > threshold


@dataclass
class RowPlan:
    row: VariantSummary
    design: str
    """Paired, Welch, or baseline."""
    seeds_per_arm: float
    """Inf: over MAX_SEEDS, not launched."""
    baseline: str
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
        plans.append(RowPlan(base, "baseline", most, base.variant))
        for row, paired, seeds, variances, difference in found:
            seeds = most if paired and math.isfinite(seeds) else seeds
            plans.append(RowPlan(row, "paired" if paired else "Welch", seeds, base.variant, float(threshold(
                paired, (row.n, base.n), (seeds, most), variances, difference)) if seeds <= MAX_SEEDS else math.nan))
    return plans


COLUMNS = ("variant", "baseline", "gap", "design", "pilot_seeds", "seeds_per_arm", "more_seeds", "threshold", "seeds",
           "pilot")


def _absolute(config: RunConfig) -> RunConfig:
    """``config`` with its local data and tokenizer paths absolute (as this directory resolves them), so that a
    sweep started from another directory trains on the pilot's data (a hub id, which is no local path, is kept)."""
    data = config.data
    local = {key: str(Path(value).resolve()) for key in ("source", "tokenizer")
             if (value := getattr(data, key)) and Path(value).exists()}
    return replace(config, data=replace(data, **local))


def write_plan(comparison: Comparison, plans: list[RowPlan], gap: float, out: str | Path) -> tuple[str, list[Path]]:
    """The ``plans`` for ``gap`` as text, and the files written under ``out``: plan.csv (each row's baseline, its
    planned seed numbers and its pilot as seed:loss) and, when seeds are missing, plan-sweep.yaml
    (``launch/sweep.py``) with one config under plan-configs/ per new run: the row's saved config at a seed no run of
    the comparison has used, data paths absolute, its run directory beside the row's first run's."""
    out = Path(out)
    again = (out / "plan.csv").exists()
    earlier = sorted({str(run.meta["config"].get("planned_by") or "") for row in comparison.rows for run in row.runs}
                     - {""})  # plans whose seeds are among the pilot's
    first = 1 + max(run.seed for row in comparison.rows for run in [*row.runs, *row.diverged, *row.incomplete])
    new = []  # (the pilot run whose config it takes, seed, run name)
    for pilot, seeds in ((p.row.runs[0], range(first, first + p.more_seeds)) for p in plans if p.more_seeds):
        stem = pilot.path.name.removesuffix(str(pilot.seed))
        new += [(pilot, seed, f"{stem}{seed}" if stem != pilot.path.name else f"{stem}-s{seed}") for seed in seeds]
    if len({name for *_, name in new}) < len(new):  # rows laid out as runs/a/s0 and runs/b/s0
        new = [(pilot, seed, f"{pilot.path.parent.name}-{name}") for pilot, seed, name in new]
    if len({name for *_, name in new}) < len(new):
        raise EvalError(f"{out}: the planned runs' names collide ({new[0][2]}...); give each row's runs its own name")
    if taken := [str(pilot.path.parent / name) for pilot, _, name in new if (pilot.path.parent / name).exists()]:
        raise EvalError(f"{taken[0]}: a run directory the plan would train into exists already")
    (out / "plan-configs" if new else out).mkdir(parents=True, exist_ok=True)
    with (out / "plan.csv").open("w", newline="") as f:
        csv.writer(f).writerows([COLUMNS, *([
            p.row.variant, p.baseline, gap, p.design, p.row.n, f"{p.seeds_per_arm:g}", p.more_seeds,
            "" if math.isnan(p.threshold) else p.threshold,
            " ".join(str(seed) for seed in [*(run.seed for run in p.row.runs), *range(first, first + p.more_seeds)]),
            " ".join(f"{run.seed}:{run.final_val_loss!r}" for run in p.row.runs)] for p in plans)])
    files = {name: str((out / "plan-configs" / f"{name}.yaml").resolve()) for _, _, name in new}
    for pilot, seed, name in new:
        save_config(replace(_absolute(read_saved(pilot.meta["config"])), seed=seed, name=name,
                            out_dir=str(pilot.path.parent.resolve()), planned_by=str((out / "plan.csv").resolve())),
                    files[name])
    planned = {p.row.variant for p in plans}
    text = [f"plan for a {gap:g}-nat gap at {POWER:.0%} power ({ASSUMPTION}):", *(
        f"  {p.row.variant}: {p.design}, {p.row.n} pilot seeds -> " + (f"over {MAX_SEEDS} per arm: not launched"
        if math.isinf(p.seeds_per_arm) else f"{p.seeds_per_arm:g} per arm ({p.more_seeds} more)" + (
            "" if math.isnan(p.threshold) else f", resolved if |final gap| > {p.threshold:.4f}")) for p in plans),
        *(f"  {row.variant}: not planned (fewer than 2 seeds, or losses that do not vary, in it or its baseline)"
          for row in comparison.rows if row.variant not in planned)]
    if again or earlier:
        why = (f"seeds of these runs were added by {', '.join(earlier)}" if earlier
               else f"{out / 'plan.csv'} existed and is replaced")
        text.append(f"note: {why}; planning again from seeds a plan added is a second look, which Stein's test does "
                    "not allow for")
    if files:
        (out / "plan-sweep.yaml").write_text(yaml.safe_dump({"name": f"plan-{gap:g}", "files": {"run": files},
                                                             "run_name": "{run}"}, sort_keys=False))
        text.append(f"the {len(files)} missing seeds: python launch/sweep.py {out / 'plan-sweep.yaml'} --mode local")
    return "\n".join(text), [out / "plan.csv", *([out / "plan-sweep.yaml"] if files else [])]


def _field(plan_csv: str | Path, line: int, entry: dict[str, str], column: str, parse: Callable[[str], Any],
           expected: str) -> Any:
    """``entry[column]`` parsed, or an EvalError naming the file, line and column."""
    try:
        return parse(entry[column])
    except (ValueError, TypeError, KeyError):
        raise EvalError(f"--planned {plan_csv}: line {line}, column {column}: expected {expected}, got "
                        f"{entry.get(column)!r} (a plan.csv as compare --plan writes it)") from None


def _label(text: str) -> str:
    if not text:
        raise ValueError(text)
    return text


def _design_name(text: str) -> str:
    if text not in ("baseline", "paired", "Welch"):
        raise ValueError(text)
    return text


def _positive(text: str, finite: bool = False) -> float:
    if not (value := float(text)) > 0 or (finite and math.isinf(value)):  # NaN is not > 0
        raise ValueError(text)
    return value


def _pilot(text: str) -> dict[int, float]:
    return {int(seed): float(loss) for seed, loss in (pair.split(":") for pair in text.split())}


def read_plan(plan_csv: str | Path) -> list[dict[str, Any]]:
    """plan.csv's rows, every field validated (an EvalError naming the file, line and column)."""
    try:
        with open(plan_csv, newline="") as f:
            entries = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise EvalError(f"--planned {plan_csv}: cannot be read ({err})") from None
    if not entries:
        raise EvalError(f"--planned {plan_csv}: no planned rows (a plan.csv as compare --plan writes it)")
    parsed = []
    for line, entry in enumerate(entries, start=2):
        field = partial(_field, plan_csv, line, entry)
        row = {"variant": field("variant", _label, "a row label"),
               "baseline": field("baseline", _label, "the baseline's row label"),
               "gap": field("gap", partial(_positive, finite=True), "the planned gap > 0"),
               "design": field("design", _design_name, "baseline, paired or Welch"),
               "seeds_per_arm": field("seeds_per_arm", _positive, "a number of seeds > 0, or inf"),
               "seeds": field("seeds", lambda t: [int(s) for s in t.split()], "seed numbers")}
        row["threshold"] = math.nan if row["design"] == "baseline" or math.isinf(row["seeds_per_arm"]) else field(
            "threshold", partial(_positive, finite=True), "a finite threshold > 0")
        row["pilot"] = field("pilot", _pilot, "the pilot's seed:loss pairs")
        parsed.append(row)
    return parsed


def _differs(run: RunRecord, other: RunRecord) -> str:
    return ", ".join(f"{key}={run.setup.get(key)}" for key in sorted(run.setup)
                     if run.setup.get(key) != other.setup.get(key) and key != "seed") or "its run"


def apply_plan(comparison: Comparison, plan_csv: str | Path) -> list[RunRecord]:
    """``compare --planned plan.csv``: each planned row's verdict becomes Stein's final test
    (``Gap.stein_threshold``) on exactly its planned seeds. Refused in one line: a row or a planned seed missing,
    one in a row of another config, a changed pilot, another baseline. Returns the complete runs of planned rows
    that the plan did not plan (to compare again without them; each named in a warning)."""
    rows = {row.variant: row for row in comparison.rows}
    losses_of = {row.variant: {run.seed: run.final_val_loss for run in row.runs} for row in comparison.rows}
    base_of = {row.size: row.variant for row in comparison.rows if row.variant in comparison.baselines}
    everyone = [run for row in comparison.rows for run in row.runs]
    left_out = []
    for entry in read_plan(plan_csv):
        name, pilot = entry["variant"], entry["pilot"]
        found = [variant for variant, losses in losses_of.items()
                 if all(losses.get(seed) == loss for seed, loss in pilot.items())]
        # relabelled by a run of another config: the row that holds its pilot
        variant = name if name in found else next((v for v in found if v.startswith(name)), name)
        if (row := rows.get(variant)) is None:
            raise EvalError(f"--planned {plan_csv}: its row {name!r} is not among the compared rows")
        if (baseline := base_of.get(row.size)) != entry["baseline"]:
            raise EvalError(f"--planned {plan_csv}: {name} was planned against {entry['baseline']}, and is "
                            f"compared against {baseline}; compare with --baseline {entry['baseline']}")
        losses = losses_of[row.variant]
        if changed := [seed for seed, loss in pilot.items() if losses.get(seed) != loss]:
            raise EvalError(f"--planned {plan_csv}: {name}'s pilot changed (seed {changed[0]}: planned at loss "
                            f"{pilot[changed[0]]!r}, now {losses.get(changed[0], 'missing')})")
        if math.isinf(entry["seeds_per_arm"]):
            continue
        for seed in (seed for seed in entry["seeds"] if seed not in losses):
            done = sum(seed in losses for seed in entry["seeds"])
            elsewhere = [run for run in everyone if run.seed == seed and run not in row.runs
                         and run.variant == row.runs[0].variant]
            why = f"; seed {seed} ran with another config ({_differs(elsewhere[0], row.runs[0])})" if elsewhere else ""
            raise EvalError(f"--planned {plan_csv}: {name} has {done} of its {len(entry['seeds'])} planned seeds "
                            f"complete (not seed {seed}), and Stein's final test needs them all{why}")
        left_out += [run for run in row.runs if run.seed not in entry["seeds"]]
        if not left_out and row.gap is not None and not math.isnan(entry["threshold"]):
            if (entry["design"] == "paired") == math.isnan(row.gap.p_paired):
                raise EvalError(f"--planned {plan_csv}: {name} was planned {entry['design']}, and its seeds now "
                                f"{'do not pair' if entry['design'] == 'paired' else 'pair'} with its baseline's")
            row.gap = replace(row.gap, stein_threshold=entry["threshold"], planned_gap=entry["gap"])
    return left_out
