"""Test-side worker, under torchrun with 2 gloo processes: train.py's ``main`` in which rank 1's ``torch.save``
into checkpoint FAILING's ``.tmp`` directory fails as a full disk does; exits with ``main``'s code.

    torchrun --standalone --nproc_per_node 2 save_fail_worker.py FAILING key.sub=value ...
"""

from __future__ import annotations

import errno
import os
import sys

import torch

from llm.cli.train import main


def run() -> None:
    failing, overrides = sys.argv[1], sys.argv[2:]
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if f"{failing}.tmp" in str(f) and str(f).endswith("data_rank1.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *args, **kwargs)

    torch.save = save
    code = main(overrides)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # avoids gloo's abort at interpreter exit (about 1 run in 4 on CPU)


if __name__ == "__main__":
    run()
