"""The tuned replication, resumable: a run whose last checkpoint exists is not run again.

    python docs/results/replicate-cpu-tuned/run.py tune                # lr grid at width 64, seed 0
    python docs/results/replicate-cpu-tuned/run.py confirm 256 64 128  # seeds 1-3 at each variant's chosen lr
    python docs/results/replicate-cpu-tuned/run.py check 256 iso_ln=4e-3  # the confirm seeds at another lr
    python docs/results/replicate-cpu-tuned/run.py fresh 256 iso_ln=4e-3  # seeds 4-6 at the lr chosen there

Every run is configs/experiments/replicate-cpu.yaml under muP (base width 256, the replication's width) at
the replication's budget (983,040 tokens, 120 steps). Only the width changes between sizes; depth, heads, the
vocabulary, data order and validation set stay. ``tune`` trains each variant at every lr of ``LRS`` at the
smallest width, then extends a variant's grid by doubling (or halving) the lr for as long as
``eval.py compare --tune train.lr`` chooses its edge; ``confirm`` reads each variant's chosen lr from its
grid and trains fresh seeds at it at the given widths: muP carries the lr to the wider models.
Two runs at a time, one thread each.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CONFIG = "configs/experiments/replicate-cpu.yaml"
COMMON = ["model.parametrization=mup", "model.mup_base_hidden_size=256", "train.max_tokens=983040",
          "train.eval_every=30", "train.checkpoint_every=120"]
LAST_CHECKPOINT = "checkpoints/step_00000120"
WIDTHS = {  # hidden -> (intermediate, head_dim): 4 heads, 2 KV heads and 4 layers at every width
    64: (176, 16),
    128: (352, 32),
    256: (704, 64),
}
TUNE_WIDTH = 64
LRS = ["5e-4", "1e-3", "2e-3", "4e-3", "8e-3"]
VARIANTS = {
    "swiglu": ["model.ffn=swiglu"],
    "isogmlp": ["model.ffn=isogmlp"],
    "iso_ln": ["model.ffn=iso_ln"],
    "iso_mlp": ["model.ffn=iso_mlp"],
    "swiglu-iso_tanh": ["model.ffn=swiglu", "model.attn_scoring=iso_tanh"],
}
CONFIRM_SEEDS = (1, 2, 3)
FRESH_SEEDS = (4, 5, 6)
"""Seeds no lr was chosen on: the confirm seeds chose between the carried lr and half of it at width 256."""


def width_overrides(hidden: int) -> list[str]:
    intermediate, head_dim = WIDTHS[hidden]
    return [f"model.hidden_size={hidden}", f"model.intermediate_size={intermediate}", f"model.head_dim={head_dim}"]


def train_run(name: str, seed: int, hidden: int, lr: str, variant: str) -> tuple[str, list[str]]:
    """``(name, train.py command)`` of one run."""
    return name, [sys.executable, "train.py", "--config", CONFIG, f"name={name}", f"seed={seed}", f"train.lr={lr}",
                  *COMMON, *width_overrides(hidden), *VARIANTS[variant]]


def run_all(commands: dict[str, list[str]]) -> None:
    todo = {name: cmd for name, cmd in commands.items() if not (Path("runs") / name / LAST_CHECKPOINT).exists()}
    print(f"{len(commands) - len(todo)} of {len(commands)} runs done; running {len(todo)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log_dir = Path("runs") / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    def run(name: str) -> None:
        with open(log_dir / f"{name}.log", "w") as log:
            done = subprocess.run(todo[name], env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
        print(f"{name}: exit {done.returncode}", flush=True)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, todo))


def grid_name(variant: str, lr: str) -> str:
    return f"tuned-w{TUNE_WIDTH}-grid-{variant}-lr{lr}-s0"


def grid_run(variant: str, lr: str) -> tuple[str, list[str]]:
    return train_run(grid_name(variant, lr), 0, TUNE_WIDTH, lr, variant)


def grid_lrs(variant: str) -> list[str]:
    """``LRS`` and the extensions beyond either edge that have been run for ``variant``, in order."""
    lrs = list(LRS)
    for step, end in ((0.5, 0), (2.0, -1)):
        while (Path("runs") / grid_name(variant, beyond := f"{float(lrs[end]) * step:g}")).exists():
            lrs.insert(len(lrs) if end else 0, beyond)
    return lrs


def chosen_lr(variant: str) -> str:
    """The lr ``eval.py compare --tune train.lr`` chooses from the variant's grid."""
    with tempfile.TemporaryDirectory() as out:
        runs = [f"runs/{grid_name(variant, lr)}" for lr in grid_lrs(variant)]
        subprocess.run([sys.executable, "eval.py", "compare", *runs, "--tune", "train.lr", "--no-plots", "--out", out],
                       check=True, stdout=subprocess.DEVNULL)
        with open(Path(out) / "comparison.csv") as f:
            (row,) = csv.DictReader(f)
    return row["train.lr"]


def edge_extensions() -> dict[str, list[str]]:
    """The next lr, one step past the edge, of each variant whose chosen lr is an edge of its grid."""
    extend = []
    for variant in VARIANTS:
        lrs, chosen = grid_lrs(variant), float(chosen_lr(variant))
        if chosen in (float(lrs[0]), float(lrs[-1])):
            extend.append(grid_run(variant, f"{chosen * (2.0 if chosen == float(lrs[-1]) else 0.5):g}"))
    return dict(extend)


def main(argv: list[str]) -> None:
    phase, *args = argv
    if phase == "tune":
        run_all(dict(grid_run(v, lr) for v in VARIANTS for lr in LRS))
        while extensions := edge_extensions():
            print("optimum at the grid's edge; extending:", ", ".join(extensions), flush=True)
            run_all(extensions)
    elif phase == "confirm":
        lrs = {v: chosen_lr(v) for v in VARIANTS}
        print("chosen lr:", lrs, flush=True)
        run_all(dict(train_run(f"tuned-w{w}-{v}-s{s}", s, int(w), lrs[v], v)
                     for w in args for s in CONFIRM_SEEDS for v in VARIANTS))
    elif phase in ("check", "fresh"):
        width, *choices = args
        lrs = dict(choice.split("=") for choice in choices)
        prefix, seeds = ("lrcheck", CONFIRM_SEEDS) if phase == "check" else ("fresh", FRESH_SEEDS)
        run_all(dict(train_run(f"{prefix}-w{width}-{v}-lr{lr}-s{s}", s, int(width), lr, v)
                     for s in seeds for v, lr in lrs.items()))
    else:
        raise SystemExit(f"run.py: unknown phase {phase!r}: expected tune, confirm, check or fresh")


if __name__ == "__main__":
    main(sys.argv[1:])
