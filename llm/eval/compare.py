"""Compare training runs: the rows of a table in the style of isogmlp Table 1, from each run's ``metrics.jsonl``.

Runs are grouped into rows of one configuration over seeds, and rows of one variant at several model sizes into
series (``llm.eval.grouping``); inside a row the seeds must agree on what the configuration implies
(``ROW_INVARIANTS``, the final token count), or it is an error. Only a row's complete runs
(``llm.eval.runs.RunRecord.status``) enter its statistics: a diverged or incomplete run is counted in its own
column and named in a warning, never averaged, tested or chosen. Each row's complete seeds give the final
validation loss as mean ± sample std (ddof=1) and its gap to the baseline row of the same model size
(``llm.eval.stats``: Welch's test, and the paired one where both rows ran the same seeds once each), where their
seeds mean one thing (``llm.eval.grouping.incomparable``); a row whose seeds mean another is listed with the
reason, with no gap.
"Training stability" is ``RunRecord.stability``, as in isogmlp section 4.3; lower is more stable. With ``tune``
keys (``eval.py compare --tune train.lr``) a row is its variant at its best value (``llm.eval.tune``). Rows of one
size that end at different token counts are still tabulated but produce a warning, and so does a run whose config
changed on resume (its row is labelled with the change, ``llm.eval.grouping``). The table: ``llm.eval.report``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llm.eval.errors import EvalError
from llm.eval.grouping import group_runs, incomparable, model_size, resolve_baseline, series_key, series_labels
from llm.eval.runs import NOT_RECORDED, RunRecord
from llm.eval.stats import Gap, Summary, gap_to_baseline
from llm.eval.tune import TunePoint, at_values, choice_warnings, choose, one_seed_warning, tune_points, values_of

DEFAULT_BASELINE = "swiglu+softmax"
# comparison.csv column -> the ``Gap`` field it holds (empty where the row has no gap or the field is NaN).
GAP_COLUMNS = {"gap": "gap", "gap_ci_low": "ci_low", "gap_ci_high": "ci_high", "p_value": "p_value",
               "p_value_paired": "p_paired", "paired_ci_low": "paired_ci_low", "paired_ci_high": "paired_ci_high",
               "mde": "mde", "paired_mde": "paired_mde", "seeds_needed": "seeds_needed",
               "paired_seeds_needed": "paired_seeds_needed", "seeds_for_target_gap": "target_seeds",
               "paired_seeds_for_target_gap": "paired_target_seeds"}
# Meta-row fields every seed of a row must agree on (besides the final token count). The meta row's
# ``variant`` is not among them: a run written with older option defaults may carry another name for the
# same configuration, and a row's name is computed from the configuration its seeds share.
ROW_INVARIANTS = ("params_total", "params_non_embedding", "mixed_precision")


@dataclass
class VariantSummary:
    """One row of the comparison table: a variant aggregated over its complete seeds."""

    variant: str
    runs: list[RunRecord]
    """The complete runs the statistics use (at the chosen values of the tuned keys)."""
    params_total: int | None
    params_non_embedding: int | None
    val_loss_mean: float
    """NaN when no run of the row is complete."""
    val_loss_std: float
    """Sample standard deviation (ddof=1) over seeds; NaN with a single seed."""
    training_stability: float
    tokens_per_s: float
    final_tokens: int
    diverged: list[RunRecord] = field(default_factory=list)
    incomplete: list[RunRecord] = field(default_factory=list)
    tuned: dict[str, Any] = field(default_factory=dict)
    """Tuned key -> the chosen value (``--tune``)."""
    series: str = ""
    """The label of the row's series: the rows that differ from it only in model size (``llm.eval.grouping``)."""
    size: tuple[Any, ...] = ()
    """The row's values of ``llm.eval.grouping.SIZE_KEYS``."""
    gap: Gap | None = None
    """Its gap to the baseline row of its size; None on a baseline row and when there is none."""
    key: str = ""
    """Its series' short name (``llm.eval.grouping.series_key``) where its label is more than its variant name."""
    baseline: str = ""
    """The label of the baseline row its gap is to; empty on a baseline row and where none is comparable."""
    not_compared: str = ""
    """Why no baseline row of its size is comparable (``llm.eval.grouping.incomparable``); empty otherwise."""

    @property
    def p_value(self) -> float:
        """Welch t-test of the final val losses against the baseline's; NaN when not computable."""
        return self.gap.p_value if self.gap else math.nan

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def seed_scope(self) -> str:
        """``run`` where the row's seeds set its data order too (``data.seed: run``), else ``init``; one per row, whose
        runs share the data section."""
        return "run" if [*self.runs, *self.diverged, *self.incomplete][0].config.data.seed == "run" else "init"

    def as_csv_row(self) -> dict[str, Any]:
        """The row for comparison.csv; an undefined (NaN) number is an empty cell."""
        row = {
            "variant": self.variant, **self.tuned, "n_seeds": self.n, "seeds": " ".join(str(r.seed) for r in self.runs),
            "diverged": len(self.diverged), "incomplete": len(self.incomplete), "params_total": self.params_total,
            "params_non_embedding": self.params_non_embedding, "val_loss_mean": self.val_loss_mean,
            "val_loss_std": self.val_loss_std, "final_tokens": self.final_tokens, "seed_scope": self.seed_scope,
            "training_stability": self.training_stability, "tokens_per_s": self.tokens_per_s,
            "not_compared": self.not_compared,
            **{column: math.nan if self.gap is None else getattr(self.gap, key) for column, key in GAP_COLUMNS.items()}}
        return {key: "" if isinstance(value, float) and math.isnan(value) else value for key, value in row.items()}


@dataclass
class Comparison:
    baseline: str
    """The baseline row's label, or its series' label when it has a row at several sizes (as given when no row
    has it: then there are no p-values)."""
    rows: list[VariantSummary]
    warnings: list[str] = field(default_factory=list)
    tune: tuple[str, ...] = ()
    sensitivity: dict[str, list[TunePoint]] = field(default_factory=dict)
    """With ``tune``: row label -> its loss at every value tried, in table order (the plots' colours follow it)."""
    baselines: tuple[str, ...] = ()
    """The labels of the baseline rows, one per model size, in table order."""
    target_gap: float | None = None
    """``compare --target-gap``: the gap whose seeds per arm each row reports (``Gap.target_seeds``)."""

    @property
    def groups(self) -> dict[str, list[RunRecord]]:
        """Row label -> the row's runs, in table order: what the plots draw, so they share the labels."""
        return {row.variant: row.runs for row in self.rows}


def _gap(done: Sequence[RunRecord], baseline: Sequence[RunRecord], target_gap: float | None) -> Gap:
    """The gap of complete runs ``done`` to the baseline's, whose seeds mean what theirs do
    (``llm.eval.grouping.incomparable``: one data order and validation set per seed), paired by seed where both ran
    the same seeds once each."""
    mine, theirs = ({run.seed: run.final_val_loss for run in runs} for runs in (done, baseline))
    paired = len(mine) == len(done) == len(baseline) and mine.keys() == theirs.keys()
    return gap_to_baseline(*(Summary.of([run.final_val_loss for run in runs]) for runs in (done, baseline)),
                           ([mine[s] for s in mine], [theirs[s] for s in mine]) if paired else None, target_gap)


def _mean(values: Sequence[float]) -> float:
    return Summary.of([v for v in values if not math.isnan(v)]).mean


def _shared(runs: Sequence[RunRecord], what: str, value: Any, label: str) -> Any:
    """``value(run)``, which every seed of row ``label`` must share; an EvalError naming the runs if not."""
    values = {run.path.name: value(run) for run in runs}
    if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
        found = ", ".join(f"{name}={v}" for name, v in values.items())
        raise EvalError(f"row {label}: runs with the same configuration differ in {what} ({found}); "
                        f"they cannot be seeds of one row")
    return next(iter(values.values()), None)


def _at_chosen_values(groups: dict[str, list[RunRecord]], tune: Sequence[str], warnings: list[str],
                      ) -> tuple[dict[str, tuple[list[RunRecord], dict[str, Any]]], dict[str, list[TunePoint]]]:
    """Row label -> its runs at the chosen values of the tuned keys and those values (all its runs and no values
    without ``tune``; its broken runs where no value can be chosen), and, with ``tune``, row label -> its loss at
    every value tried."""
    sensitivity: dict[str, list[TunePoint]] = {}
    chosen: dict[str, tuple[list[RunRecord], dict[str, Any]]] = {}
    bests: dict[str, TunePoint | None] = {}
    for label, members in groups.items():
        for key in ROW_INVARIANTS:
            _shared(members, key, lambda r, key=key: r.meta.get(key), label)
        if not tune:
            chosen[label] = (members, {})
            continue
        sensitivity[label] = points = tune_points(members, tune)
        bests[label] = best = choose(points)
        warnings += choice_warnings(label, points, best, tune)
        chosen[label] = ([r for r in members if not r.complete], {}) if best is None else \
            (best.runs, dict(zip(tune, best.values, strict=True)))  # no value to choose: its runs are listed
    if (one_seed := one_seed_warning(sensitivity, bests, tune)) is not None:
        warnings.append(one_seed)
    return chosen, sensitivity


def _resumed(runs: Sequence[RunRecord], tune: Sequence[str], warnings: list[str]) -> list[RunRecord]:
    """The runs to compare, with a warning in ``warnings`` for each whose config changed on resume: labelled with
    the change, or, where a tuned key changed or was not recorded, left out (a run tuned at no one value cannot be
    chosen)."""
    kept = []
    for run in runs:
        if unclear := [f"{k}={run.setup[k]}" for k in tune if k in run.changed or run.setup[k] == NOT_RECORDED]:
            warnings.append(f"{run.path.name}: --tune at {', '.join(unclear)}, no one value; left out")
            continue
        kept.append(run)
        if run.changed:
            resumes = ", ".join(str(step) for step, _ in run.segments[1:])
            warnings.append(f"{run.path.name}: its config changed on resume at step {resumes} "
                            f"({', '.join(f'{key}={run.setup[key]}' for key in run.changed)}): a row of its own, "
                            "labelled with the change, never pooled with runs of one configuration")
    return kept


def _left_out(label: str, run: RunRecord, tune: Sequence[str]) -> str:
    """The warning naming a broken run of row ``label`` (with ``tune``, at its values), which the statistics leave
    out."""
    at = f"{at_values(tune, values_of(run, tune))}, " if tune else ""
    last_eval = run.evals[-1]["step"] if run.evals else "none"
    return (f"row {label}: {run.path.name} {run.status} ({at}final eval at step {last_eval} of {run.last_step}, "
            f"val loss {run.final_val_loss:.4g}); left out of the statistics")


def compare_runs(runs: Sequence[RunRecord], baseline: str | None = None, tune: Sequence[str] = (),
                 target_gap: float | None = None) -> Comparison:
    """The comparison of ``runs`` (module docstring): the baseline rows first, then each series by size.
    ``baseline`` None: ``DEFAULT_BASELINE`` if present (a warning if not). ``target_gap``: each gap also reports
    the seeds per arm that gap needs at the rows' spreads. An EvalError when a ``baseline`` given names no row or
    rows of several series (``resolve_baseline``), or when the seeds of a row disagree on a ``ROW_INVARIANTS``
    field or its complete seeds on the final token count."""
    if not runs:
        raise EvalError("no runs to compare")
    if target_gap is not None and not 0 < target_gap < math.inf:
        raise EvalError(f"--target-gap {target_gap}: expected a finite gap > 0 nats (the smallest worth detecting)")
    if unknown := [key for key in tune if key not in runs[0].setup]:
        raise EvalError(f"--tune {unknown[0]}: not a config key that changes results (e.g. train.lr, model.ffn_init)")
    warnings = [problem for run in runs for problem in run.problems]
    if not (runs := _resumed(runs, tune, warnings)):
        raise EvalError("no runs to compare: " + "; ".join(warnings))
    groups = group_runs(runs, tune)
    series = series_labels(groups, tune)
    sizes = {label: model_size(members[0]) for label, members in groups.items()}
    if shared := [key for key in tune if len({values_of(run, [key]) for run in runs}) == 1]:
        warnings.append(f"--tune {', '.join(shared)}: every run has {at_values(shared, values_of(runs[0], shared))}: "
                        "one value is no choice; the rows are reported at it, untuned")
    baselines = resolve_baseline(groups, baseline or DEFAULT_BASELINE, series, tune)
    if not baselines and baseline is not None:
        raise EvalError(f"--baseline {baseline} names no row; the rows are: {', '.join(map(repr, groups))}")
    if not baselines:
        warnings.append(f"baseline {DEFAULT_BASELINE} is not among the rows ({', '.join(groups)}); no p-values")
    chosen, sensitivity = _at_chosen_values(groups, tune, warnings)
    complete_at: dict[tuple[Any, ...], list[RunRecord]] = {}
    for label, (members, _) in chosen.items():
        complete_at.setdefault(sizes[label], []).extend(run for run in members if run.complete)
    for complete in complete_at.values():
        if len({run.final_tokens for run in complete}) > 1:
            ends = ", ".join(f"{run.path.name}={run.final_tokens}" for run in complete)
            warnings.append(f"runs end at different token counts ({ends}): not a fair comparison")
    baseline_runs = {label: [r for r in chosen[label][0] if r.complete] for label in baselines}
    rows = []
    for label in sorted(chosen, key=lambda v: (v not in baselines, series[v], groups[v][0].meta.get(
            "params_non_embedding") or 0, v)):
        members, tuned = chosen[label]
        done = [r for r in members if r.complete]
        seeds = [r.seed for r in done]
        if len(set(seeds)) < len(seeds):
            warnings.append(f"row {label}: repeated seeds {seeds}; repeats are not independent samples")
        broken = [r for r in members if not r.complete]  # with tune: at the chosen value; all are named below
        warnings += [_left_out(label, run, tune) for run in groups[label] if not run.complete]
        if not done and not tune:  # with tune, _at_chosen_values says why no value was chosen
            warnings.append(f"row {label}: no complete run; compared without it")
        summary = Summary.of([r.final_val_loss for r in done])
        at_size = [] if label in baselines or not done else [b for b in baselines if sizes[b] == sizes[label]]
        reasons = {b: incomparable(done, baseline_runs[b]) for b in at_size}  # each baseline's, once
        base = next((b for b in at_size if not reasons[b]), None)
        if why := reasons[at_size[0]] if at_size and base is None else "":
            warnings.append(f"row {label}: not compared with {at_size[0]}: their seeds mean different things "
                            f"({why}); no gap, p-value or plan")
        rows.append(VariantSummary(
            variant=label, runs=done, params_total=groups[label][0].meta.get("params_total"),
            params_non_embedding=groups[label][0].meta.get("params_non_embedding"), val_loss_mean=summary.mean,
            val_loss_std=summary.std, training_stability=_mean([r.stability for r in done]),
            tokens_per_s=_mean([r.tokens_per_s for r in done]),
            final_tokens=_shared(done, "final token count", lambda r: r.final_tokens, label) or 0,
            diverged=[r for r in broken if r.diverged], incomplete=[r for r in broken if not r.diverged],
            tuned=tuned, series=series[label], size=sizes[label],
            gap=_gap(done, baseline_runs[base], target_gap) if base and baseline_runs[base] else None,
            key="" if label == groups[label][0].variant else series_key(groups[label][0], tune), baseline=base or "",
            not_compared=why))
    shown = (baselines[0] if len(baselines) == 1 else series[baselines[0]] if len({series[b] for b in baselines}) == 1
             else baseline or DEFAULT_BASELINE)
    return Comparison(baseline=shown, rows=rows, warnings=warnings, tune=tuple(tune),
                      sensitivity={row.variant: sensitivity[row.variant] for row in rows if tune},  # table order
                      baselines=tuple(row.variant for row in rows if row.variant in baselines), target_gap=target_gap)
