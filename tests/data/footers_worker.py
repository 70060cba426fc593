"""Test-side worker, under torchrun with 2 gloo processes: the trainer's ``build_data`` (loader and validation
windows, the main process first) with footer reads and the content fingerprint's file reads counted. Each rank
writes ``rank<r>.json`` into OUT: the files whose footers it read while building, those it hashed, and its
validation windows.

    torchrun --standalone --nproc_per_node 2 footers_worker.py OUT key.sub=value ...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from accelerate import Accelerator

import llm.data.files as files
import llm.data.footers as footers
from llm.config import load_config
from llm.data import load_tokenizer
from llm.train.setup import build_data


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    reads: list[str] = []
    hashed: list[str] = []
    real, real_checksum = footers.read_metadata, files.file_checksum

    def counting(file: str):
        reads.append(file)
        return real(file)

    def counting_checksum(path: Path, *args, **kwargs) -> str:
        hashed.append(str(path))
        return real_checksum(path, *args, **kwargs)

    footers.read_metadata, files.file_checksum = counting, counting_checksum
    files.RACY_NS = 0  # the test's files were written just before: count them settled (see test_data_fingerprint)
    config = load_config(None, overrides)
    accelerator = Accelerator(cpu=True)
    _, val_windows = build_data(config, load_tokenizer(config.data.tokenizer), accelerator, rank, world_size)
    (out / f"rank{rank}.json").write_text(json.dumps({"reads": reads, "hashed": hashed, "val": val_windows.tolist()}))
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)  # avoids gloo's abort at interpreter exit (about 1 run in 4 on CPU)


if __name__ == "__main__":
    main()
