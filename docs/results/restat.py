"""Rewrite a stored comparison with today's gap statistics when its run directories are gone.

    python docs/results/restat.py DIR [--name comparison] [--losses SOURCE ...]

The runs behind docs/results were not kept (only their comparisons and statistics were committed), so ``eval.py
compare`` cannot be rerun on them. It does not need to be: ``comparison.csv`` keeps each row's mean, sample std
and seed count at full precision, and those are all that Welch's interval, p-value, minimum detectable effect and
seeds needed use (``llm.eval.stats``). The paired figures need each seed's loss: SOURCE is a ``stats.md`` written by
docs/results/replicate-cpu/stats.py (its "Val loss per seed" column, 4 decimals) or ``VARIANT=LOSS,LOSS,...`` in
seed order. A row's per-seed losses are found by variant name and checked against the stored mean (1e-4); every
run of these comparisons read the same data in the same order on one process, so rows with the same seeds pair up.

DIR/NAME.md and DIR/NAME.csv are rewritten by ``llm.eval.report.write_comparison`` from those stored numbers. What
needs the runs themselves is kept as stored: the warnings, and with ``--tune`` the sensitivity table (whose
"Diverged" column becomes "Diverged / incomplete": every run of these results finished).
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

from llm.eval.compare import DEFAULT_BASELINE, Comparison, VariantSummary
from llm.eval.report import CSV_COLUMNS, write_comparison
from llm.eval.stats import Summary, gap_to_baseline


def _left_out(row: dict[str, str], status: str) -> list[SimpleNamespace]:
    """Stand-ins for a stored row's diverged or incomplete runs, which only their count names (the runs are gone)."""
    return [SimpleNamespace(path=Path(f"{row['variant']} run (not kept)"), diverged=status == "diverged")
            for _ in range(int(row.get(status) or 0))]


def per_seed_losses(sources: list[str]) -> list[tuple[str, list[float]]]:
    """(variant, losses in seed order) from stats.md files and VARIANT=LOSS,... arguments."""
    found = []
    for source in sources:
        if "=" in source:
            variant, losses = source.split("=", 1)
            found.append((variant, [float(x) for x in losses.split(",")]))
            continue
        for line in Path(source).read_text().splitlines():
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if len(cells) == 6 and re.fullmatch(r"[\d.]+(, [\d.]+)+", cells[2]):
                found.append((cells[0], [float(x) for x in cells[2].split(", ")]))
    return found


def _number(cell: str) -> float:
    """A stored csv cell: empty where undefined (older files wrote nan)."""
    return float(cell or "nan")


def _losses_of(variant: str, mean: float, n: int, found: list[tuple[str, list[float]]]) -> list[float] | None:
    matches = [losses for name, losses in found
               if name == variant and len(losses) == n and abs(statistics.fmean(losses) - mean) < 1e-4]
    if n > 1 and len({tuple(m) for m in matches}) != 1:
        sys.exit(f"error: {variant} (mean {mean:.5f}, {n} seeds): {len(matches)} per-seed rows match; expected 1")
    return matches[0] if matches else None


def _kept(old_md: str) -> tuple[list[str], list[str]]:
    """The old table's warnings and its sensitivity section (with the broken-run column of today's table)."""
    warnings = [line.removeprefix("- Warning: ") for line in old_md.splitlines() if line.startswith("- Warning: ")]
    sensitivity: list[str] = []
    if "\nSensitivity to " in old_md:
        section = old_md[old_md.index("\nSensitivity to "):].split("\n\nScaling:")[0]
        for line in section.splitlines():
            if line.startswith("| Variant"):
                line = line.replace("| Diverged |", "| Diverged / incomplete |")
            elif line.startswith("| ") and not line.startswith("|---"):
                line = re.sub(r"\| (\d+) \|$", r"| \1 / 0 |", line)
            sensitivity.append(line)
        sensitivity[1] = sensitivity[1].replace("* the chosen value)", "* the chosen value, where a row ran at more "
                                                                        "than one)")
    return warnings, sensitivity


def restat(out: Path, name: str, sources: list[str]) -> None:
    md_path, csv_path = out / f"{name}.md", out / f"{name}.csv"
    with csv_path.open() as f:
        stored = list(csv.DictReader(f))
    tune = tuple(column for column in stored[0] if column not in CSV_COLUMNS)
    found = per_seed_losses(sources)
    rows = []
    for row in stored:
        variant = row["variant"]
        series, _, size = variant.partition(" (")
        rows.append((row, series, size, _losses_of(series, _number(row["val_loss_mean"]), int(row["n_seeds"]), found)))
    baselines = {size: (row, losses) for row, series, size, losses in rows if series == DEFAULT_BASELINE}
    summaries = []
    for row, series, size, losses in rows:
        seeds = [int(s) for s in row["seeds"].split()]
        gap = None
        if series != DEFAULT_BASELINE and size in baselines:
            base, base_losses = baselines[size]
            paired = losses and base_losses and row["seeds"] == base["seeds"]
            gap = gap_to_baseline(*(Summary(_number(r["val_loss_mean"]), _number(r["val_loss_std"]),
                                            int(r["n_seeds"])) for r in (row, base)),
                                  (losses, base_losses) if paired else None)
            stored_p = _number(row["p_value"])
            if not (math.isclose(gap.p_value, stored_p, rel_tol=1e-9) or math.isnan(gap.p_value + stored_p)):
                sys.exit(f"error: {variant}: Welch p {gap.p_value} from the stored summary, stored {stored_p}")
        summaries.append(VariantSummary(
            variant=row["variant"], runs=[SimpleNamespace(seed=s) for s in seeds],
            params_total=int(row["params_total"]), params_non_embedding=int(row["params_non_embedding"]),
            val_loss_mean=_number(row["val_loss_mean"]), val_loss_std=_number(row["val_loss_std"]),
            training_stability=_number(row["training_stability"]), tokens_per_s=_number(row["tokens_per_s"]),
            final_tokens=int(row["final_tokens"]), diverged=_left_out(row, "diverged"),
            incomplete=_left_out(row, "incomplete"), tuned={key: _number(row[key]) for key in tune},
            series=series, size=(size,), gap=gap))
    warnings, sensitivity = _kept(md_path.read_text())
    labels = [row["variant"] for row, series, *_ in rows if series == DEFAULT_BASELINE]
    comparison = Comparison(baseline=DEFAULT_BASELINE, rows=summaries, warnings=warnings, tune=tune,
                            baselines=tuple(labels))
    for written, path in zip(write_comparison(comparison, out), (md_path, csv_path), strict=True):
        written.replace(path)  # write_comparison names them comparison.md / .csv
    if sensitivity:  # today's table with the stored sensitivity in place of an empty one
        text = md_path.read_text()
        start = text.index("\nSensitivity to ")
        end = text.index("\n\nScaling:") if "\n\nScaling:" in text else len(text)
        md_path.write_text(text[:start] + "\n".join(sensitivity).rstrip("\n") + "\n" + text[end:].lstrip("\n"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--name", default="comparison", help="NAME.md and NAME.csv in DIR")
    parser.add_argument("--losses", nargs="*", default=[], metavar="SOURCE")
    args = parser.parse_args()
    restat(args.dir, args.name, args.losses)


if __name__ == "__main__":
    main()
