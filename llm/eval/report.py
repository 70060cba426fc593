"""A comparison written out: ``comparison.md`` (the table in the style of isogmlp Table 1 with its footnotes, and,
where they apply, the sensitivity to the tuned keys and the scaling view) and ``comparison.csv``."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from llm.eval.compare import Comparison
from llm.eval.scaling import scaling_series

__all__ = ["CSV_COLUMNS", "OPTIMISM_NOTE", "format_table", "write_comparison"]

CSV_COLUMNS = (
    "variant", "n_seeds", "seeds", "diverged", "incomplete", "params_total", "params_non_embedding",
    "val_loss_mean", "val_loss_std", "p_value", "training_stability", "tokens_per_s", "final_tokens",
)
OPTIMISM_NOTE = ("Choosing each variant's value and reporting its loss on the same validation set is optimistic "
                 "(the minimum of noisy means is biased low, more so on a finer grid). The honest protocol: choose "
                 "the values with some seeds (this table), then train fresh seeds at the chosen values and report "
                 "those runs, compared without --tune.")


def _params(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def _num(x: float, spec: str) -> str:
    return "n/a" if math.isnan(x) else format(x, spec)


def _loss(mean: float, std: float) -> str:
    """``mean ± std``; the mean alone with one seed."""
    return _num(mean, ".4f") + ("" if math.isnan(std) else f" ± {std:.4f}")


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(map(str, cells)) + " |" for cells in rows)]


def _sensitivity(comparison: Comparison) -> list[str]:
    """Each row's loss at every value of the tuned keys, with its complete seeds and broken runs."""
    rows = []
    for row in comparison.rows:
        chosen = tuple(row.tuned.get(key) for key in comparison.tune)
        points = comparison.sensitivity.get(row.variant, [])
        for point in points:
            loss = "diverged" if not point.losses and point.diverged else _loss(point.mean, point.std)
            star = " *" if point.values == chosen and len(points) > 1 else ""
            rows.append([row.variant, *point.values, loss + star, len(point.losses),
                         f"{point.diverged} / {point.incomplete}"])
    return ["", f"Sensitivity to {', '.join(comparison.tune)}: final validation loss at every value "
                "(mean ± std over complete seeds; * the chosen value, where a row ran at more than one)", "",
            *_table(["Variant", *comparison.tune, "Val loss (mean ± std)", "n", "Diverged / incomplete"], rows)]


def _scaling(comparison: Comparison) -> list[str]:
    """Each series' loss at every size with its gap to the baseline of that size and the p-value, then each
    series' fit; empty when every variant comes in one size."""
    series = scaling_series(comparison)
    baseline_at = {row.size: row.val_loss_mean for row in comparison.rows if row.variant in comparison.baselines}
    rows = []
    for found in series:
        for row in found.rows:
            is_baseline = row.variant in comparison.baselines
            gap = row.val_loss_mean - baseline_at.get(row.size, math.nan)
            rows.append([found.label, f"{row.params_non_embedding:,}", _loss(row.val_loss_mean, row.val_loss_std),
                         row.n, "baseline" if is_baseline else _num(gap, "+.4f"),
                         "" if is_baseline else _num(row.p_value, ".3g")])
    if not rows:
        return []
    fits = [[found.label, len(found.rows), f"{found.coefficient:.4g}", f"{found.exponent:.4f}"] for found in series]
    return ["", f"Scaling: final validation loss against non-embedding parameters N, and the gap to "
                f"{comparison.baseline} at the same size (its Welch p-value)", "",
            *_table(["Variant", "Params (non-emb.)", "Val loss (mean ± std)", "n", "Gap to baseline", "p"], rows),
            "", "Fit L = a · N^b of each variant's mean loss over its sizes (scaling.png; b < 0: the loss falls with "
                "size)", "",
            *_table(["Variant", "Sizes", "a", "b"], fits)]


def format_table(comparison: Comparison) -> str:
    """The comparison as a Markdown table with footnotes (also readable as plain text), then, with ``tune``,
    the sensitivity table, and, when a variant comes in several sizes, the scaling table."""
    rows = [[row.variant, *(row.tuned.get(key, "n/a") for key in comparison.tune), _params(row.params_total),
             _params(row.params_non_embedding), _loss(row.val_loss_mean, row.val_loss_std) if row.runs else
             "no value stable in every seed" if any(p.losses for p in comparison.sensitivity.get(row.variant, []))
             else "all diverged" if row.diverged else "n/a", row.n,
             f"{len(row.diverged)} / {len(row.incomplete)}",
             "baseline" if row.variant in comparison.baselines else _num(row.p_value, ".3g"),
             _num(row.training_stability, ".3g"), _num(row.tokens_per_s, ",.0f")] for row in comparison.rows]
    lines = _table(["Variant", *comparison.tune, "Params (total)", "Params (non-emb.)", "Val loss (mean ± std)", "n",
                    "Diverged / incomplete ⁴", f"p vs {comparison.baseline} ¹", "Training stability ²",
                    "Tokens/s ³"], rows)
    lines += ["", *(f"- {note}" for note in (
        "Final validation loss: mean ± sample std (ddof=1) over the n complete seeds; no std with one seed."
        + (f" Each row at the value of {', '.join(comparison.tune)} with the lowest mean." if comparison.tune
           else ""),
        f"¹ Two-sided Welch t-test (unequal variances) of the final val losses against "
        f"{comparison.baseline}{' at the same model size' if len(comparison.baselines) > 1 else ''}; n/a when "
        "either group has fewer than 2 seeds.",
        "² Variance of the pre-clip global gradient norm over the run after warmup (last train row's "
        "grad_norm_var_run), mean over seeds; lower is more stable.",
        "³ Median training throughput of each run, mean over seeds.",
        "⁴ Runs left out of the statistics: a non-finite final validation loss (diverged), or no eval at the "
        "run's last step (incomplete: stopped, killed or its metrics file cut off).",
        *([OPTIMISM_NOTE] if comparison.tune else []),
        *(f"Warning: {w}" for w in comparison.warnings),
    ))]
    if comparison.tune:
        lines += _sensitivity(comparison)
    return "\n".join(lines + _scaling(comparison)) + "\n"


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
