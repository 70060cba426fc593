"""A run on prepared tokens resumed with another number of processes, end to end through train.py: 2
processes write a checkpoint, 1 process continues it, and the loader state counts every window once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import PYTHON, TINY_TRAIN, metrics_rows, run, torchrun, write_docs

from llm.cli.data import main
from llm.data import train_tokenizer


@pytest.mark.slow
def test_prepared_run_resumes_on_fewer_processes(tmp_path: Path) -> None:
    corpus = write_docs(tmp_path / "corpus", 200, 2, chars=600)
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    train_tokenizer([str(corpus)], 512, tokenizer)
    prepared = tmp_path / "prepared"
    assert main(["prepare", "--source", str(corpus), "--tokenizer", str(tokenizer), "--val-bucket", "10",
                 "--out", str(prepared)]) == 0
    args = ["train.py", *TINY_TRAIN, f"data.source={corpus}", f"data.tokenizer={tokenizer}",
            f"data.prepared={prepared}", "data.val_bucket=10", "data.val_tokens=330",
            f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'runs'}", "name=resize",
            "train.checkpoint_every=4"]
    # 256 tokens a step = 2 processes x 4 windows of 32, or 1 process x 2 micro-batches of 4
    run(torchrun(2, *args, "train.max_steps=4"), env={"ACCELERATE_USE_CPU": "1"})
    run([PYTHON, *args, "train.max_steps=6", "resume=true"])
    run_dir = tmp_path / "runs" / "resize"
    assert [r["step"] for r in metrics_rows(run_dir, "train")][-2:] == [5, 6]
    state = torch.load(run_dir / "checkpoints" / "step_00000006" / "state" / "data_rank0.pt", weights_only=True)
    # the 2 processes took the global order's windows 0-31; the single process took the next 16
    assert state["workers"] == [{"from": 32, "skip": [], "taken": 16}]
