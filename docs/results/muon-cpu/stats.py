"""The optimizer-by-FFN statistics of docs/results/muon-cpu/README.md, which ``eval.py compare`` does not print.

    python docs/results/muon-cpu/stats.py 'runs/muon-*-s[0-9]' > docs/results/muon-cpu/stats.md

Every run of the study shares its data order, validation set, lr and budget; a run's seed fixes its
initialisation, which the two optimizers share exactly (the optimizer draws no random numbers), so every
contrast below is paired by seed: the figure is the mean over seeds of a per-seed difference, with a
two-sided paired t 95% interval (n - 1 degrees of freedom: with 2 seeds the interval's half-width is
12.7 standard errors, with 3 it is 4.3).

1. the final validation loss of each (FFN, optimizer) cell, mean ± SD over seeds;
2. Muon - AdamW for each FFN (same init, same data: the optimizer's effect alone);
3. each isotropic FFN's gap to SwiGLU under each optimizer, and the interaction (the gap under Muon minus the
   gap under AdamW): does the gap change size or sign when the optimizer stops privileging the basis?
4. per layer (the residual stream after each block, ``llm.metrics.layers``) at the last evaluation:
   ``basis_alignment`` (1 = no preferred basis; > 1 = mass on a few standard-basis coordinates) and IsoScore
   (rotation invariant), each cell's mean and Muon - AdamW per FFN, paired.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence

from scipy import stats

from llm.eval.runs import RunRecord, expand_run_dirs, load_run

BASELINE_FFN = "swiglu"
OPTIMIZERS = ("adamw", "muon")


def paired(differences: Sequence[float]) -> str:
    """Mean of per-seed differences with its paired t 95% interval (n - 1 degrees of freedom)."""
    n = len(differences)
    mean = statistics.fmean(differences)
    if n < 2:
        return f"{mean:+.4f} (1 seed: no interval)"
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"


def mean_sd(values: Sequence[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def last_eval(run: RunRecord) -> dict:
    return run.evals[-1]


def main(patterns: Sequence[str]) -> None:
    cells: dict[tuple[str, str], dict[int, RunRecord]] = defaultdict(dict)
    for path in expand_run_dirs(patterns):
        run = load_run(path)
        cells[(run.config.model.ffn, run.config.train.optimizer)][run.seed] = run
    ffns = sorted({ffn for ffn, _ in cells}, key=lambda f: (f != BASELINE_FFN, f))
    seeds = sorted(set.intersection(*(set(runs) for runs in cells.values())))
    loss = {cell: {s: last_eval(runs[s])["val_loss"] for s in seeds} for cell, runs in cells.items()}
    steps = {last_eval(run)["step"] for runs in cells.values() for run in runs.values()}
    print(f"Runs: {sum(map(len, cells.values()))}; seeds in every cell: {seeds}; last evaluation at step(s) "
          f"{sorted(steps)}.\n")

    print("## 1. Final validation loss (mean ± SD over seeds)\n")
    print("| FFN | " + " | ".join(OPTIMIZERS) + " |\n|---|" + "---|" * len(OPTIMIZERS))
    for ffn in ffns:
        print(f"| {ffn} | " + " | ".join(mean_sd(list(loss[(ffn, opt)].values())) for opt in OPTIMIZERS) + " |")

    print("\n## 2. Muon - AdamW, final validation loss (paired by seed, 95% interval)\n")
    print("| FFN | Muon - AdamW |\n|---|---|")
    for ffn in ffns:
        print(f"| {ffn} | {paired([loss[(ffn, 'muon')][s] - loss[(ffn, 'adamw')][s] for s in seeds])} |")

    print(f"\n## 3. Gap to {BASELINE_FFN} under each optimizer, and the interaction (paired by seed)\n")
    print("| FFN | gap, AdamW | gap, Muon | gap under Muon - gap under AdamW |\n|---|---|---|---|")
    for ffn in ffns[1:]:
        gap = {opt: [loss[(ffn, opt)][s] - loss[(BASELINE_FFN, opt)][s] for s in seeds] for opt in OPTIMIZERS}
        interaction = [m - a for m, a in zip(gap["muon"], gap["adamw"], strict=True)]
        print(f"| {ffn} | {paired(gap['adamw'])} | {paired(gap['muon'])} | {paired(interaction)} |")

    for metric in ("basis_alignment", "isoscore"):
        print(f"\n## 4. `{metric}` per layer at the last evaluation (mean over seeds; Muon - AdamW paired)\n")
        layers = [entry["layer"] for entry in last_eval(next(iter(cells.values()))[seeds[0]])["layers"]]
        print("| FFN | optimizer | " + " | ".join(f"layer {i}" for i in layers) + " |\n|---|---|"
              + "---|" * len(layers))
        value = {cell: {s: [e[metric] for e in last_eval(runs[s])["layers"]] for s in seeds}
                 for cell, runs in cells.items()}
        for ffn in ffns:
            for opt in OPTIMIZERS:
                means = [statistics.fmean(value[(ffn, opt)][s][i] for s in seeds) for i in range(len(layers))]
                print(f"| {ffn} | {opt} | " + " | ".join(f"{m:.4g}" for m in means) + " |")
            diffs = [paired([value[(ffn, "muon")][s][i] - value[(ffn, "adamw")][s][i] for s in seeds])
                     for i in range(len(layers))]
            print(f"| {ffn} | Muon - AdamW | " + " | ".join(diffs) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
