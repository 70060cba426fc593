"""This tree's training step against another commit's, paired per round: is a change faster or slower?

    git worktree add /tmp/base 6acb01c
    .venv/bin/python bench/bench_trees.py --baseline-tree /tmp/base --threads 2          # eager, CPU
    .venv/bin/python bench/bench_trees.py --baseline-tree /tmp/base --variants swiglu+softmax swiglu+iso_tanh \\
        --csv trees.csv

Two versions of the ``llm`` package cannot share one Python process, so each row runs in its own worker process
(this script with ``--worker VARIANT``, bench/harness.py ``Worker``), started in its tree with that tree's ``llm``
and presets: for each variant ``--processes`` workers in this tree and as many in the baseline tree. The workers
build the same model from the same seed and the same batch, and take one warm-up step. Then every round asks each
worker in turn (in an order rotated from round to round) for one timed step; only one worker computes at a time, so
they do not share the CPU, and both sides pay the same process overheads, which stay outside the timed step.
``ratio`` is this tree's tokens/s over the baseline tree's for the same variant, per round, summarised as the median
over rounds with a 95% interval (bench/paired.py).

A process keeps some offset for its whole life (where its memory landed, say): two workers of the same commit
read 0.993x and 1.006x over 60 rounds on a quiet CPU (docs/performance.md), with intervals that resampling rounds
alone made about that narrow. So each (variant, tree) runs in ``--processes`` workers (default 2), worker p of this
tree paired with worker p of the baseline, and the interval is a two-stage bootstrap (``grouped_interval``) that
draws the process pairs, then their rounds: the process offsets are in it. Comparing a tree with a second checkout
of its commit (``git worktree add DIR HEAD``) gives a ratio near 1.00 whose interval shows the noise floor; this
tree itself is refused as the baseline (each worker would be paired with itself: an exact 1.000x, no noise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import harness
from harness import DTYPES, Worker, make_step, positive_int, serve, timed, worker_rounds
from paired import csv_row, grouped_interval, round_ratios

REPO = Path(__file__).resolve().parents[1]


def tree_label(tree: Path) -> str:
    """The tree's short commit, with "+changes" where its working tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True, check=False).stdout.strip()
    return (git("rev-parse", "--short", "HEAD") or tree.name) + (
        "+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def worker(args: argparse.Namespace) -> None:
    """One row: a training step of ``args.worker`` (FFN+SCORING) built from the ``llm`` package of the tree this
    process runs in (``PYTHONPATH`` and working directory set to it), built as bench_train_step.py builds it
    (step_rows.py ``ours``) and timed on request (bench/harness.py ``serve``). It uses only what every tree of this
    repository since the fused loss has (``load_config``, ``IsoLLMForCausalLM(shift_labels=...)``,
    ``compile_decoder_layers``, ``tf32_matmuls`` in harness.py's ``make_step``), so that an older commit's tree runs
    it unchanged; bench/ itself is this tree's."""
    import dataclasses

    import torch
    from step_rows import Spec, ours

    from llm.config import load_config

    device, ffn, scoring = torch.device(args.device), *args.worker.split("+")
    base = load_config(f"configs/sizes/{args.preset}.yaml", ["train.max_steps=1", f"data.seq_len={args.seq}"]).model
    config = dataclasses.replace(base, ffn=ffn, attn_scoring=scoring, ffn_param_match=ffn != "swiglu")
    torch.manual_seed(0)
    row = ours(Spec(config), torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), device=device),
               args.compile)
    step = timed(make_step(row.model.parameters(), row.loss, device, DTYPES[args.dtype]), device)
    serve(step, {"first_step_s": step()})


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--baseline-tree", type=Path, required=True, help="a checkout (git worktree) to compare with")
    parser.add_argument("--variants", nargs="+", default=["swiglu+softmax"], metavar="FFN+SCORING")
    parser.add_argument("--processes", type=positive_int, default=2,
                        help="workers per (variant, tree), paired p with p; their offsets enter the interval")
    parser.add_argument("--worker", metavar="FFN+SCORING", help=argparse.SUPPRESS)
    args = harness.parse(parser, "--preset", "--batch", "--seq", "--compile", "--rounds", "--device", "--dtype",
                         "--threads", "--csv")
    if args.worker:
        return worker(args)
    baseline = args.baseline_tree.resolve()
    if not (baseline / "llm" / "__init__.py").is_file():
        parser.error(f"--baseline-tree: {args.baseline_tree} holds no llm/ package (give a checkout of this repo)")
    if baseline == REPO:  # its workers would be this tree's: each paired with itself, an exact 1.000x, no noise
        parser.error(f"--baseline-tree: {args.baseline_tree} is this tree (give another: git worktree add DIR HEAD)")
    labels = {REPO: tree_label(REPO), baseline: tree_label(baseline)}
    # each worker runs in its tree, with that tree's llm and presets
    info, seconds = worker_rounds({(variant, tree, p): lambda v=variant, t=tree: Worker(
        [sys.executable, __file__, *sys.argv[1:], "--worker", v], cwd=t, env={**os.environ, "PYTHONPATH": str(t)})
        for p in range(args.processes) for variant in args.variants for tree in labels}, args.rounds)
    tokens = args.batch * args.seq
    print(f"# training step, {args.preset}, batch {args.batch} x {args.seq}, {args.dtype}, {args.device}"
          f"{', compiled' if args.compile else ''}, {args.rounds} rounds x {args.processes} processes per row; this "
          f"tree {labels[REPO]} ({REPO}) against {labels[baseline]} ({baseline}); ratio: tokens/s over the baseline "
          f"tree's, paired per round and process, median [95% interval over processes and rounds]")
    print(f"{'row':<40}{'tokens/s':>10}{'ratio [95% interval]':>26}{'first s':>9}")
    figures = []
    for variant in args.variants:
        for tree in labels:
            ratio = grouped_interval([round_ratios(seconds[variant, tree, p], seconds[variant, baseline, p])
                                      for p in range(args.processes)])
            name = f"{variant} @ {labels[tree]}"
            value = statistics.median(tokens / s for p in range(args.processes) for s in seconds[variant, tree, p])
            first = statistics.mean(info[variant, tree, p]["first_step_s"] for p in range(args.processes))
            print(f"{name:<40}{value:>10.0f}{ratio!s:>26}{first:>9.1f}")
            figures.append(csv_row(name, f"{variant} @ {labels[baseline]}", value, ratio))
    harness.write_figures(args, rows=figures)


if __name__ == "__main__":
    main()
