"""The paired step bench times the Muon step against AdamW's as an ``--extra-row`` (``optimizer=muon``): the row
steps the trainer's optimizer for that ``train.optimizer`` (bench/bench_train_step.py)."""

from __future__ import annotations

import csv

import harness
import torch
from test_bench_step import run_bench

from llm.model import ModelConfig


def test_a_muon_row_is_timed_paired_against_its_adamw_row(tmp_path) -> None:
    out = tmp_path / "step.csv"
    done = run_bench("--rounds", "6", "--variants", "swiglu+softmax", "--qwen3", "--extra-row", "muon",
                     "swiglu+softmax", "optimizer=muon", "--csv", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out, newline="") as f:
        rows = {line[0]: line for line in list(csv.reader(f))[1:]}
    assert set(rows) == {"swiglu+softmax", "muon"} and rows["muon"][1] == "swiglu+softmax"
    assert 0 < float(rows["muon"][3]) < 2  # a paired ratio, with its interval in the next columns


def test_the_bench_step_moves_the_hidden_matrices_by_muon() -> None:
    """``make_step`` steps the optimizer it is given: with the trainer's Muon, the momentum buffers appear."""
    import bench_train_step
    from step_rows import Spec, ours

    from llm.config import load_config

    config = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    row = ours(Spec(config, optimizer="muon"), torch.randint(0, 64, (2, 9)), compile_=False)
    optimizer = bench_train_step.build_optimizer(row.model, load_config(None, ["train.max_steps=1",
                                                                               "train.optimizer=muon"]))
    harness.make_step(optimizer, row.loss, torch.device("cpu"), torch.float32)()
    assert sum("momentum_buffer" in state for state in optimizer.state.values()) == 4  # qkv, o, in, down
