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

from llm.config import RunConfig, read_saved, save_config
from llm.eval.compare import Comparison, VariantSummary
from llm.eval.errors import EvalError
from llm.eval.stats import ALPHA, MAX_SEEDS, POWER, Array, paired_p_value

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


def stein_resolves(gap: Array, threshold: Array, undecided: Array = False) -> Array:
    """Stein's final verdict: the mean gap over exactly the planned seeds lies beyond the plan's ``threshold`` (the
    decision compare prints for a planned row, and the one the simulation in the tests runs, replicate by replicate);
    never where a planned seed diverged (``undecided``: ``llm.eval.planned``). Those resolved are a subset of the
    draws that would resolve had the seed not diverged (its loss is then the one it would have had), so the rule
    keeps Stein's Type I error at most ALPHA whatever makes a seed diverge."""
    return ~np.asarray(undecided) & (np.abs(gap) > threshold)


def plan_pilots(gap: float, pilots: dict[str, dict[int, float]], baseline: str) -> dict[str, tuple[str, float, float]]:
    """Row label -> its design, seeds per arm and threshold for ``gap`` (module docstring), from the pilots' seed:loss
    pairs of a baseline (``pilots[baseline]``) and of the rows compared with it: what ``--plan`` writes and
    ``--planned`` recomputes from plan.csv alone. Rows pair where they ran the baseline's seeds and their differences
    vary (``paired_p_value``), as compare pairs them; the baseline first, with the most seeds any paired row needs."""
    base, found = pilots[baseline], {}
    for label, losses in ((label, losses) for label, losses in pilots.items() if label != baseline):
        # the sample SD squared, as the table's std is: plans written before plan_pilots existed verify bit for bit
        variances = (statistics.stdev(losses.values()) ** 2, statistics.stdev(base.values()) ** 2)
        mine, theirs = list(losses.values()), [base.get(seed, math.nan) for seed in losses]
        paired = losses.keys() == base.keys() and not math.isnan(paired_p_value(mine, theirs))
        difference = statistics.variance([a - b for a, b in zip(mine, theirs, strict=True)]) if paired else math.nan
        paired, seeds = design(gap, (len(losses), len(base)), variances, difference)
        found[label] = (bool(paired), float(seeds) if seeds <= MAX_SEEDS else math.inf, variances, difference)
    most = max([len(base), *(seeds for _, seeds, *_ in found.values() if math.isfinite(seeds))])
    plans = {baseline: ("baseline", float(most), math.nan)}
    for label, (paired, seeds, variances, difference) in found.items():
        seeds = most if paired and math.isfinite(seeds) else seeds
        plans[label] = ("paired" if paired else "Welch", seeds, float(threshold(
            paired, (len(pilots[label]), len(base)), (seeds, most), variances, difference)) if seeds <= MAX_SEEDS
            else math.nan)
    return plans


def plan_cells(design: str, seeds_per_arm: float, threshold: float, pilot: int) -> dict[str, str]:
    """plan.csv's derived columns of a row planned so from a pilot of ``pilot`` seeds, as ``--plan`` writes them and
    ``--planned`` requires them."""
    more = 0 if math.isinf(seeds_per_arm) else int(seeds_per_arm) - pilot
    return {"design": design, "pilot_seeds": str(pilot), "seeds_per_arm": f"{seeds_per_arm:g}",
            "more_seeds": str(more), "threshold": "" if math.isnan(threshold) else repr(threshold)}


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
        return int(plan_cells(self.design, self.seeds_per_arm, self.threshold, self.row.n)["more_seeds"])


def plan_seeds(comparison: Comparison, gap: float) -> list[RowPlan]:
    """Each baseline, then each row compared with it (``VariantSummary.baseline``, whose seeds mean what the
    baseline's do) whose gap can be tested (2 or more seeds each, losses that vary: ``Gap.se`` > 0), planned for
    ``gap`` (``plan_pilots``). A row or baseline that ran a seed twice is refused: a repeat is no independent seed."""
    if not 0 < gap < math.inf:
        raise EvalError(f"--plan {gap}: expected a finite gap > 0 nats (the smallest worth detecting)")
    plans = []
    for base in (row for row in comparison.rows if row.variant in comparison.baselines):
        rows = {row.variant: row for row in [base, *comparison.rows]
                if row is base or (row.baseline == base.variant and row.gap and row.gap.se > 0)}
        for row in rows.values():
            if len(seeds := [run.seed for run in row.runs]) > len(set(seeds)):
                raise EvalError(f"--plan: row {row.variant} ran seed {next(s for s in seeds if seeds.count(s) > 1)} "
                                "more than once; a repeat is no independent seed: compare without all but one")
        pilots = {label: {run.seed: run.final_val_loss for run in row.runs} for label, row in rows.items()}
        plans += [RowPlan(rows[label], design_, seeds, base.variant, threshold_)
                  for label, (design_, seeds, threshold_) in plan_pilots(gap, pilots, base.variant).items()]
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


PLANS_FILE = "plans.tsv"
"""In a folder the plan trains runs into: one line per plan, its plan.csv and the seeds it added there."""


def _planned_here(folder: Path) -> list[tuple[str, set[int]]]:
    """The plans that added seeds to run folder ``folder`` (``PLANS_FILE``), each with those seeds."""
    lines = (folder / PLANS_FILE).read_text().splitlines() if (folder / PLANS_FILE).is_file() else []
    return [(plan, {int(seed) for seed in seeds.split() if seed.isdigit()})
            for plan, _, seeds in (line.partition("\t") for line in lines)]


def write_plan(comparison: Comparison, plans: list[RowPlan], gap: float, out: str | Path) -> tuple[str, list[Path]]:
    """The ``plans`` for ``gap`` as text, and the files written under ``out``: plan.csv (each row's baseline, its
    planned seed numbers and its pilot as seed:loss) and, when seeds are missing, plan-sweep.yaml
    (``launch/sweep.py``) with one config under plan-configs/ per new run: the row's saved config at a seed no run of
    the comparison has used, data paths absolute, its run directory beside the row's first run's."""
    out = Path(out)
    again = (out / "plan.csv").exists()
    runs = [run for row in comparison.rows for run in row.runs]
    earlier = sorted(({str(run.meta["config"].get("planned_by") or "") for run in runs}  # trained from its config
                      | {plan for run in runs for plan, seeds in _planned_here(run.path.parent) if run.seed in seeds})
                     - {""})  # plans whose seeds are among the pilot's, by the configs or by the seeds it added
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
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows({"variant": p.row.variant, "baseline": p.baseline, "gap": repr(gap),
                          **plan_cells(p.design, p.seeds_per_arm, p.threshold, p.row.n),
                          "seeds": " ".join(map(str, [*(run.seed for run in p.row.runs),
                                                      *range(first, first + p.more_seeds)])),
                          "pilot": " ".join(f"{run.seed}:{run.final_val_loss!r}" for run in p.row.runs)} for p in plans)
    files = {name: str((out / "plan-configs" / f"{name}.yaml").resolve()) for _, _, name in new}
    for pilot, seed, name in new:
        save_config(replace(_absolute(read_saved(pilot.meta["config"])), seed=seed, name=name,
                            out_dir=str(pilot.path.parent.resolve()), planned_by=str((out / "plan.csv").resolve())),
                    files[name])
    for folder in {pilot.path.parent for pilot, *_ in new}:  # so that seeds trained by hand are known as planned too
        with (folder / PLANS_FILE).open("a") as f:
            seeds = " ".join(str(seed) for pilot, seed, _ in new if pilot.path.parent == folder)
            f.write(f"{(out / 'plan.csv').resolve()}\t{seeds}\n")
    planned = {p.row.variant for p in plans}
    text = [f"plan for a {gap:g}-nat gap at {POWER:.0%} power ({ASSUMPTION}):", *(
        f"  {p.row.variant}: {p.design}, {p.row.n} pilot seeds -> " + (f"over {MAX_SEEDS} per arm: not launched"
        if math.isinf(p.seeds_per_arm) else f"{p.seeds_per_arm:g} per arm ({p.more_seeds} more)" + (
            "" if math.isnan(p.threshold) else f", resolved if |final gap| > {p.threshold:.4f}")) for p in plans),
        *(f"  {row.variant}: not planned (" + (f"not compared: {row.not_compared}" if row.not_compared else
          "fewer than 2 seeds, or losses that do not vary, in it or its baseline") + ")"
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
