"""A comparison written out: ``comparison.md`` (the table in the style of isogmlp Table 1 with its footnotes and a
line on what it can conclude, and, where they apply, the sensitivity to the tuned keys and the scaling view) and
``comparison.csv``."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from llm.eval.compare import Comparison, VariantSummary
from llm.eval.plan import stein_resolves
from llm.eval.scaling import scaling_series
from llm.eval.stats import ALPHA, MAX_SEEDS, POWER, Gap
from llm.eval.tune import scored, shared_seeds

__all__ = ["CSV_COLUMNS", "OPTIMISM_NOTE", "format_table", "write_comparison"]

CSV_COLUMNS = ("variant", "n_seeds", "seeds", "diverged", "incomplete", "params_total", "params_non_embedding",
               "val_loss_mean", "val_loss_std", "gap", "gap_ci_low", "gap_ci_high", "paired_ci_low", "paired_ci_high",
               "p_value", "p_value_paired", "mde", "paired_mde", "seeds_needed", "paired_seeds_needed",
               "seeds_for_target_gap", "paired_seeds_for_target_gap", "training_stability", "tokens_per_s",
               "final_tokens", "seed_scope", "not_compared", "planned_threshold", "stein_verdict", "stein_ci_low",
               "stein_ci_high")
METHOD = "docs/comparison.md"  # the method behind each note, at length
SEED_SCOPES = {
    "init": "init (one data order for every run: a gap holds for that order)",
    "run": "run (data.seed: run: each seed its own data order, shared within a pair)"}
"""What a row's seeds replicate (``VariantSummary.seed_scope``), as the table's note says it."""
ASSUMPTIONS = ("Assumptions: normal seed effects; MDEs take the observed spreads as true: about 73% (Welch) or "
               "58-69% (paired) power, not 80%.")
OPTIMISM_NOTE = "--tune chooses on the validation set it reports: optimistic; report fresh seeds at the chosen values."
STEIN_NOTE = ("⁷ Stein: a planned row's verdict is the plan's final test, its gap over exactly the planned seeds "
              "beyond the plan's threshold (interval gap ± threshold); the t-tests' intervals, p-values, MDEs and seed "
              "counts are not its test, and are not shown for it.")


def _params(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def _num(x: float, spec: str) -> str:
    return "n/a" if math.isnan(x) else format(x, spec)


def _loss(mean: float, std: float) -> str:
    """``mean ± std``; the mean alone with one seed."""
    return _num(mean, ".4f") + ("" if math.isnan(std) else f" ± {std:.4f}")


def _interval(low: float, high: float) -> str:
    return "n/a" if math.isnan(low) else f"[{low:+.4f}, {high:+.4f}]"


def _gap(gap: Gap) -> str:
    return f"{gap.gap:+.4f}" + ("" if math.isnan(gap.ci_low) else f" {_interval(gap.ci_low, gap.ci_high)}")


def _design(gap: Gap) -> tuple[str, float, float] | None:
    """The design that decides ``gap``, with its interval, when it resolves it at p < ALPHA; None when it does not.
    One test, chosen before the losses are seen: the paired one where the rows pair, Welch's otherwise. Calling a
    gap resolved when either test rejects would be two tries at ALPHA (a true gap of 0 "resolved" more often than
    ALPHA)."""
    if not math.isnan(threshold := gap.stein_threshold):  # a planned row: its interval is gap +- threshold
        resolves = stein_resolves(gap.gap, threshold, bool(gap.undecided))
        return ("Stein", gap.gap - threshold, gap.gap + threshold) if resolves else None
    design, p, low, high = (("Welch", gap.p_value, gap.ci_low, gap.ci_high) if math.isnan(gap.p_paired) else
                            ("paired", gap.p_paired, gap.paired_ci_low, gap.paired_ci_high))
    return (design, low, high) if p < ALPHA else None


def _resolved(gap: Gap) -> str:
    if not math.isnan(gap.stein_threshold):  # a planned row has one verdict, Stein's: resolved, not, or none
        return f"not decidable (Stein): {gap.undecided}" if gap.undecided else \
            f"{'resolved' if _design(gap) else 'not resolved'} (Stein)"
    return f"resolved ({found[0]})" if (found := _design(gap)) else "not resolved" if gap.se > 0 else "n/a"


def _seeds(gap: Gap, needed: float, size: float) -> str:
    """A table cell: the seeds (or pairs) per arm ``needed`` for a gap of ``size``."""
    if gap.se == 0 or needed == math.inf:
        return "zero spread" if gap.se == 0 else f"> {MAX_SEEDS:,}" if size else "never: the gap is 0"
    return _num(needed, ",.0f")  # NaN: n/a


def _gap_cells(row: VariantSummary, comparison: Comparison) -> list[str]:
    """Gap (Welch's 95% CI), the paired CI, p, p paired, the verdict, MDE, paired MDE, seeds and pairs needed and,
    with a target gap, the seeds and pairs it needs (``llm.eval.stats``)."""
    target, stein = comparison.target_gap, _planned(comparison)
    blank = [""] * (4 if target is None else 6)  # the post-hoc columns: MDEs, seeds needed
    if (gap := row.gap) is None:
        return ["baseline" if row.variant in comparison.baselines else
                f"not compared: {row.not_compared}" if row.not_compared else "n/a", *[""] * (4 + stein), *blank]
    if not math.isnan(threshold := gap.stein_threshold):  # the planned test alone: the t-tests' figures are not it
        interval = "n/a" if gap.undecided else _interval(gap.gap - threshold, gap.gap + threshold)
        return [f"{gap.gap:+.4f}", "", "", "", _resolved(gap), interval, *blank]
    return [_gap(gap), _interval(gap.paired_ci_low, gap.paired_ci_high), _num(gap.p_value, ".3g"),
            _num(gap.p_paired, ".3g"), _resolved(gap), *(["n/a"] if stein else []),
            "zero spread" if gap.se == 0 else _num(gap.mde, ".4f"), _num(gap.paired_mde, ".4f"),
            *(_seeds(gap, needed, gap.gap) for needed in (gap.seeds_needed, gap.paired_seeds_needed)),
            *([] if target is None else [_seeds(gap, n, target) for n in (gap.target_seeds, gap.paired_target_seeds)])]


def _planned(comparison: Comparison) -> bool:
    """Whether a row is decided by its plan (``compare --planned``): the table then has Stein's interval column."""
    return any(row.gap and not math.isnan(row.gap.stein_threshold) for row in comparison.rows)


def _stein_columns(gap: Gap | None) -> dict[str, object]:
    """comparison.csv's planned test of a row: the plan's threshold, Stein's verdict and its interval."""
    if gap is None or math.isnan(threshold := gap.stein_threshold):
        return {}
    return {"planned_threshold": threshold, "stein_verdict": _resolved(gap),
            **({} if gap.undecided else {"stein_ci_low": gap.gap - threshold, "stein_ci_high": gap.gap + threshold})}


def _span(values: Sequence[str]) -> str:
    return values[0] if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def _open(label: str, gap: Gap) -> str:
    """An unresolved gap, which is no tie: the true one may be anything up to about its MDE; a planned row's, what
    its plan established (no post-hoc seed advice: more seeds would be a second look)."""
    if gap.undecided:
        return (f"{label} not decidable (Stein): {gap.undecided}; the rest of its planned seeds would be chosen by "
                "their outcome, so no loss verdict: report how often it diverged")
    if not math.isnan(threshold := gap.stein_threshold):
        return (f"{label} {gap.gap:+.4f} not resolved (Stein) {_interval(gap.gap - threshold, gap.gap + threshold)}, "
                f"although a true gap of {gap.planned_gap:g} or more would have been resolved with {POWER:.0%} power")
    designs = [("Welch", gap.mde, gap.seeds_needed, "seeds per arm"), ("paired", gap.paired_mde,
                                                                       gap.paired_seeds_needed, "pairs")]
    return f"{label} {gap.gap:+.4f} not resolved (" + "; ".join(
        f"{design}: MDE {mde:.3g}, " + ("no number of seeds resolves a gap of 0" if gap.gap == 0 else
                                        f"as a true gap it would need {_seeds(gap, needed, gap.gap)} {unit}")
        for design, mde, needed, unit in designs if not math.isnan(mde)) + ")"


def _conclusion(comparison: Comparison) -> list[str]:
    """One line under the table on what the comparison can and cannot conclude, and on which runs it left out;
    none without a baseline."""
    tested = {row.variant: row.gap for row in comparison.rows if row.gap is not None and row.gap.se > 0}
    if not tested:
        return ["", "Conclusion: no gap can be tested: that needs 2 or more complete seeds in a row and in a baseline "
                    "whose seeds mean what its own do (see the warnings), and losses that vary."] \
            if comparison.baselines else []
    resolved = [f"{label} {gap.gap:+.4f} resolved ({found[0]}) {_interval(*found[1:])}"
                for label, gap in tested.items() if (found := _design(gap))]
    rows = [row for row in comparison.rows if row.variant in tested or row.variant in comparison.baselines]
    open_ = [_open(label, gap) for label, gap in tested.items() if not _design(gap)]
    parts = [f"at p < {ALPHA}, {', '.join(resolved)}" if resolved else f"no gap is resolved at p < {ALPHA}",
             *([", ".join(open_)] if open_ else [])]
    if unplanned := [gap for gap in tested.values() if math.isnan(gap.stein_threshold)]:  # post-hoc figures
        paired_mdes = sorted(gap.paired_mde for gap in unplanned if not math.isnan(gap.paired_mde))
        parts.append(
            f"with {_span([str(n) for n in sorted({row.n for row in rows})])} seeds per arm this comparison resolves "
            f"gaps above {_span([f'{mde:.3g}' for mde in sorted(gap.mde for gap in unplanned)])} nats by "
            "Welch's test" + (f" and {_span([f'{mde:.3g}' for mde in paired_mdes])} paired" if paired_mdes else "")
            + f" with {POWER:.0%} power at the observed spread (taken as true: about 73% on average at 2-5 seeds "
            "per arm by Welch's test, 58-69% paired; see Assumptions), and a smaller true gap can go unseen")
    if untested := [row.variant for row in comparison.rows if row.gap is not None and row.variant not in tested]:
        parts.append(f"not testable (fewer than 2 seeds, or no spread): {', '.join(untested)}")
    if apart := [row.variant for row in comparison.rows if row.not_compared]:
        parts.append(f"not compared (their seeds mean other things than the baseline's: see the warnings): "
                     f"{', '.join(apart)}")
    if left_out := [f"{run.path.name} ({'diverged' if run.diverged else 'incomplete'})"
                    for row in rows for run in [*row.diverged, *row.incomplete]]:
        parts.append(f"the figures rest on complete seeds only, left out: {', '.join(left_out)}")
    return ["", f"Conclusion: {'; '.join(parts)}."]


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(map(str, cells)) + " |" for cells in rows)]


def _sensitivity(comparison: Comparison) -> list[str]:
    """Each row's loss at every value of the tuned keys, with its complete seeds and broken runs, and the mean the
    choice compared: over the seeds the values share (``llm.eval.tune.choose``), which can order the values
    otherwise than their means over all their seeds do."""
    rows = []
    for row in comparison.rows:
        chosen = tuple(row.tuned.get(key) for key in comparison.tune)
        points = comparison.sensitivity.get(row.variant, [])
        candidates, shared = scored(points), shared_seeds(points)
        for point in points:
            loss = "diverged" if not point.losses and point.diverged else _loss(point.summary.mean, point.summary.std)
            star = " *" if point.values == chosen and len(points) > 1 else ""
            compared = (f"{point.mean_over(shared):.4f} (seeds {', '.join(map(str, sorted(shared)))})"
                        if shared and point in candidates else "")
            rows.append([row.variant, *point.values, loss + star, len(point.losses), compared,
                         f"{point.diverged} / {point.incomplete}"])
    return ["", f"Sensitivity to {', '.join(comparison.tune)}: final validation loss at every value "
                "(mean ± std over complete seeds; * the chosen value, where a row ran at more than one; compared: "
                "the mean the choice compares, over the seeds the row's values share)", "",
            *_table(["Variant", *comparison.tune, "Val loss (mean ± std)", "n", "Compared",
                     "Diverged / incomplete"], rows)]


def _scaling(comparison: Comparison) -> list[str]:
    """Each series' loss at every size with its gap to the baseline of that size and what the seeds resolve of it
    (as in the main table), then each series' fit; empty when every variant comes in one size."""
    series = scaling_series(comparison)
    rows = [[found.label, f"{row.params_non_embedding:,}", _loss(row.val_loss_mean, row.val_loss_std), row.n,
             *_gap_cells(row, comparison)] for found in series for row in found.rows]
    if not rows:
        return []
    # no more sizes than the fit's two parameters: the line passes through every point, and nothing tests whether
    # the loss follows a power law at all
    fits = [[found.label, len(found.rows), f"{found.coefficient:.4g}", f"{found.exponent:.4f}",
             f"exact: {len(found.rows)} sizes for 2 parameters, nothing tests the power law" if len(found.rows) <= 2
             else f"least squares over {len(found.rows)} sizes"] for found in series]
    return ["", f"Scaling: final validation loss against non-embedding parameters N, and the gap to "
                f"{comparison.baseline} at the same size (¹ ⁵ ⁶ as above)", "",
            *_table(["Variant", "Params (non-emb.)", "Val loss (mean ± std)", "n",
                     *(cell.rstrip(" ¹⁵⁶⁷") for cell in _gap_header(comparison))], rows),
            "", "Fit L = a · N^b of each variant's mean loss over its sizes (scaling.png; b < 0: the loss falls with "
                "size)", "",
            *_table(["Variant", "Sizes", "a", "b", "Fit"], fits)]


def _gap_header(comparison: Comparison) -> list[str]:
    target = [] if comparison.target_gap is None else [f"Seeds for gap {comparison.target_gap:g} ⁶",
                                                       f"Pairs for gap {comparison.target_gap:g} ⁵ ⁶"]
    stein = [f"At p < {ALPHA} ¹ ⁵ / Stein ⁷", "Stein interval ⁷"] if _planned(comparison) else [f"At p < {ALPHA} ¹ ⁵"]
    return ["Gap (95% CI) ¹", "Paired 95% CI ⁵", f"p vs {comparison.baseline} ¹", "p paired ⁵", *stein, "MDE ⁶",
            "MDE paired ⁵ ⁶", "Seeds needed ⁶", "Pairs needed ⁵ ⁶", *target]


def _loss_cell(row: VariantSummary, comparison: Comparison) -> str:
    """The row's loss, or why it has none."""
    if row.runs:
        return _loss(row.val_loss_mean, row.val_loss_std)
    if any(point.losses for point in comparison.sensitivity.get(row.variant, [])):
        return "no value stable in every seed"
    return "all diverged" if row.diverged else "n/a"


def _valued(header: Sequence[str], rows: Sequence[Sequence[object]]) -> tuple[list[str], list[list[object]]]:
    """The columns with a value in some row: a column that is n/a or empty in every row says nothing (one seed per
    row leaves ten such columns)."""
    keep = [i for i in range(len(header)) if any(str(cells[i]) not in ("", "n/a") for cells in rows)]
    return [header[i] for i in keep], [[cells[i] for i in keep] for cells in rows]


def format_table(comparison: Comparison, full: Path | None = None) -> str:
    """The comparison as a Markdown table with footnotes (also readable as plain text), then, with ``tune``,
    the sensitivity table, and, when a variant comes in several sizes, the scaling table. Given the path of the
    ``full`` table (the console's view of comparison.md), the main table shows only the columns with a value in some
    row and says where the full one is."""
    rows = [[row.variant + (f" [{row.key}]" if row.key else ""), *(row.tuned.get(k, "n/a") for k in comparison.tune),
             _params(row.params_total), _params(row.params_non_embedding), _loss_cell(row, comparison), row.n,
             f"{len(row.diverged)} / {len(row.incomplete)}", *_gap_cells(row, comparison),
             _num(row.training_stability, ".3g"), _num(row.tokens_per_s, ",.0f")] for row in comparison.rows]
    header = ["Variant", *comparison.tune, "Params (total)", "Params (non-emb.)", "Val loss (mean ± std)", "n",
              "Diverged / incomplete ⁴", *_gap_header(comparison), "Grad-norm variance after warmup ²", "Tokens/s ³"]
    shown, cells = (header, rows) if full is None else _valued(header, rows)
    lines = _table(shown, cells)
    if len(shown) < len(header):
        lines.append(f"(only the columns with a value; every column: {full}, and comparison.csv beside it)")
    scopes = sorted({row.seed_scope for row in comparison.rows})
    lines += [*_conclusion(comparison), "", *(f"- {note}" for note in (
        *(["[key]: a short name of the row's configuration (less its size), which --baseline accepts."]
          if any(row.key for row in comparison.rows) else []),
        "Val loss: mean ± sample std (ddof=1) over the n complete seeds."
        + (f" Each row at the value of {', '.join(comparison.tune)} with the lowest mean over the seeds its "
           "values share." if comparison.tune else ""),
        f"¹ Gap: the row's mean minus {comparison.baseline}'s"
        f"{' at the same model size' if len(comparison.baselines) > 1 else ''}; Welch's 95% interval and t-test.",
        "² Pre-clip gradient-norm variance after warmup, in squared norm units (isogmlp 4.3), mean over seeds.",
        "³ Median throughput of each run, mean over seeds.",
        "⁴ Left out: diverged (final val loss not finite or above ln(vocabulary size), uniform prediction's) or "
        "incomplete.",
        "⁵ Paired by seed: the same seeds on the same data; the verdict is the paired test where rows pair, Welch's "
        "otherwise.",
        f"⁶ Seeds per arm (pairs, paired) at {POWER:.0%} power, p < {ALPHA}, the observed spreads taken as true"
        + ("" if comparison.target_gap is None else f"; for a gap of {comparison.target_gap:g} (--target-gap)") + ".",
        "Seed scope: " + "; ".join(SEED_SCOPES[scope] for scope in scopes)
        + ("" if len(scopes) < 2 else " (each row's: seed_scope in comparison.csv)."),
        ASSUMPTIONS, *([OPTIMISM_NOTE] if comparison.tune else []),
        *([STEIN_NOTE] if _planned(comparison) else []),
        f"Method: {METHOD}.", *(f"Warning: {w}" for w in comparison.warnings)))]
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
        writer.writerows({**row.as_csv_row(), **_stein_columns(row.gap)} for row in comparison.rows)
    return md_path, csv_path
