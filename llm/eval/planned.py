"""``eval.py compare --planned plan.csv``: a finished plan decided exactly as it was made (``llm.eval.plan``).

A plan verifies itself before it decides anything. Of plan.csv's columns only the labels (``variant``,
``baseline``), the ``gap`` and the ``pilot``'s seed:loss pairs are inputs; every other one is derived from them, and
is recomputed here by the code ``--plan`` wrote it with (``plan_pilots``, ``plan_cells``). A file whose ``design``,
``pilot_seeds``, ``seeds_per_arm``, ``more_seeds`` or ``threshold`` is not what its own pilot gives, whose ``seeds``
are not the pilot's followed by the plan's new seeds (one run of numbers for every row, above every pilot seed,
``seeds_per_arm`` in all), that holds several gaps, plans a row twice or lacks one whose runs were trained from it
(``planned_by``) is refused in one line naming the line, the column and what it should be. Whatever the file says,
the verdict uses the recomputed threshold and exactly the planned seeds.

A planned seed that diverged is an outcome, not a missing seed: Stein's test is the mean over exactly the planned
seeds, and a diverged seed has no loss to average. Leaving it out would choose the seeds by their outcome (the
survivors of a variant that diverges where it trains badly look better than it is), and so would replacing it.
Such a row (and every row planned against a baseline whose planned seed diverged) is reported "not decidable
(Stein)", naming the seed, with the divergence counted in its row: what the study establishes is how often the
variant diverged, not its loss (docs/comparison.md, "A planned seed that diverged"). A planned seed that is
incomplete, ran with another config or is not among the runs is refused, naming which and why.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from llm.eval.compare import Comparison, VariantSummary
from llm.eval.errors import EvalError
from llm.eval.plan import plan_cells, plan_pilots
from llm.eval.runs import RunRecord

__all__ = ["apply_plan", "read_plan"]


def _refuse(plan_csv: str | Path, line: int, entry: dict[str, str], column: str, expected: str) -> EvalError:
    """The error naming the file, line and column of a plan.csv field that is not what ``expected`` says."""
    return EvalError(f"--planned {plan_csv}: line {line}, column {column}: expected {expected}, got "
                     f"{entry.get(column)!r} (a plan.csv as compare --plan writes it)")


def _field(plan_csv: str | Path, line: int, entry: dict[str, str], column: str, parse: Callable[[str], Any],
           expected: str) -> Any:
    """``entry[column]`` parsed, or an EvalError naming the file, line and column."""
    try:
        return parse(entry[column])
    except (ValueError, TypeError, KeyError):
        raise _refuse(plan_csv, line, entry, column, expected) from None


def _checked(value: Any, ok: bool) -> Any:
    """``value`` where ``ok``; else a ValueError, which ``_field`` turns into the line naming the column."""
    if not ok:
        raise ValueError(value)
    return value


def _pilot(text: str) -> dict[int, float]:
    pairs = [(int(seed), float(loss)) for seed, loss in (pair.split(":") for pair in text.split())]
    return _checked(dict(pairs), len(dict(pairs)) == len(pairs) >= 2)


def read_plan(plan_csv: str | Path) -> list[dict[str, Any]]:
    """plan.csv's rows, each verified against its own pilot (module docstring), with its recomputed ``design``,
    ``seeds_per_arm`` and ``threshold``; an EvalError naming the file, line and column otherwise."""
    try:
        with open(plan_csv, newline="") as f:
            entries = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise EvalError(f"--planned {plan_csv}: cannot be read ({err})") from None
    if not entries:
        raise EvalError(f"--planned {plan_csv}: no planned rows (a plan.csv as compare --plan writes it)")
    rows = []
    for line, entry in enumerate(entries, start=2):
        field = partial(_field, plan_csv, line, entry)
        rows.append({"line": line, "variant": field("variant", lambda text: _checked(text, text != ""), "a row label"),
                     "baseline": field("baseline", lambda text: _checked(text, text != ""), "the baseline's row label"),
                     "gap": field("gap", lambda text: _checked(float(text), 0 < float(text) < math.inf),
                                  "the planned gap > 0"),  # NaN is not > 0
                     "pilot": field("pilot", _pilot, "the pilot's seed:loss pairs, 2 or more, each seed once"),
                     "seeds": field("seeds", lambda text: _checked((seeds := [int(s) for s in text.split()]),
                                                                   len(set(seeds)) == len(seeds)),
                                    "seed numbers, each once")})
    # every row's new seeds: one run of numbers from one seed (compare --plan's first unused one), above every pilot's
    first = next((row["seeds"][len(row["pilot"])] for row in rows if len(row["seeds"]) > len(row["pilot"])), 0)
    above = first > max(seed for row in rows for seed in row["pilot"])
    for row, entry in zip(rows, entries, strict=True):
        refuse = partial(_refuse, plan_csv, row["line"], entry)
        if (twice := [other["line"] for other in rows if other["variant"] == row["variant"]])[0] != row["line"]:
            raise EvalError(f"--planned {plan_csv}: line {row['line']}: row {row['variant']} is planned twice "
                            f"(lines {twice[0]} and {row['line']}); a plan plans each row once")
        if row["gap"] != rows[0]["gap"]:
            raise refuse("gap", f"{rows[0]['gap']!r}, the plan's one gap (line 2)")
        group = {other["variant"]: other["pilot"] for other in rows if other["baseline"] == row["baseline"]}
        if row["baseline"] not in group:
            raise EvalError(f"--planned {plan_csv}: line {row['line']}: its baseline {row['baseline']} has no row "
                            "(its pilot decides the plan)")
        row["design"], row["seeds_per_arm"], row["threshold"] = plan_pilots(row["gap"], group, row["baseline"])[
            row["variant"]]
        cells = plan_cells(row["design"], row["seeds_per_arm"], row["threshold"], len(row["pilot"]))
        if wrong := next((column for column, value in cells.items() if entry.get(column) != value), None):
            raise refuse(wrong, f"{cells[wrong] or 'empty'} (what --plan computes from this row's gap and pilot)")
        seeds = [*row["pilot"], *range(first, first + int(cells["more_seeds"]))]
        if row["seeds"] != seeds or (not above and len(seeds) > len(row["pilot"])):
            raise refuse("seeds", f"the pilot's seeds, then the plan's {cells['more_seeds']} new ones, one run of "
                                  f"numbers above every pilot seed ({' '.join(map(str, seeds))})")
    return rows


def _differs(run: RunRecord, other: RunRecord) -> str:
    return ", ".join(f"{key}={run.setup.get(key)}" for key in sorted(run.setup)
                     if run.setup.get(key) != other.setup.get(key) and key != "seed") or "its run"


def _missing(seed: int, row: VariantSummary, everyone: list[RunRecord]) -> str:
    """Why ``row`` has no complete run of ``seed``: it diverged, it is incomplete, it ran with another config (and
    how that run ended), or no run of it is among those compared."""
    mine = [*row.runs, *row.diverged, *row.incomplete]
    if diverged := [run for run in row.diverged if run.seed == seed]:
        return f"seed {seed} diverged ({diverged[0].path.name})"
    if incomplete := [run for run in row.incomplete if run.seed == seed]:
        return f"seed {seed} is incomplete ({incomplete[0].path.name}: finish it)"
    if elsewhere := [run for run in everyone if run.seed == seed and run not in mine
                     and run.variant == mine[0].variant]:
        return (f"seed {seed} ran with another config ({_differs(elsewhere[0], mine[0])})"
                + ("" if elsewhere[0].complete else f" and is {elsewhere[0].status}"))
    return f"no run of seed {seed} is among the compared runs"


def _row_of(comparison: Comparison, name: str, pilot: dict[int, float]) -> VariantSummary | None:
    """Planned row ``name``: the row of that label, or of that label and a field that tells it apart from a row of
    another config (a run of it relabels both), holding the most of its pilot."""
    rows = [row for row in comparison.rows if row.variant == name or row.variant.startswith(f"{name} (")]
    held = {row.variant: sum(run.final_val_loss == pilot.get(run.seed) for run in row.runs) for row in rows}
    return max(rows, key=lambda row: (held[row.variant], row.variant == name), default=None)


def apply_plan(comparison: Comparison, plan_csv: str | Path) -> list[RunRecord]:
    """``compare --planned plan.csv``: each planned row's verdict becomes Stein's final test
    (``Gap.stein_threshold``) on exactly its planned seeds, or "not decidable" where a planned seed diverged
    (module docstring). Refused in one line, naming the cause: plan.csv not what its own pilot gives
    (``read_plan``), a row or a planned seed missing, one in a row of another config, a changed pilot, another
    baseline. Returns the complete runs of planned rows that the plan did not plan (to compare again without them;
    each named in a warning)."""
    everyone = [run for row in comparison.rows for run in [*row.runs, *row.diverged, *row.incomplete]]
    left_out, decided, diverged = [], [], {}
    for entry in read_plan(plan_csv):
        name, pilot = entry["variant"], entry["pilot"]
        if (row := _row_of(comparison, name, pilot)) is None:
            raise EvalError(f"--planned {plan_csv}: its row {name!r} is not among the compared rows")
        if (baseline := row.variant if row.variant in comparison.baselines else row.baseline) != entry["baseline"]:
            raise EvalError(f"--planned {plan_csv}: {name} was planned against {entry['baseline']}, and " + (
                f"its seeds now mean other things than its baseline's ({row.not_compared})" if row.not_compared else
                f"is compared against {baseline or 'none'}; compare with --baseline {entry['baseline']}"))
        losses = {run.seed: run.final_val_loss for run in row.runs}
        if changed := [seed for seed, loss in pilot.items() if losses.get(seed) != loss]:
            now = losses[changed[0]] if changed[0] in losses else _missing(changed[0], row, everyone)
            raise EvalError(f"--planned {plan_csv}: {name}'s pilot changed (seed {changed[0]}: planned at loss "
                            f"{pilot[changed[0]]!r}, now {now})")
        if len(losses) < row.n:
            raise EvalError(f"--planned {plan_csv}: {name} ran a seed more than once; a repeat is no independent seed")
        decided.append((row, entry))
        planned = [] if math.isinf(entry["seeds_per_arm"]) else entry["seeds"]
        missing = {seed: _missing(seed, row, everyone) for seed in planned if seed not in losses}
        if any(not any(run.seed == seed for run in row.diverged) for seed in missing):
            raise EvalError(f"--planned {plan_csv}: {name} has {len(planned) - len(missing)} of its {len(planned)} "
                            f"planned seeds complete ({'; '.join(missing.values())}), and Stein's final test needs "
                            "them all")
        diverged[name] = list(missing.values())  # each one diverged
        left_out += [run for run in row.runs if run.seed not in entry["seeds"]]
    plan, planned_runs = str(Path(plan_csv).resolve()), {id(run) for row, _ in decided
                                                         for run in [*row.runs, *row.diverged, *row.incomplete]}
    if stray := [run for run in everyone if run.meta["config"].get("planned_by") == plan
                 and id(run) not in planned_runs]:
        raise EvalError(f"--planned {plan_csv}: {stray[0].path.name} was trained from it (planned_by), and its row "
                        "is not in it; a plan.csv as compare --plan wrote it has that row")
    for row, entry in [] if left_out else decided:
        if row.gap is None or math.isnan(entry["threshold"]):
            continue
        undecided = "; ".join([*diverged[entry["variant"]], *(f"its baseline's {cause}"
                                                                for cause in diverged[entry["baseline"]])])
        if not undecided and (entry["design"] == "paired") == math.isnan(row.gap.p_paired):
            raise EvalError(f"--planned {plan_csv}: {entry['variant']} was planned {entry['design']}, and its seeds "
                            f"now {'do not pair' if entry['design'] == 'paired' else 'pair'} with its baseline's")
        row.gap = replace(row.gap, stein_threshold=entry["threshold"], planned_gap=entry["gap"], undecided=undecided)
    return left_out
