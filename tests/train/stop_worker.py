"""Test-side worker, under torchrun with 2 gloo processes: ``fit`` a tiny run in which only rank 1 receives
SIGTERM, during optimizer step ``SIGNAL_STEP``. Each rank writes ``rank<r>.json`` into OUT: the step it
stopped at, whether it saw the signal itself, and how many ``all_reduce`` calls each loop iteration made.

    torchrun --standalone --nproc_per_node 2 stop_worker.py OUT SIGNAL_STEP key.sub=value ...
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

import llm.train.trainer as trainer
from llm.config import load_config


def main() -> None:
    out, signal_step, overrides = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    rank = int(os.environ["RANK"])
    all_reduces = {"n": 0}
    at_step_start: list[int] = []
    real_all_reduce, real_train_step = dist.all_reduce, trainer.train_step

    def counting_all_reduce(*args, **kwargs):
        all_reduces["n"] += 1
        return real_all_reduce(*args, **kwargs)

    def train_step(*args, **kwargs):
        at_step_start.append(all_reduces["n"])
        if rank == 1 and len(at_step_start) == signal_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_train_step(*args, **kwargs)

    dist.all_reduce, trainer.train_step = counting_all_reduce, train_step
    result = trainer.fit(load_config(None, overrides))
    per_step = [b - a for a, b in itertools.pairwise(at_step_start)]
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"step": result.step, "signalled": result.stopped_by_signal, "all_reduces_per_step": per_step}))
    sys.stdout.flush()
    os._exit(0)  # avoids gloo's abort at interpreter exit (verified on CPU)


if __name__ == "__main__":
    main()
