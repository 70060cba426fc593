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


@pytest.mark.slow
def test_prepared_run_resumes_on_more_and_then_fewer_processes(tmp_path: Path) -> None:
    """2 processes to step 4, 3 processes to step 8, 2 again to step 10 (12 windows a step: 2 x 2 x 3
    micro-batches or 3 x 2 x 2). Each step takes the same 12 windows of the global order whatever the number of
    processes, so the losses are those of an uninterrupted 2-process run up to the reduction order, and the last
    loader state accounts for every window once."""
    corpus = write_docs(tmp_path / "corpus", 200, 2, chars=600)
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    train_tokenizer([str(corpus)], 512, tokenizer)
    prepared = tmp_path / "prepared"
    assert main(["prepare", "--source", str(corpus), "--tokenizer", str(tokenizer), "--val-bucket", "10",
                 "--out", str(prepared)]) == 0
    args = ["train.py", *TINY_TRAIN, f"data.source={corpus}", f"data.tokenizer={tokenizer}",
            f"data.prepared={prepared}", "data.val_bucket=10", "data.val_tokens=330",
            f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'runs'}", "train.checkpoint_every=4",
            "train.micro_batch_size=2", "train.global_batch_tokens=384",
            "train.warmup_steps=1", "train.min_lr_ratio=1"]  # a constant lr: the same whatever max_steps says
    env = {"ACCELERATE_USE_CPU": "1"}
    run(torchrun(2, *args, "name=whole", "train.max_steps=10"), env=env)
    run(torchrun(2, *args, "name=resized", "train.max_steps=4"), env=env)
    run(torchrun(3, *args, "name=resized", "train.max_steps=8", "resume=true"), env=env)
    run(torchrun(2, *args, "name=resized", "train.max_steps=10", "resume=true"), env=env)
    whole, resized = (metrics_rows(tmp_path / "runs" / name, "train") for name in ("whole", "resized"))
    assert [r["step"] for r in resized] == list(range(1, 11))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in resized]), torch.tensor([r["loss"] for r in whole]),
                               rtol=1e-5, atol=0)
    metas = metrics_rows(tmp_path / "runs" / "resized", "meta")
    assert [(m["world_size"], m["grad_accum"]) for m in metas] == [(2, 3), (3, 2), (2, 3)]
    states = [torch.load(tmp_path / "runs" / "resized" / "checkpoints" / "step_00000010" / "state" /
                         f"data_rank{r}.pt", weights_only=True)["workers"] for r in range(2)]
    # 96 windows (8 steps x 12) before the last resume; since then 2 steps x 6 windows on each of the 2 ranks
    assert [worker["from"] for state in states for worker in state] == [96, 96]
    assert sum(worker["taken"] for state in states for worker in state) == 24
