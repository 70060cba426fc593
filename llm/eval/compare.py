"""Compare training runs: a table in the style of isogmlp Table 1 from each run's ``metrics.jsonl``.

Runs are grouped by their whole configuration except the seed: the ``model``, ``data`` and ``train``
sections of the meta row's ``config`` must be identical for two runs to share a row, so an ablation
(``iso_ln[layernorm=false]``) or a run with another learning rate is never pooled with its parent. The
sections are compared as today's code reads them back (``llm.config.read_saved``, as for resuming or
evaluating a run): fields added since a run was written take today's defaults, and a run from before
``ffn_init`` existed reads as ``ffn_init=paper`` with the options its variant did not read at today's
defaults, so an old and a new run of the same effective configuration share a row. A row is labelled by
its variant name (today's name for that configuration), which carries every non-default variant option;
rows whose variant names coincide but whose configurations differ are labelled with the fields that tell
them apart, e.g. ``swiglu+softmax (train.lr=0.001)``. Inside a row the seeds must also agree on what the
configuration implies (parameter counts, precision, final token count): a disagreement is an error.
Each row's seeds give the final validation loss as mean ± sample std (ddof=1) and a Welch t-test
(unequal variances) against the baseline row, named by its label or by a variant name that labels one
row only (a variant name shared by several rows is an error listing their labels). "Training
stability" is the variance of the pre-clip global gradient norm over the run after warmup
(``grad_norm_var_run`` of the last train row), as in isogmlp section 4.3 ("measured by gradient norm
variance"); lower is more stable.

Every variant of a fair comparison sees the same token budget; rows that end at different token
counts are still tabulated but produce a warning.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from scipy import stats

from llm.config import ConfigError, RunConfig, flatten, read_saved
from llm.eval.errors import EvalError

DEFAULT_BASELINE = "swiglu+softmax"
COMPARED_SECTIONS = ("model", "data", "train")
"""Config sections two runs must share (every field but ``RESULT_NEUTRAL``) to be seeds of one row."""
RESULT_NEUTRAL = frozenset({
    "data.cache_dir", "data.read_retries", "data.retry_backoff_s",
    "train.log_every", "train.checkpoint_every", "train.keep_checkpoints", "model.iso_tanh_chunk_size",
})
"""Bookkeeping that cannot change a run's numbers (where caches live, how often a row or a checkpoint is
written, how failed reads are retried, the chunk length of iso_tanh's chunked form, whose results equal
the other forms' up to rounding): seeds that differ only there are one row. ``data.num_workers`` is
not among them: ranks x workers sets the data order."""
ROW_INVARIANTS = ("params_total", "params_non_embedding", "mixed_precision")
"""Meta-row fields every seed of a row must agree on (besides the final token count). The meta row's
``variant`` is not among them: a run written with older option defaults may carry another name for the
same configuration, and a row's name is computed from the configuration its seeds share."""

CSV_COLUMNS = (
    "variant", "n_seeds", "seeds", "params_total", "params_non_embedding", "val_loss_mean",
    "val_loss_std", "p_value", "training_stability", "tokens_per_s", "final_tokens",
)


@dataclass
class RunRecord:
    """The rows of one run's ``metrics.jsonl``, deduplicated by step (a resumed run re-logs steps)."""

    path: Path
    meta: dict[str, Any]
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    config: RunConfig
    """The meta row's ``model``, ``data`` and ``train`` sections as today's code reads them back
    (``llm.config.read_saved``); the other fields are today's defaults, not the run's."""

    @property
    def variant(self) -> str:
        """Today's variant name of the run's model (a run written with older option defaults may have
        logged another name for the same configuration)."""
        return self.config.model.variant_name

    @cached_property
    def setup(self) -> dict[str, Any]:
        """The ``model``, ``data`` and ``train`` sections of the run's config as dotted keys, less the
        ``RESULT_NEUTRAL`` fields (computed once: ``group_runs`` reads it for every run and every row)."""
        flat = flatten({section: asdict(getattr(self.config, section)) for section in COMPARED_SECTIONS})
        return {key: value for key, value in flat.items() if key not in RESULT_NEUTRAL}

    @property
    def seed(self) -> int:
        return int(self.meta.get("seed", 0))

    @property
    def final_val_loss(self) -> float:
        return float(self.evals[-1]["val_loss"])

    @property
    def final_tokens(self) -> int:
        return int(self.evals[-1]["tokens"])

    @property
    def stability(self) -> float:
        """``grad_norm_var_run`` of the last train row: gradient-norm variance over the run after warmup."""
        value = self.train[-1].get("grad_norm_var_run") if self.train else None
        return math.nan if value is None else float(value)

    @property
    def tokens_per_s(self) -> float:
        """Median over the train rows: robust to the slow first steps (compilation, warm caches)."""
        rates = [float(r["tokens_per_s"]) for r in self.train if r.get("tokens_per_s") is not None]
        return statistics.median(rates) if rates else math.nan


def _dedupe_by_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep the last row of each step, in step order: after a resume, the re-run steps supersede."""
    by_step = {int(r["step"]): r for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl``; FileNotFoundError / EvalError naming the file on bad input.

    A truncated last line (a run killed mid-write) is ignored; a bad line elsewhere is an error."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a run directory)")
    lines = path.read_text().splitlines()
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if lineno == len(lines):
                break
            raise EvalError(f"{path}:{lineno}: not a JSON object") from None
    return rows


def eval_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The eval rows, one per step in step order: after a resume, a re-logged step supersedes."""
    return _dedupe_by_step([r for r in rows if r.get("kind") == "eval"])


def load_run(run_dir: str | Path) -> RunRecord:
    """Read ``run_dir/metrics.jsonl`` (``read_metrics``) for a comparison; raise FileNotFoundError / EvalError
    naming the file on bad input: besides ``read_metrics``'s, a run that never evaluated and a saved config
    section that today's code cannot read back (an unknown field, a value of the wrong type or one today's
    validation refuses).
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    rows = read_metrics(run_dir)
    metas = [r for r in rows if r.get("kind") == "meta"]
    if not metas:
        raise EvalError(f"{path}: no meta row (kind=meta) with the run's variant and seed")
    config = metas[0].get("config")
    if not isinstance(config, dict) or not all(isinstance(config.get(s), dict) for s in COMPARED_SECTIONS):
        raise EvalError(f"{path}: the meta row has no 'config' with the {', '.join(COMPARED_SECTIONS)} "
                        f"sections (needed to tell which runs are seeds of one configuration)")
    try:
        read = read_saved({section: config[section] for section in COMPARED_SECTIONS})
    except ConfigError as err:
        raise EvalError(f"{path}: today's code cannot read back the meta row's config: {err}") from None
    evals = eval_rows(rows)
    if not evals:
        raise EvalError(f"{path}: no eval rows (kind=eval); the run never evaluated")
    train = _dedupe_by_step([r for r in rows if r.get("kind") == "train"])
    return RunRecord(path=run_dir, meta=metas[0], train=train, evals=evals, config=read)


def expand_run_dirs(patterns: Iterable[str]) -> list[Path]:
    """Run directories from paths and (quoted) glob patterns; a pattern matching nothing is an error.

    A pattern keeps only directories holding a ``metrics.jsonl`` (so ``runs/x-*`` may also match a
    log folder); a directory named explicitly is kept and fails later if it is not a run."""
    dirs: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = [Path(m) for m in sorted(glob.glob(pattern)) if (Path(m) / "metrics.jsonl").is_file()]
            if not matches:
                raise FileNotFoundError(f"{pattern}: the pattern matches no run directory")
            dirs.extend(matches)
        else:
            dirs.append(Path(pattern))
    if not dirs:
        raise EvalError("no run directories given")
    return dirs


@dataclass
class VariantSummary:
    """One row of the comparison table: a variant aggregated over its seeds."""

    variant: str
    runs: list[RunRecord]
    params_total: int | None
    params_non_embedding: int | None
    val_loss_mean: float
    val_loss_std: float
    """Sample standard deviation (ddof=1) over seeds; NaN with a single seed."""
    p_value: float
    """Welch t-test of the final val losses against the baseline's; NaN when not computable."""
    training_stability: float
    tokens_per_s: float
    final_tokens: int

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]

    @property
    def n(self) -> int:
        return len(self.runs)

    def as_csv_row(self) -> dict[str, Any]:
        return {
            "variant": self.variant, "n_seeds": self.n, "seeds": " ".join(map(str, self.seeds)),
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
    return next(iter(values.values()))


def group_runs(runs: Sequence[RunRecord]) -> dict[str, list[RunRecord]]:
    """Rows of the comparison: runs whose ``model``/``data``/``train`` sections are identical, each
    labelled by its variant name, plus ``(field=value, ...)`` for the fields that differ between rows
    with the same variant name. Sorted by label; members sorted by seed."""
    by_setup: dict[str, list[RunRecord]] = {}
    for run in runs:
        by_setup.setdefault(json.dumps(run.setup, sort_keys=True), []).append(run)
    same_name: dict[str, list[str]] = {}
    for key, members in by_setup.items():
        same_name.setdefault(members[0].variant, []).append(key)
    rows: dict[str, list[RunRecord]] = {}
    for variant, keys in same_name.items():
        setups = [by_setup[key][0].setup for key in keys]
        fields_ = sorted(set().union(*setups))
        differing = [f for f in fields_ if len({json.dumps(s.get(f)) for s in setups}) > 1]
        for key, setup in zip(keys, setups, strict=True):
            label = variant if not differing else \
                f"{variant} ({', '.join(f'{f}={setup.get(f)}' for f in differing)})"
            rows[label] = sorted(by_setup[key], key=lambda r: r.seed)
    return dict(sorted(rows.items()))


def resolve_baseline(rows: dict[str, list[RunRecord]], baseline: str) -> str | None:
    """The label of the row ``baseline`` names (a row label, or a variant name that labels one row); None
    when it names no row. A variant name of several rows (each labelled with the fields that differ) is
    an EvalError listing their labels: any choice among them would be a guess."""
    if baseline in rows:
        return baseline
    matches = [label for label, members in rows.items() if members[0].variant == baseline]
    if matches:  # a variant name of a single row is that row's label, found above
        raise EvalError(f"baseline {baseline} names {len(matches)} rows "
                        f"({', '.join(repr(label) for label in matches)}); pass one of these labels as --baseline")
    return None


def compare_runs(runs: Sequence[RunRecord], baseline: str = DEFAULT_BASELINE) -> Comparison:
    """Group runs into rows (``group_runs``) and aggregate over seeds; the baseline row comes first.

    Raises EvalError when ``baseline`` is a variant name of several rows (``resolve_baseline``), or when
    the seeds of a row disagree on a ``ROW_INVARIANTS`` field or on the final token count."""
    if not runs:
        raise EvalError("no runs to compare")
    groups = group_runs(runs)
    warnings: list[str] = []
    baseline = resolve_baseline(groups, baseline) or baseline
    if baseline not in groups:
        warnings.append(f"baseline {baseline} is not among the rows "
                        f"({', '.join(sorted(groups))}); no p-values")
    budgets = {run.final_tokens for run in runs}
    if len(budgets) > 1:
        ends = ", ".join(f"{run.path.name}={run.final_tokens}" for run in runs)
        warnings.append(f"runs end at different token counts ({ends}): not a fair comparison")
    baseline_losses = [r.final_val_loss for r in groups.get(baseline, [])]
    rows = []
    for variant in sorted(groups, key=lambda v: (v != baseline, v)):
        members = groups[variant]
        seeds = [r.seed for r in members]
        if len(set(seeds)) < len(seeds):
            warnings.append(f"row {variant}: repeated seeds {seeds}; repeats are not independent samples")
        for key in ROW_INVARIANTS:
            _shared(members, key, lambda r, key=key: r.meta.get(key), variant)
        final_tokens = _shared(members, "final token count", lambda r: r.final_tokens, variant)
        losses = [r.final_val_loss for r in members]
        rows.append(VariantSummary(
            variant=variant,
            runs=members,
            params_total=members[0].meta.get("params_total"),
            params_non_embedding=members[0].meta.get("params_non_embedding"),
            val_loss_mean=statistics.fmean(losses),
            val_loss_std=statistics.stdev(losses) if len(losses) > 1 else math.nan,
            p_value=math.nan if variant == baseline else welch_p_value(losses, baseline_losses),
            training_stability=_mean([r.stability for r in members]),
            tokens_per_s=_mean([r.tokens_per_s for r in members]),
            final_tokens=final_tokens,
        ))
    return Comparison(baseline=baseline, rows=rows, warnings=warnings)


def _params(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def _num(x: float, spec: str) -> str:
    return "n/a" if math.isnan(x) else format(x, spec)


def format_table(comparison: Comparison) -> str:
    """The comparison as a Markdown table with footnotes (also readable as plain text)."""
    header = ["Variant", "Params (total)", "Params (non-emb.)", "Val loss (mean ± std)", "n",
              f"p vs {comparison.baseline} ¹", "Training stability ²", "Tokens/s ³"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in comparison.rows:
        loss = f"{row.val_loss_mean:.4f}" + ("" if math.isnan(row.val_loss_std)
                                             else f" ± {row.val_loss_std:.4f}")
        p = "baseline" if row.variant == comparison.baseline else _num(row.p_value, ".3g")
        cells = [row.variant, _params(row.params_total), _params(row.params_non_embedding), loss,
                 str(row.n), p, _num(row.training_stability, ".3g"), _num(row.tokens_per_s, ",.0f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"- {note}" for note in (
        "Final validation loss: mean ± sample std (ddof=1) over n seeds; no std with one seed.",
        f"¹ Two-sided Welch t-test (unequal variances) of the final val losses against "
        f"{comparison.baseline}; n/a when either group has fewer than 2 seeds.",
        "² Variance of the pre-clip global gradient norm over the run after warmup (last train row's "
        "grad_norm_var_run), mean over seeds; lower is more stable.",
        "³ Median training throughput of each run, mean over seeds.",
        *(f"Warning: {w}" for w in comparison.warnings),
    ))]
    return "\n".join(lines) + "\n"


def write_comparison(comparison: Comparison, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``comparison.md`` (the table) and ``comparison.csv`` (full-precision numbers)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md_path, csv_path = out / "comparison.md", out / "comparison.csv"
    md_path.write_text(format_table(comparison))
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in comparison.rows:
            writer.writerow(row.as_csv_row())
    return md_path, csv_path
