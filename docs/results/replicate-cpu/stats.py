"""Statistics that ``eval.py compare`` does not print, for the reading in README.md.

    python docs/results/replicate-cpu/stats.py 'runs/replicate-*' > docs/results/replicate-cpu/stats.md

Runs of several model sizes (``llm.eval.grouping.SIZE_KEYS``) get one report per size, each against the
baseline row of its size.

From the same ``metrics.jsonl`` files (read with ``llm.eval.compare.load_run``), in the same rows as the
table (``llm.eval.compare.compare_runs``: runs of one configuration but the seed; ``--baseline`` names a row
as ``compare`` does):

1. final validation loss: each variant's difference to the baseline with the Welch 95% confidence
   interval (the table gives only the p-value);
2. gradient-norm stability (isogmlp section 4.3, "gradient norm variance"): the per-seed
   ``grad_norm_var_run`` and the scale-free ``grad_norm_cv_run`` of the last train row, and the variance
   over the second half of the steps only (where the early downward trend of the norm no longer
   dominates) and the largest pre-clip norm after warmup, each with a two-sided Welch t-test and an exact
   two-sided Mann-Whitney U test against the baseline (variances are skewed: one spike can dominate a
   seed's variance and the t-test; with 3 + 3 seeds the smallest Mann-Whitney p is 0.1, with 2 + 3 it is
   0.2); the table gives only the mean variance;
3. the learned mixing weight alpha per layer at the last evaluation (isogmlp eq. 3;
   isotropy-ln-pathway section 3.3, where the paper reports alpha = 1.81 ± 0.03);
4. gradient-norm attribution: per parameter group (``llm.metrics.gradnorm.GRAD_NORM_GROUPS``), the
   variance of the group's pre-clip norm after warmup and the group's share of the squared global norm at
   each seed's largest step after warmup (which group a spike is made of);
5. validation loss at every evaluation, mean over seeds (the curves of val_loss.png as numbers).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from scipy import stats

from llm.eval.compare import DEFAULT_BASELINE, compare_runs
from llm.eval.grouping import SIZE_KEYS, model_size
from llm.eval.runs import RunRecord, expand_run_dirs, load_run
from llm.metrics.gradnorm import GRAD_NORM_GROUPS


def _mean_std(values: Sequence[float]) -> str:
    if any(math.isnan(v) for v in values):  # a measure some seed never logged (statistics.stdev raises on NaN)
        return "n/a"
    if len(values) < 2:
        return f"{values[0]:.4g}"
    return f"{statistics.fmean(values):.4g} ± {statistics.stdev(values):.2g}"


def _welch(sample: Sequence[float], baseline: Sequence[float]) -> tuple[float, float, float]:
    """Two-sided Welch t-test: p-value and the 95% confidence interval of mean(sample) - mean(baseline)."""
    if len(sample) < 2 or len(baseline) < 2:
        return math.nan, math.nan, math.nan
    result = stats.ttest_ind(sample, baseline, equal_var=False)
    interval = result.confidence_interval(0.95)
    return float(result.pvalue), float(interval.low), float(interval.high)


def _last_train(run: RunRecord, key: str) -> float:
    value = run.train[-1].get(key) if run.train else None
    return math.nan if value is None else float(value)


def _late_grad_norm_var(run: RunRecord) -> float:
    """Sample variance (ddof=1) of the pre-clip gradient norm over the second half of the logged steps."""
    norms = [float(r["grad_norm"]) for r in run.train if r.get("grad_norm") is not None]
    late = norms[len(norms) // 2:]
    return statistics.variance(late) if len(late) > 1 else math.nan


def _spike(run: RunRecord) -> dict[str, Any] | None:
    """The train row of the run's largest pre-clip gradient norm after warmup; None when there is none."""
    warmup = run.config.train.warmup_steps
    rows = [r for r in run.train if int(r["step"]) > warmup and r.get("grad_norm") is not None]
    return max(rows, key=lambda r: float(r["grad_norm"]), default=None)


def _max_grad_norm_after_warmup(run: RunRecord) -> float:
    spike = _spike(run)
    return math.nan if spike is None else float(spike["grad_norm"])


def _spike_shares(run: RunRecord) -> dict[str, float]:
    """Each group's share of the squared global pre-clip norm at the run's largest step after warmup (the
    groups' squared norms add up to the global one's)."""
    spike = _spike(run)
    if spike is None:
        return {}
    total = float(spike["grad_norm"]) ** 2
    return {group: float(spike[f"grad_norm_{group}"]) ** 2 / total
            for group in GRAD_NORM_GROUPS if spike.get(f"grad_norm_{group}") is not None}


def _mann_whitney(sample: Sequence[float], baseline: Sequence[float]) -> float:
    """Exact two-sided Mann-Whitney U p-value; NaN when either group is empty."""
    if not sample or not baseline:
        return math.nan
    return float(stats.mannwhitneyu(sample, baseline, alternative="two-sided", method="exact").pvalue)


def _final_alpha(run: RunRecord) -> dict[int, float]:
    """Layer -> alpha at the last evaluation, numbered as in the eval rows and alpha.png: layer 0 is the
    embedding output, layer i >= 1 the output of transformer block i, whose FFN the alpha belongs to."""
    return {int(entry["layer"]): float(entry["alpha"])
            for entry in run.evals[-1].get("layers") or [] if entry.get("alpha") is not None}


def report(runs: Sequence[RunRecord], baseline: str) -> str:
    comparison = compare_runs(runs, baseline)  # the table's rows, baseline first, and its baseline label
    groups, baseline = comparison.groups, comparison.baseline
    if baseline not in groups:
        raise ValueError(f"baseline {baseline} is not among the rows ({', '.join(sorted(groups))})")
    base = groups[baseline]
    lines = [f"Baseline: {baseline}. Two-sided Welch t-tests (unequal variances) over seeds; "
             "CI: 95% interval of the difference of means.", ""]

    lines += ["## Final validation loss: difference to the baseline", "",
              "| Variant | n | Val loss per seed | Δ vs baseline | 95% CI of Δ | p |", "|---|---|---|---|---|---|"]
    base_loss = [r.final_val_loss for r in base]
    for variant, members in groups.items():
        losses = [r.final_val_loss for r in members]
        per_seed = ", ".join(f"{x:.4f}" for x in losses)
        if variant == baseline:
            lines.append(f"| {variant} | {len(members)} | {per_seed} | baseline | | |")
            continue
        p, low, high = _welch(losses, base_loss)
        delta = statistics.fmean(losses) - statistics.fmean(base_loss)
        lines.append(f"| {variant} | {len(members)} | {per_seed} | {delta:+.4f} | [{low:+.4f}, {high:+.4f}] | "
                     f"{p:.3g} |")

    measures = {
        "variance after warmup (compare's stability)": lambda r: r.stability,
        "coefficient of variation after warmup": lambda r: _last_train(r, "grad_norm_cv_run"),
        "variance over the second half of the steps": _late_grad_norm_var,
        "largest pre-clip norm after warmup": _max_grad_norm_after_warmup,
    }
    for title, measure in measures.items():
        lines += ["", f"## Gradient-norm stability: {title}", "",
                  "| Variant | per seed | mean ± std | Welch p | Mann-Whitney p |", "|---|---|---|---|---|"]
        base_values = [measure(r) for r in base]
        for variant, members in groups.items():
            values = [measure(r) for r in members]
            tests = ("baseline | " if variant == baseline else
                     f"{_welch(values, base_values)[0]:.3g} | {_mann_whitney(values, base_values):.3g}")
            lines.append(f"| {variant} | {', '.join(f'{v:.3g}' for v in values)} | {_mean_std(values)} | {tests} |")

    lines += ["", "## Gradient-norm attribution by parameter group", "",
              "Variance of each group's pre-clip norm after warmup (mean over seeds), and in brackets the group's "
              "share of the squared global norm at each seed's largest step after warmup (mean over seeds).", "",
              "| Variant | " + " | ".join(GRAD_NORM_GROUPS) + " |", "|---|" + "---|" * len(GRAD_NORM_GROUPS)]
    for variant, members in groups.items():
        shares = [_spike_shares(r) for r in members]
        cells = []
        for group in GRAD_NORM_GROUPS:
            variances = [_last_train(r, f"grad_norm_{group}_var_run") for r in members]
            if all(math.isnan(v) for v in variances):
                cells.append("-")
                continue
            share = statistics.fmean(s.get(group, 0.0) for s in shares)
            cells.append(f"{statistics.fmean(variances):.3g} ({share:.0%})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")

    with_alpha = {v: m for v, m in groups.items() if any(_final_alpha(r) for r in m)}
    if with_alpha:
        lines += ["", "## Learned alpha per layer at the end of training (mean ± std over seeds)", ""]
        layers = sorted({layer for m in with_alpha.values() for r in m for layer in _final_alpha(r)})
        lines += ["| Variant | " + " | ".join(f"layer {i}" for i in layers) + " | all layers |",
                  "|---|" + "---|" * (len(layers) + 1)]
        for variant, members in with_alpha.items():
            per_layer = [[_final_alpha(r)[i] for r in members] for i in layers]
            everything = [a for values in per_layer for a in values]
            lines.append(f"| {variant} | " + " | ".join(_mean_std(v) for v in per_layer)
                         + f" | {_mean_std(everything)} |")

    lines += ["", "## Validation loss at each evaluation (mean over seeds)", ""]
    tokens = sorted({int(row["tokens"]) for r in runs for row in r.evals})
    lines += ["| Variant | " + " | ".join(f"{t:,} tok" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
    for variant, members in groups.items():
        cells = []
        for t in tokens:
            values = [float(row["val_loss"]) for r in members for row in r.evals if int(row["tokens"]) == t]
            cells.append(f"{statistics.fmean(values):.4f}" if values else "n/a")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories or quoted glob patterns")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE)
    args = parser.parse_args(argv)
    try:
        runs = [load_run(d) for d in expand_run_dirs(args.runs)]
        by_size: dict[tuple[Any, ...], list[RunRecord]] = {}
        for run in runs:
            by_size.setdefault(model_size(run), []).append(run)
        for size, members in sorted(by_size.items()):  # each model size against its own baseline row
            if len(by_size) > 1:
                sys.stdout.write(f"# {', '.join(f'{k}={v}' for k, v in zip(SIZE_KEYS, size, strict=True))}\n\n")
            sys.stdout.write(report(members, args.baseline) + ("\n" if len(by_size) > 1 else ""))
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
