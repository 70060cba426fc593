"""This tree's training step against another commit's, paired per round: is a change faster or slower?

    git worktree add /tmp/base 6acb01c
    .venv/bin/python bench/bench_trees.py --baseline-tree /tmp/base --threads 2          # eager, CPU
    .venv/bin/python bench/bench_trees.py --baseline-tree /tmp/base --variants swiglu+softmax swiglu+iso_tanh \\
        --csv trees.csv

Two versions of the ``llm`` package cannot share one Python process, so each row runs in its own worker process
(bench/tree_worker.py), started in its tree with that tree's ``llm`` and presets: for each variant ``--processes``
workers in this tree and as many in the baseline tree. The workers build the same model from the same seed and the
same batch, and take one warm-up step. Then every round asks each worker in turn (in an order rotated from round to
round) for one timed step; only one worker computes at a time, so they do not share the CPU, and both sides pay the
same process overheads, which stay outside the timed step. ``ratio`` is this tree's tokens/s over the baseline
tree's for the same variant, per round, summarised as the median over rounds with a 95% interval (bench/paired.py).

A process keeps some offset for its whole life (where its memory landed, say): two workers of the same commit
read 0.993x and 1.006x over 60 rounds on a quiet CPU (docs/performance.md), with intervals that resampling rounds
alone made about that narrow. So each (variant, tree) runs in ``--processes`` workers (default 2), worker p of this
tree paired with worker p of the baseline, and the interval is a two-stage bootstrap (``grouped_interval``) that
draws the process pairs, then their rounds: the process offsets are in it. Comparing a tree with itself gives a
ratio near 1.00 whose interval shows the noise floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from paired import grouped_interval, round_ratios, write_csv

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "tree_worker.py"


def tree_label(tree: Path) -> str:
    """The tree's short commit, with "+changes" where its working tree differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True,
                          check=False).stdout.strip() or tree.name
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree, capture_output=True,
                           text=True, check=False).stdout.strip()
    return head + ("+changes" if dirty else "")


class Worker:
    """A tree_worker.py process for one variant in one tree."""

    def __init__(self, tree: Path, variant: str, settings: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "--variant", variant, *settings], cwd=tree,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.first_step = float(self.reply().removeprefix("ready "))

    def reply(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker for {self.proc.args[3:5]} in {self.proc.args} exited "
                               f"(code {self.proc.wait()}); its error is above")
        return line.strip()

    def step(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return float(self.reply())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, required=True, help="a checkout (git worktree) to compare with")
    parser.add_argument("--variants", nargs="+", default=["swiglu+softmax"], metavar="FFN+SCORING")
    parser.add_argument("--preset", default="small-cpu", help="configs/sizes/<preset>.yaml (each tree's own)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--processes", type=int, default=2,
                        help="workers per (variant, tree), paired p with p; their offsets enter the interval")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker on CPU (0: torch's default)")
    parser.add_argument("--compile", action="store_true", help="compile as train.compile does")
    parser.add_argument("--csv", metavar="PATH", help="also write one line per row (paired.CSV_COLUMNS)")
    args = parser.parse_args()
    baseline = args.baseline_tree.resolve()
    if not (baseline / "llm" / "__init__.py").is_file():
        parser.error(f"--baseline-tree: {args.baseline_tree} holds no llm/ package (give a checkout of this repo)")
    settings = ["--preset", args.preset, "--batch", str(args.batch), "--seq", str(args.seq), "--device",
                args.device, "--dtype", args.dtype, "--threads", str(args.threads),
                *(["--compile"] if args.compile else [])]
    if args.processes < 1:
        parser.error("--processes: at least 1")
    labels = {REPO: tree_label(REPO), baseline: tree_label(baseline)}
    workers = {(variant, tree, p): Worker(tree, variant, settings)
               for p in range(args.processes) for variant in args.variants for tree in labels}
    seconds: dict[tuple[str, Path, int], list[float]] = {key: [] for key in workers}
    try:
        keys = list(workers)
        for r in range(args.rounds):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                seconds[key].append(workers[key].step())
    finally:
        for worker in workers.values():
            worker.close()
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
            first = statistics.mean(workers[variant, tree, p].first_step for p in range(args.processes))
            print(f"{name:<40}{value:>10.0f}{ratio!s:>26}{first:>9.1f}")
            figures.append({"variant": name, "tokens_per_s": value, "ratio": ratio.median,
                            "ratio_ci_low": ratio.low, "ratio_ci_high": ratio.high, "rounds": ratio.rounds,
                            "mfu": None})
    if args.csv:
        write_csv(Path(args.csv), figures)


if __name__ == "__main__":
    main()
