"""The optimizer-by-FFN statistics of docs/results/muon-cpu/README.md, which ``eval.py compare`` does not print.

    python docs/results/muon-cpu/stats.py 'runs/muon-*-s[0-9]' 'runs/muonlr-*' > docs/results/muon-cpu/stats.md

Every run of the study shares its data order, validation set, lr and budget; a run's seed fixes its
initialisation, which the two optimizers share exactly (the optimizer draws no random numbers), so every
contrast below is paired by seed: the figure is the mean over seeds of a per-seed difference, with a
two-sided paired t 95% interval (n - 1 degrees of freedom: with 2 seeds the interval's half-width is
12.7 standard errors, with 3 it is 4.3).

1. the final validation loss of each (FFN, optimizer) cell, mean ± SD over seeds;
2. Muon - AdamW for each FFN (same init, same data: the optimizer's effect alone);
3. each isotropic FFN's gap to SwiGLU under each optimizer, and the interaction (the gap under Muon minus the
   gap under AdamW): does the gap change size or sign when the optimizer stops privileging the basis? With the
   interaction's SD over seeds, its minimum detectable effect and the seeds the observed one would need;
4. per layer (the residual stream after each block, ``llm.metrics.layers``) at the last evaluation:
   ``basis_alignment`` (1 = no preferred basis; > 1 = mass on a few standard-basis coordinates) and IsoScore
   (rotation invariant), each cell's mean and Muon - AdamW per FFN, paired.
5. the lr check: runs at another ``train.lr`` than the study's (the lr most runs have), SwiGLU under each
   optimizer. Per optimizer the loss at each lr and the change from the study's lr, paired; and Muon - AdamW with
   each at its best lr tried (chosen on the same seeds it is reported on: optimistic where the lrs are close);
6. the other FFNs at another lr: each gap to SwiGLU at that lr and optimizer, per seed, beside the same seed's
   gap under AdamW at the study's lr, and their difference (the interaction at that lr, seed by seed);
7-10. sections 1-4 again with each optimizer at its best lr of section 5, where every FFN has runs there: the
   question the study asks, since the shared lr is not Muon's best;
11. at those lrs, the per-layer metrics at matched loss: each Muon run at its first evaluation at or below the same
   seed's final AdamW loss (Muon gets there in a quarter of the steps at its tuned lr; matched only as finely as
   the evaluations are spaced).
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence

from llm.eval.runs import RunRecord, expand_run_dirs, load_run
from llm.eval.stats import Summary, paired_interval, paired_mde, pairs_needed
from llm.eval.tune import choose, tune_points

BASELINE_FFN = "swiglu"
OPTIMIZERS = ("adamw", "muon")


def paired(differences: Sequence[float]) -> str:
    """Mean of per-seed differences with its paired t 95% interval (``llm.eval.stats.paired_interval``, as compare's
    paired column: n - 1 degrees of freedom)."""
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return f"{mean:+.4f} (1 seed: no interval)"
    low, high = paired_interval(differences, [0.0] * len(differences))
    return f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]"


def mean_sd(values: Sequence[float]) -> str:
    summary = Summary.of(values)
    return f"{summary.mean:.4f}" if summary.n < 2 else f"{summary.mean:.4f} ± {summary.std:.4f}"


def last_eval(run: RunRecord) -> dict:
    return run.evals[-1]


def main(patterns: Sequence[str]) -> None:
    by_lr: dict[float, dict[tuple[str, str], dict[int, RunRecord]]] = defaultdict(lambda: defaultdict(dict))
    for path in expand_run_dirs(patterns):
        run = load_run(path)
        if not run.complete:  # a run still going (or killed) would enter with an earlier step's loss
            sys.exit(f"{path}: {run.status} (last evaluation at step {last_eval(run)['step'] if run.evals else None} "
                     f"of {run.last_step}): only complete runs are compared")
        by_lr[run.config.train.lr][(run.config.model.ffn, run.config.train.optimizer)][run.seed] = run
    study_lr = max(by_lr, key=lambda lr: sum(map(len, by_lr[lr].values())))
    cells = by_lr[study_lr]
    print(f"Runs at the study's train.lr = {study_lr:g}: {sum(map(len, cells.values()))}.\n")
    cell_sections(cells, 1, f"at the shared lr {study_lr:g}")
    if len(by_lr) == 1:
        return
    best = lr_check(by_lr, study_lr)
    tuned = {(ffn, opt): by_lr[best[opt]].get((ffn, opt), {}) for ffn, opt in cells}
    if all(tuned.values()) and any(best[opt] != study_lr for opt in OPTIMIZERS):
        print(f"\n# At each optimizer's tuned lr: AdamW at {best['adamw']:g}, Muon at {best['muon']:g}\n\n"
              "The lrs section 5 chose on SwiGLU's seed(s) every lr has; sections 7-10 repeat 1-4 on them, on the "
              "seeds every cell has at its optimizer's lr (the choosing seed among them: optimistic for SwiGLU's "
              "rows by as much as the lrs' noise).\n")
        cell_sections(tuned, 7, "at each optimizer's tuned lr")
        matched_loss(tuned)


def matched_loss(cells: dict[tuple[str, str], dict[int, RunRecord]]) -> None:
    """Section 11: the per-layer metrics of each Muon run at its first evaluation at or below the same seed's final
    AdamW loss, beside AdamW's final ones: the two optimizers compared where they reached the same loss, not after
    the same steps (at its tuned lr Muon is far ahead, and the metrics move as training goes on)."""
    print("\n## 11. Per-layer metrics at matched loss: each Muon run at its first evaluation at or below the same "
          "seed's final AdamW loss, beside that AdamW evaluation (paired by seed)\n")
    evals: dict[tuple[str, str], dict[int, dict]] = {}
    for ffn in ffn_order(cells):
        adamw, muon = cells[(ffn, "adamw")], cells[(ffn, "muon")]
        ends = {s: last_eval(adamw[s]) for s in set(adamw) & set(muon)}
        matched = {s: next((e for e in muon[s].evals if e["val_loss"] <= end["val_loss"]), None)
                   for s, end in ends.items()}
        evals[(ffn, "muon")] = {s: e for s, e in matched.items() if e is not None}
        evals[(ffn, "adamw")] = {s: ends[s] for s in evals[(ffn, "muon")]}
    for metric in ("basis_alignment", "isoscore"):
        print(f"\n`{metric}`:\n")
        layer_table(evals, metric, with_steps=True)


def ffn_order(cells: dict[tuple[str, str], object]) -> list[str]:
    """The FFNs of ``cells``, SwiGLU first."""
    return sorted({ffn for ffn, _ in cells}, key=lambda f: (f != BASELINE_FFN, f))


def layer_table(evals: dict[tuple[str, str], dict[int, dict]], metric: str, with_steps: bool = False) -> None:
    """Per FFN, ``metric`` at every layer of the given evaluations (cell -> seed -> evaluation), each optimizer's mean
    over the seeds both optimizers have, and Muon - AdamW paired by seed; ``with_steps``: each evaluation's step and
    loss too."""
    ffns = [ffn for ffn in ffn_order(evals) if set(evals[(ffn, "adamw")]) & set(evals[(ffn, "muon")])]
    layers = [entry["layer"] for entry in next(iter(evals[(ffns[0], "adamw")].values()))["layers"]]
    steps = "step, val loss per seed | " if with_steps else ""
    print(f"| FFN | optimizer | {steps}" + " | ".join(f"layer {i}" for i in layers) + " |\n|---|---|"
          + "---|" * (len(layers) + with_steps))
    for ffn in ffns:
        seeds = sorted(set(evals[(ffn, "adamw")]) & set(evals[(ffn, "muon")]))
        value = {opt: {s: [e[metric] for e in evals[(ffn, opt)][s]["layers"]] for s in seeds} for opt in OPTIMIZERS}
        for opt in OPTIMIZERS:
            at = evals[(ffn, opt)]
            where = ", ".join(f"{at[s]['step']}: {at[s]['val_loss']:.3f}" for s in seeds) + " | " if with_steps else ""
            means = [statistics.fmean(value[opt][s][i] for s in seeds) for i in range(len(layers))]
            print(f"| {ffn} | {opt} | {where}" + " | ".join(f"{m:#.4g}" for m in means) + " |")
        diffs = [paired([value["muon"][s][i] - value["adamw"][s][i] for s in seeds]) for i in range(len(layers))]
        print(f"| {ffn} | Muon - AdamW | {'| ' if with_steps else ''}" + " | ".join(diffs) + " |")


def cell_sections(cells: dict[tuple[str, str], dict[int, RunRecord]], first: int, where: str) -> None:
    """Sections ``first`` to ``first + 3``: the loss of each (FFN, optimizer) cell, Muon - AdamW, the gaps to
    SwiGLU and their interaction, and the per-layer metrics, on the seeds every cell has."""
    ffns = ffn_order(cells)
    seeds = sorted(set.intersection(*(set(runs) for runs in cells.values())))
    loss = {cell: {s: last_eval(runs[s])["val_loss"] for s in seeds} for cell, runs in cells.items()}
    steps = {last_eval(run)["step"] for runs in cells.values() for run in runs.values()}
    print(f"Seeds in every cell {where}: {seeds}; last evaluation at step(s) {sorted(steps)}.\n")

    print(f"## {first}. Final validation loss {where} (mean ± SD over seeds)\n")
    print("| FFN | " + " | ".join(OPTIMIZERS) + " |\n|---|" + "---|" * len(OPTIMIZERS))
    for ffn in ffns:
        print(f"| {ffn} | " + " | ".join(mean_sd(list(loss[(ffn, opt)].values())) for opt in OPTIMIZERS) + " |")

    print(f"\n## {first + 1}. Muon - AdamW {where}, final validation loss (paired by seed, 95% interval)\n")
    print("| FFN | Muon - AdamW |\n|---|---|")
    for ffn in ffns:
        print(f"| {ffn} | {paired([loss[(ffn, 'muon')][s] - loss[(ffn, 'adamw')][s] for s in seeds])} |")

    print(f"\n## {first + 2}. Gap to {BASELINE_FFN} under each optimizer {where}, and the interaction (paired by "
          "seed)\n")
    print("| FFN | gap, AdamW | gap, Muon | gap under Muon - gap under AdamW | its SD over seeds | MDE | seeds for "
          "it |\n|---|---|---|---|---|---|---|")
    for ffn in ffns[1:]:
        gap = {opt: [loss[(ffn, opt)][s] - loss[(BASELINE_FFN, opt)][s] for s in seeds] for opt in OPTIMIZERS}
        interaction = [m - a for m, a in zip(gap["muon"], gap["adamw"], strict=True)]
        sd = statistics.stdev(interaction) if len(seeds) > 1 else math.nan
        print(f"| {ffn} | {paired(gap['adamw'])} | {paired(gap['muon'])} | {paired(interaction)} | {sd:.4f} | "
              f"{paired_mde(sd, len(seeds)):.4f} | {pairs_needed(abs(statistics.fmean(interaction)), sd):g} |")
    print("\nMDE: the interaction these seeds resolve with 80% power (paired t at p < 0.05, if the SD over seeds is "
          "the true one); seeds for it: the fewest that resolve the observed interaction so (llm.eval.stats).")

    for metric in ("basis_alignment", "isoscore"):
        print(f"\n## {first + 3}. `{metric}` per layer at the last evaluation {where} (mean over seeds; Muon - AdamW "
              "paired)\n")
        layer_table({cell: {s: last_eval(runs[s]) for s in seeds} for cell, runs in cells.items()}, metric)


def lr_check(by_lr: dict[float, dict[tuple[str, str], dict[int, RunRecord]]], study_lr: float) -> dict[str, float]:
    """Sections 5 and 6: every lr each optimizer ran SwiGLU at, and the other FFNs at another lr than the study's;
    returns each optimizer's best lr (``compare --tune``'s choice)."""
    loss = {(lr, ffn, opt): {s: last_eval(run)["val_loss"] for s, run in runs.items()}
            for lr, cells in by_lr.items() for (ffn, opt), runs in cells.items()}
    print(f"\n## 5. The lr check: {BASELINE_FFN} at every lr (changes paired by seed, on the seeds both lrs have)\n")
    print(f"| optimizer | train.lr | final val loss (mean ± SD) | seeds | change from lr {study_lr:g} |\n"
          "|---|---|---|---|---|")
    best = {}
    for opt in OPTIMIZERS:
        lrs = sorted(lr for lr, ffn, o in loss if (ffn, o) == (BASELINE_FFN, opt))
        for lr in lrs:
            here, study = loss[(lr, BASELINE_FFN, opt)], loss[(study_lr, BASELINE_FFN, opt)]
            shared = sorted(set(here) & set(study))
            change = "" if lr == study_lr else paired([here[s] - study[s] for s in shared]) + f" (seeds {shared})"
            print(f"| {opt} | {lr:g} | {mean_sd(list(here.values()))} | {sorted(here)} | {change} |")
        # the choice compare --tune makes (on the seeds every lr of this optimizer has)
        runs = [run for lr in lrs for run in by_lr[lr][(BASELINE_FFN, opt)].values()]
        best[opt] = choose(tune_points(runs, ["train.lr"])).values[0]
    seeds = sorted(set(loss[(best["muon"], BASELINE_FFN, "muon")]) & set(loss[(best["adamw"], BASELINE_FFN, "adamw")]))
    at_best = paired([loss[(best["muon"], BASELINE_FFN, "muon")][s] - loss[(best["adamw"], BASELINE_FFN, "adamw")][s]
                      for s in seeds])
    print(f"\nEach at its best lr tried (chosen on the seeds all its lrs share, then reported on them too: "
          f"optimistic): AdamW at {best['adamw']:g}, Muon at {best['muon']:g}; Muon - AdamW {at_best} "
          f"(seeds {seeds}).")
    others = sorted((lr, ffn, opt) for lr, ffn, opt in loss if lr != study_lr and ffn != BASELINE_FFN)
    if not others:
        return best
    print(f"\n## 6. The other FFNs at another lr: gap to {BASELINE_FFN} at the same lr and optimizer, per seed, beside "
          f"the gap under AdamW at lr {study_lr:g}\n")
    print(f"| FFN | optimizer | train.lr | seed | gap | gap, AdamW at lr {study_lr:g} | interaction |\n"
          "|---|---|---|---|---|---|---|")
    for lr, ffn, opt in others:
        for s in sorted(loss[(lr, ffn, opt)]):
            gap = loss[(lr, ffn, opt)][s] - loss[(lr, BASELINE_FFN, opt)][s]
            adamw = loss[(study_lr, ffn, "adamw")][s] - loss[(study_lr, BASELINE_FFN, "adamw")][s]
            print(f"| {ffn} | {opt} | {lr:g} | {s} | {gap:+.4f} | {adamw:+.4f} | {gap - adamw:+.4f} |")
    return best


if __name__ == "__main__":
    main(sys.argv[1:])
