"""Compare training runs: a table in the style of isogmlp Table 1 from each run's ``metrics.jsonl``.

Runs are grouped by their whole configuration except the seed: the ``model``, ``data`` and ``train``
sections of the meta row's ``config`` must be identical for two runs to share a row, so an ablation
(``iso_ln[layernorm=false]``), a run with another learning rate or one without document masking is never pooled
with its parent. The sections are compared as today's code reads them back (``llm.config.read_saved``, as for
resuming or evaluating a run): fields added since a run was written take today's defaults, and a run from before
``ffn_init`` existed reads as ``ffn_init=paper`` with the options its variant did not read at today's
defaults, so an old and a new run of the same effective configuration share a row. A row is labelled by
its variant name (today's name for that configuration), which carries every non-default variant option;
rows whose variant names coincide but whose configurations differ are labelled with the fields that tell
them apart, e.g. ``swiglu+softmax (train.lr=0.001)``. Inside a row the seeds must also agree on what the
configuration implies (parameter counts, precision, final token count): a disagreement is an error.

Only a row's complete runs (``llm.eval.runs.RunRecord.status``) enter its statistics: a diverged run (a
non-finite final validation loss) or an incomplete one (ended before its last eval) is counted in its own
column and named in a warning, never averaged, tested or chosen. Each row's complete seeds give the final
validation loss as mean ± sample std (ddof=1) and a Welch t-test (unequal variances) against the baseline row.
"Training stability" is the variance of the pre-clip global gradient norm over the run after warmup
(``grad_norm_var_run`` of the last train row), as in isogmlp section 4.3; lower is more stable.

``tune`` keys (``eval.py compare --tune train.lr``): runs that differ only in those keys and the seed are one
variant, and its row is the value with the lowest mean final validation loss over its complete seeds
(``llm.eval.tune``). Every variant of a fair comparison sees the same token budget; rows that end at different
token counts are still tabulated but produce a warning.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy import stats

from llm.eval.errors import EvalError
from llm.eval.runs import RunRecord
from llm.eval.tune import TunePoint, choose, edge_warning, sensitivity_table, tune_points

DEFAULT_BASELINE = "swiglu+softmax"
ROW_INVARIANTS = ("params_total", "params_non_embedding", "mixed_precision")
"""Meta-row fields every seed of a row must agree on (besides the final token count). The meta row's
``variant`` is not among them: a run written with older option defaults may carry another name for the
same configuration, and a row's name is computed from the configuration its seeds share."""

CSV_COLUMNS = (
    "variant", "n_seeds", "seeds", "diverged", "incomplete", "params_total", "params_non_embedding",
    "val_loss_mean", "val_loss_std", "p_value", "training_stability", "tokens_per_s", "final_tokens",
)
OPTIMISM_NOTE = ("Choosing each variant's value and reporting its loss on the same validation set is optimistic "
                 "(the minimum of noisy means is biased low, more so on a finer grid): confirm with fresh seeds "
                 "at the chosen values and compare those runs without --tune.")


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
    p_value: float
    """Welch t-test of the final val losses against the baseline's; NaN when not computable."""
    training_stability: float
    tokens_per_s: float
    final_tokens: int
    diverged: list[RunRecord] = field(default_factory=list)
    incomplete: list[RunRecord] = field(default_factory=list)
    tuned: dict[str, Any] = field(default_factory=dict)
    """Tuned key -> the chosen value (``--tune``)."""

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]

    @property
    def n(self) -> int:
        return len(self.runs)

    def as_csv_row(self) -> dict[str, Any]:
        return {
            "variant": self.variant, **self.tuned, "n_seeds": self.n, "seeds": " ".join(map(str, self.seeds)),
            "diverged": len(self.diverged), "incomplete": len(self.incomplete),
            "params_total": self.params_total, "params_non_embedding": self.params_non_embedding,
            "val_loss_mean": self.val_loss_mean, "val_loss_std": self.val_loss_std,
            "p_value": self.p_value, "training_stability": self.training_stability,
            "tokens_per_s": self.tokens_per_s, "final_tokens": self.final_tokens,
        }


@dataclass
class Comparison:
    baseline: str
    """The baseline row's label (as given when no row has it: then there are no p-values)."""
    rows: list[VariantSummary]
    warnings: list[str] = field(default_factory=list)
    tune: tuple[str, ...] = ()
    sensitivity: dict[str, list[TunePoint]] = field(default_factory=dict)
    """With ``tune``: row label -> its loss at every value tried."""

    @property
    def groups(self) -> dict[str, list[RunRecord]]:
        """Row label -> the row's runs, in table order: what the plots draw, so they share the labels."""
        return {row.variant: row.runs for row in self.rows}


def welch_p_value(sample: Sequence[float], baseline: Sequence[float]) -> float:
    """Two-sided Welch t-test p-value; NaN when either group has fewer than 2 values."""
    if len(sample) < 2 or len(baseline) < 2:
        return math.nan
    return float(stats.ttest_ind(sample, baseline, equal_var=False).pvalue)


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else math.nan


def _shared(runs: Sequence[RunRecord], what: str, value: Any, label: str) -> Any:
    """``value(run)``, which every seed of row ``label`` must share; an EvalError naming the runs if not."""
    values = {run.path.name: value(run) for run in runs}
    if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
        found = ", ".join(f"{name}={v}" for name, v in values.items())
        raise EvalError(f"row {label}: runs with the same configuration differ in {what} ({found}); "
                        f"they cannot be seeds of one row")
    return next(iter(values.values()), None)


def group_runs(runs: Sequence[RunRecord], tune: Sequence[str] = ()) -> dict[str, list[RunRecord]]:
    """Rows of the comparison: runs whose ``model``/``data``/``train`` sections are identical but for ``tune``,
    each labelled by its variant name, plus ``(field=value, ...)`` for the fields that differ between rows
    with the same variant name. Sorted by label; members sorted by seed."""
    by_setup: dict[str, list[RunRecord]] = {}
    for run in runs:
        setup = {k: v for k, v in run.setup.items() if k not in tune}
        by_setup.setdefault(json.dumps(setup, sort_keys=True), []).append(run)
    same_name: dict[str, list[str]] = {}
    for key, members in by_setup.items():
        same_name.setdefault(members[0].variant, []).append(key)
    rows: dict[str, list[RunRecord]] = {}
    for variant, keys in same_name.items():
        setups = [json.loads(key) for key in keys]
        fields_ = sorted(set().union(*setups))
        differing = [f for f in fields_ if len({json.dumps(s.get(f)) for s in setups}) > 1]
        for key, setup in zip(keys, setups, strict=True):
            label = variant if not differing else \
                f"{variant} ({', '.join(f'{f}={setup.get(f)}' for f in differing)})"
            rows[label] = sorted(by_setup[key], key=lambda r: r.seed)
    return dict(sorted(rows.items()))


def resolve_baseline(rows: dict[str, list[RunRecord]], baseline: str) -> str | None:
    """The label of the one row ``baseline`` names: a row label, a variant name, or an FFN name alone (``swiglu``
    when one scoring is present). None when it names no row; an EvalError listing the labels when it names
    several (any choice among them would be a guess)."""
    if baseline in rows:
        return baseline
    for name_of in (lambda label: rows[label][0].variant, lambda label: rows[label][0].variant.split("+")[0]):
        matches = [label for label in rows if name_of(label) == baseline]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise EvalError(f"baseline {baseline} names {len(matches)} rows "
                            f"({', '.join(repr(label) for label in matches)}); pass one of these labels as --baseline")
    return None


def compare_runs(runs: Sequence[RunRecord], baseline: str | None = None, tune: Sequence[str] = ()) -> Comparison:
    """Group runs into rows (``group_runs``) and aggregate over each row's complete seeds; the baseline row
    comes first. ``baseline`` None: ``DEFAULT_BASELINE`` if present (a warning if not); a name given that matches
    no row is an EvalError listing the rows. With ``tune``, each row is its best value (``llm.eval.tune``).

    Raises EvalError when ``baseline`` names several rows (``resolve_baseline``), or when the seeds of a row
    disagree on a ``ROW_INVARIANTS`` field or its complete seeds on the final token count."""
    if not runs:
        raise EvalError("no runs to compare")
    unknown = [key for key in tune if key not in runs[0].setup]
    if unknown:
        raise EvalError(f"--tune {unknown[0]}: not a config key that changes results (e.g. train.lr, model.ffn_init)")
    groups = group_runs(runs, tune)
    warnings = [problem for run in runs for problem in run.problems]
    resolved = resolve_baseline(groups, baseline or DEFAULT_BASELINE)
    if resolved is None and baseline is not None:
        raise EvalError(f"--baseline {baseline} names no row; the rows are: {', '.join(map(repr, groups))}")
    if resolved is None:
        warnings.append(f"baseline {DEFAULT_BASELINE} is not among the rows ({', '.join(groups)}); no p-values")
    baseline = resolved or DEFAULT_BASELINE
    sensitivity: dict[str, list[TunePoint]] = {}
    chosen: dict[str, tuple[list[RunRecord], dict[str, Any]]] = {}
    for label, members in groups.items():
        for key in ROW_INVARIANTS:
            _shared(members, key, lambda r, key=key: r.meta.get(key), label)
        if tune:
            sensitivity[label] = points = tune_points(members, tune)
            best = choose(points)
            if (edge := edge_warning(label, points, best, tune)) is not None:
                warnings.append(edge)
            members = [] if best is None else best.runs
            chosen[label] = (members, {} if best is None else dict(zip(tune, best.values, strict=True)))
        else:
            chosen[label] = (members, {})
    complete = [run for members, _ in chosen.values() for run in members if run.complete]
    if len({run.final_tokens for run in complete}) > 1:
        ends = ", ".join(f"{run.path.name}={run.final_tokens}" for run in complete)
        warnings.append(f"runs end at different token counts ({ends}): not a fair comparison")
    baseline_losses = [r.final_val_loss for r in chosen.get(baseline, ([], {}))[0] if r.complete]
    rows = []
    for label in sorted(chosen, key=lambda v: (v != baseline, v)):
        members, tuned = chosen[label]
        done = [r for r in members if r.complete]
        seeds = [r.seed for r in done]
        if len(set(seeds)) < len(seeds):
            warnings.append(f"row {label}: repeated seeds {seeds}; repeats are not independent samples")
        broken = [r for r in (members if tune else groups[label]) if not r.complete]
        warnings += [f"row {label}: {r.path.name} {r.status} (final eval at step "
                     f"{r.evals[-1]['step'] if r.evals else 'none'} of {r.last_step}, val loss "
                     f"{r.final_val_loss:.4g}); left out of the statistics" for r in broken]
        if not done:
            warnings.append(f"row {label}: no complete run{' at any value' if tune else ''}; compared without it")
        losses = [r.final_val_loss for r in done]
        rows.append(VariantSummary(
            variant=label, runs=done,
            params_total=groups[label][0].meta.get("params_total"),
            params_non_embedding=groups[label][0].meta.get("params_non_embedding"),
            val_loss_mean=statistics.fmean(losses) if losses else math.nan,
            val_loss_std=statistics.stdev(losses) if len(losses) > 1 else math.nan,
            p_value=math.nan if label == baseline else welch_p_value(losses, baseline_losses),
            training_stability=_mean([r.stability for r in done]),
            tokens_per_s=_mean([r.tokens_per_s for r in done]),
            final_tokens=_shared(done, "final token count", lambda r: r.final_tokens, label) or 0,
            diverged=[r for r in broken if r.diverged], incomplete=[r for r in broken if not r.diverged],
            tuned=tuned,
        ))
    return Comparison(baseline=baseline, rows=rows, warnings=warnings, tune=tuple(tune), sensitivity=sensitivity)


def _params(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def _num(x: float, spec: str) -> str:
    return "n/a" if math.isnan(x) else format(x, spec)


def format_table(comparison: Comparison) -> str:
    """The comparison as a Markdown table with footnotes (also readable as plain text), then, with ``tune``,
    the sensitivity table."""
    header = ["Variant", *comparison.tune, "Params (total)", "Params (non-emb.)", "Val loss (mean ± std)", "n",
              "Diverged / incomplete ⁴", f"p vs {comparison.baseline} ¹", "Training stability ²", "Tokens/s ³"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in comparison.rows:
        loss = "all diverged" if not row.runs and row.diverged else _num(row.val_loss_mean, ".4f") + (
            "" if math.isnan(row.val_loss_std) else f" ± {row.val_loss_std:.4f}")
        p = "baseline" if row.variant == comparison.baseline else _num(row.p_value, ".3g")
        cells = [row.variant, *(str(row.tuned.get(key, "n/a")) for key in comparison.tune),
                 _params(row.params_total), _params(row.params_non_embedding), loss, str(row.n),
                 f"{len(row.diverged)} / {len(row.incomplete)}", p, _num(row.training_stability, ".3g"),
                 _num(row.tokens_per_s, ",.0f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"- {note}" for note in (
        "Final validation loss: mean ± sample std (ddof=1) over the n complete seeds; no std with one seed."
        + (f" Each row at the value of {', '.join(comparison.tune)} with the lowest mean." if comparison.tune
           else ""),
        f"¹ Two-sided Welch t-test (unequal variances) of the final val losses against "
        f"{comparison.baseline}; n/a when either group has fewer than 2 seeds.",
        "² Variance of the pre-clip global gradient norm over the run after warmup (last train row's "
        "grad_norm_var_run), mean over seeds; lower is more stable.",
        "³ Median training throughput of each run, mean over seeds.",
        "⁴ Runs left out of the statistics: a non-finite final validation loss (diverged), or no eval at the "
        "run's last step (incomplete: stopped, killed or its metrics file cut off).",
        *([OPTIMISM_NOTE] if comparison.tune else []),
        *(f"Warning: {w}" for w in comparison.warnings),
    ))]
    if comparison.tune:
        lines += ["", f"Sensitivity to {', '.join(comparison.tune)}: final validation loss at every value "
                      "(mean ± std over complete seeds; * the chosen value)", "",
                  *sensitivity_table(comparison.sensitivity, comparison.tune, {
                      row.variant: tuple(row.tuned.get(k) for k in comparison.tune) for row in comparison.rows})]
    return "\n".join(lines) + "\n"


def write_comparison(comparison: Comparison, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``comparison.md`` (the table) and ``comparison.csv`` (full-precision numbers)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md_path, csv_path = out / "comparison.md", out / "comparison.csv"
    md_path.write_text(format_table(comparison))
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[CSV_COLUMNS[0], *comparison.tune, *CSV_COLUMNS[1:]])
        writer.writeheader()
        for row in comparison.rows:
            writer.writerow(row.as_csv_row())
    return md_path, csv_path
