"""What pairing saves on the stored CPU results: docs/results/seeds-per-design.md.

    python docs/results/seeds_per_design.py > docs/results/seeds-per-design.md

Per row of the stored comparisons (the runs are not kept; docs/results/restat.py reads the same numbers): the
seeds' SDs of the row and its baseline (comparison.csv, full precision), the SD of their per-seed differences
(stats.md or the document-masking README's per-seed losses, 4 decimals), and the seeds per arm that Welch's test
and the paired t-test need to resolve a true gap of 0.02 and 0.05 nats with 80% power, taking those SDs as the
true ones (``llm.eval.stats``); then what ``eval.py compare --plan`` would launch from these seeds as a pilot
(``llm.eval.plan``: Stein's rule, which does not take them as true).
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # this checkout's llm
sys.path.insert(0, str(HERE))

from restat import per_seed_losses  # noqa: E402

from llm.eval.plan import design  # noqa: E402
from llm.eval.stats import MAX_SEEDS, pairs_needed, seeds_needed  # noqa: E402

BASELINE, GAPS, PLAN = "swiglu+softmax", (0.02, 0.05), 0.02
SOURCES = {  # results directory, its comparison, the per-seed losses
    "replicate-cpu": ("comparison", ["replicate-cpu/stats.md"]),
    "replicate-cpu-tuned": ("comparison", ["replicate-cpu-tuned/stats.md"]),
    "document-masking-cpu (masked)": ("comparison-masked", [
        "swiglu+softmax=6.8682,6.8347", "isogmlp+softmax=6.8162,6.7827"]),
    "document-masking-cpu (unmasked)": ("comparison-unmasked", [
        "swiglu+softmax=6.8599,6.8455", "isogmlp+softmax=6.7728,6.7593"]),
}


def _count(seeds: float) -> str:
    return f"> {MAX_SEEDS:,}" if math.isinf(seeds) else f"{seeds:,.0f}"


def rows() -> list[list[str]]:
    table = []
    for label, (name, sources) in SOURCES.items():
        directory = HERE / label.split(" ")[0]
        losses = dict(per_seed_losses([s if "=" in s else str(HERE / s) for s in sources]))
        with (directory / f"{name}.csv").open() as f:
            stored = {row["variant"]: row for row in csv.DictReader(f)}
        base = stored[BASELINE]
        for variant, row in stored.items():
            if variant == BASELINE or variant not in losses:
                continue
            assert row["seeds"] == base["seeds"], f"{label} {variant}: other seeds than the baseline's"
            sd, base_sd, n = float(row["val_loss_std"]), float(base["val_loss_std"]), int(row["n_seeds"])
            differences = [a - b for a, b in zip(losses[variant], losses[BASELINE], strict=True)]
            # Rounding each loss to 4 decimals moves each difference by up to 1e-4, and so their SD by up to
            # 1e-4 * sqrt(n / (n - 1)): an SD below that is taken at that bound (marked <=).
            rounding = 1e-4 * math.sqrt(n / (n - 1))
            paired_sd, below = max(statistics.stdev(differences), rounding), statistics.stdev(differences) < rounding
            welch_sd = math.hypot(sd, base_sd)  # the SD of one seed's difference were the arms' seeds independent
            pilot = design(PLAN, (n, n), (sd**2, base_sd**2), paired_sd**2)
            at_most = "<= " if below else ""
            table.append([label, variant, str(n), f"{at_most}{paired_sd:.4f}", f"{welch_sd:.4f}",
                          f"{at_most}{paired_sd / welch_sd:.2f}",
                          *(f"{_count(seeds_needed(gap, sd, base_sd))} / "
                            f"{at_most}{_count(pairs_needed(gap, paired_sd))}" for gap in GAPS),
                          f"{'paired' if pilot[0] else 'Welch'}, {_count(float(pilot[1]))}"])
    return table


def chance_ratios(seeds: int, draws: int = 400_000) -> tuple[float, float]:
    """The 2.5% and 97.5% quantiles of the ratio for two rows whose normal seeds share nothing (seeded)."""
    rng = np.random.default_rng(0)
    row, base = rng.normal(size=(2, draws, seeds))
    ratio = (row - base).std(axis=1, ddof=1) / np.sqrt(row.var(axis=1, ddof=1) + base.var(axis=1, ddof=1))
    return float(np.quantile(ratio, 0.025)), float(np.quantile(ratio, 0.975))


def main() -> None:
    header = ["Results", "Variant", "Seeds", "SD of paired differences", "SD of a difference, unpaired",
              "Ratio", "Seeds per arm for 0.02 nats: Welch / paired", "for 0.05 nats: Welch / paired",
              f"--plan {PLAN} from these seeds"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows():
        print("| " + " | ".join(row) + " |")
    print("\nRows whose seeds share nothing give a ratio in " + " and ".join(
        "{:.2f}-{:.2f} at {} seeds".format(*chance_ratios(n), n) for n in (3, 2)) + " (95% of draws, normal seeds).")


if __name__ == "__main__":
    main()
