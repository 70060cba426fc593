"""Test-side worker, under torchrun with 2 gloo processes: ``train.py``'s ``main`` with one fault injected on one
rank, then exit with its code. Faults:

    disagree        rank 1 computes one micro-batch more per step than rank 0 (caught before the first step)
    extra_batch     rank 1 runs one micro-batch more in step 2 (ranks fall out of step inside the run)
    sigterm_blocked rank 1 stops answering in step 2; rank 0, blocked in that step's all-reduce, gets SIGTERM
    tracker         rank 0's TensorBoard tracker raises OSError from step 2 on

    torchrun --standalone --nproc_per_node 2 rank_fault_worker.py FAULT key.sub=value ...
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import llm.train.setup as setup
import llm.train.trainer as trainer
from llm.cli.train import main
from llm.errors import one_line_warnings


def inject(fault: str, rank: int) -> None:
    real_accum, real_step = setup.gradient_accumulation_steps, trainer.train_step
    steps = {"n": 0}

    def train_step(model, batches, *args, **kwargs):
        steps["n"] += 1
        if steps["n"] == 2 and rank == 1 and fault == "extra_batch":
            batches = [*batches, batches[-1]]
        if steps["n"] == 2 and rank == 1 and fault == "sigterm_blocked":
            time.sleep(3600)
        if steps["n"] == 2 and rank == 0 and fault == "sigterm_blocked":  # in the all-reduce by then
            threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return real_step(model, batches, *args, **kwargs)

    trainer.train_step = train_step
    if fault == "disagree" and rank == 1:
        setup.gradient_accumulation_steps = lambda config, world: real_accum(config, world) + 1
    if fault == "tracker" and rank == 0:
        from accelerate.tracking import TensorBoardTracker

        real_log = TensorBoardTracker.log

        def log(self, values, step=None, **kwargs):
            if step is not None and step >= 2:
                raise OSError(28, "No space left on device")
            return real_log(self, values, step=step, **kwargs)

        TensorBoardTracker.log = log


if __name__ == "__main__":
    inject(sys.argv[1], int(os.environ["RANK"]))
    one_line_warnings()  # as train.py's entry point
    code = main(sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
