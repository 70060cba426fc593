"""Test-side worker, under torchrun with 2 gloo processes: train.py's ``main`` with one write failing as a full
disk does; exits with ``main``'s code.

    torchrun --standalone --nproc_per_node 2 write_fail_worker.py save step_00000004 key.sub=value ...
        rank 1's ``torch.save`` of its data-loader state into that checkpoint's ``.tmp`` directory fails
    torchrun --standalone --nproc_per_node 2 write_fail_worker.py log 3 key.sub=value ...
        rank 0's write of the train row of step 3 to metrics.jsonl fails
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable

import torch

from llm.cli.train import main
from llm.train.logging import MetricsLog


def fail_save(failing: str) -> None:
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if f"{failing}.tmp" in str(f) and str(f).endswith("data_rank1.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *args, **kwargs)

    torch.save = save


def failing_write_line(kind: str, step: int) -> Callable[[MetricsLog, str], None]:
    """``MetricsLog._write_line`` on a disk that is full when the ``kind`` row of ``step`` is written."""
    real = MetricsLog._write_line
    row_start = f'{{"kind": "{kind}", "step": {step}, '

    def write_line(self: MetricsLog, line: str) -> None:
        if line.startswith(row_start):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        real(self, line)

    return write_line


def fail_log(step: str) -> None:
    MetricsLog._write_line = failing_write_line("train", int(step))


def run() -> None:
    what, where, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    {"save": fail_save, "log": fail_log}[what](where)
    code = main(overrides)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # avoids gloo's abort at interpreter exit (about 1 run in 4 on CPU)


if __name__ == "__main__":
    run()
