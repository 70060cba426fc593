"""Non-finite state is never saved as good: an update that makes the parameters non-finite stops the run before
any eval or checkpoint, a non-finite streak reaching an eval step is logged with NaN metrics (no crash), every
checkpoint left on disk holds finite weights; eval.py reports NaN for a NaN checkpoint; values that could make
the run non-finite (lr, eps, weight_decay, grad_clip) are refused up front, with the other config gaps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import checkpoint_weights, metrics_rows

import llm.train.checkpoint_files as checkpoint_files
from llm.cli.eval import main as eval_main
from llm.cli.train import main
from llm.config import load_config
from llm.metrics.layers import ISOTROPY_KEYS, layer_report
from llm.train.setup import build_model


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def _all_checkpoints_finite(run_dir: Path) -> None:
    for ckpt in (run_dir / "checkpoints").glob("step_*"):
        for name, tensor in checkpoint_weights(ckpt).items():
            assert torch.isfinite(tensor).all(), f"{ckpt.name}: {name}"


def test_update_that_makes_parameters_nonfinite_stops_before_saving(run_overrides: list[str], tmp_path: Path,
                                                                    capsys) -> None:
    """lr=1e39: the loss and gradient norm of each step are finite, the update overflows the weights."""
    code = main([*run_overrides, "name=huge", "train.lr=1e39", "train.warmup_steps=1", "train.max_steps=6",
                 "train.checkpoint_every=1", "train.eval_every=1"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    run_dir = tmp_path / "runs" / "huge"
    train = metrics_rows(run_dir, "train")
    (line,) = _errors(err)
    assert line == (f"error: stopping: the update of step {train[-1]['step']} made parameters non-finite (its loss "
                    f"and gradient norm were finite: is train.lr=1e+39 too large?); nothing of it was saved, the last "
                    f"good checkpoint is {'none' if len(train) == 1 else run_dir / 'checkpoints' / 'step_00000001'}")
    assert math.isfinite(train[-1]["loss"]) and math.isfinite(train[-1]["grad_norm"])
    assert [r["step"] for r in metrics_rows(run_dir, "eval")] == [r["step"] for r in train][:-1]
    _all_checkpoints_finite(run_dir)


def test_nonfinite_streak_reaching_an_eval_step_logs_nan_metrics(run_overrides: list[str], tmp_path: Path,
                                                                 capsys) -> None:
    """lr=1e6: finite but huge weights whose activations overflow; the eval at step 3 falls inside the streak of
    skipped steps, logs NaN (the isotropy eigen-decomposition would have failed) and the streak stop follows."""
    code = main([*run_overrides, "name=streak", "train.lr=1e6", "train.warmup_steps=1", "train.max_steps=20",
                 "train.eval_every=3", "train.max_bad_steps=4"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    (line,) = _errors(err)
    run_dir = tmp_path / "runs" / "streak"
    assert line.startswith("error: stopping: 4 consecutive steps had a non-finite loss or gradient norm"), line
    evals = metrics_rows(run_dir, "eval")
    assert [e["step"] for e in evals] == [3, 6]  # both inside the streak, logged, not crashed
    assert all(math.isnan(e["val_loss"]) for e in evals)
    assert all(math.isnan(row[key]) for e in evals for row in e["layers"][1:] for key in ISOTROPY_KEYS)
    _all_checkpoints_finite(run_dir)


def test_layer_report_of_a_nan_model_reports_nan(tiny_model_config) -> None:
    model = build_model(tiny_model_config)
    batch = torch.randint(0, 512, (2, 16))
    finite = layer_report(model, batch, 16, seed=0)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.fill_(math.nan)
    broken = layer_report(model, batch, 16, seed=0)
    assert [row.keys() for row in broken] == [row.keys() for row in finite]
    assert all(math.isfinite(broken[0][key]) for key in ISOTROPY_KEYS)  # the embedding output is untouched
    assert all(math.isnan(row[key]) for row in broken[1:] for key in ISOTROPY_KEYS)


@pytest.fixture
def tiny_model_config(run_overrides: list[str]):
    return load_config(None, [*run_overrides, "train.max_steps=1"]).model


def test_eval_of_a_nan_checkpoint_reports_nan(run_overrides: list[str], tmp_path: Path, capsys) -> None:
    assert main([*run_overrides, "name=ok", "train.max_steps=2", "train.checkpoint_every=2"]) == 0
    ckpt = tmp_path / "runs" / "ok" / "checkpoints" / "step_00000002"
    weights_file = ckpt / "model" / "model.safetensors"
    weights = load_file(weights_file)
    save_file({k: torch.full_like(v, math.nan) for k, v in weights.items()}, weights_file, metadata={"format": "pt"})
    (ckpt / checkpoint_files.MANIFEST).unlink()
    checkpoint_files.write_manifest(ckpt)  # a checkpoint written NaN (not one altered on disk)
    capsys.readouterr()
    assert eval_main([str(ckpt), "--json", "--samples", "1", "--max-new-tokens", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["val_loss"] is None or math.isnan(float(report["val_loss"]))
    assert all(row["isoscore"] is None or math.isnan(row["isoscore"]) for row in report["layers"])


def test_eval_of_a_checkpoint_altered_on_disk_is_one_line(run_overrides: list[str], tmp_path: Path,
                                                          capsys) -> None:
    assert main([*run_overrides, "name=ok", "train.max_steps=2", "train.checkpoint_every=2"]) == 0
    ckpt = tmp_path / "runs" / "ok" / "checkpoints" / "step_00000002"
    weights = ckpt / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert eval_main([str(ckpt), "--samples", "0"]) == 2
    assert _errors(capsys.readouterr().err) == [
        f"error: {ckpt}: model/model.safetensors does not match its checksum in manifest.json (altered on disk)"]
    assert eval_main([str(ckpt / "model"), "--samples", "0"]) == 2  # its model/ named directly
    assert _errors(capsys.readouterr().err) == [
        f"error: {ckpt}: model/model.safetensors does not match its checksum in manifest.json (altered on disk)"]


@pytest.mark.parametrize(("override", "field", "message"), [
    ("train.lr=inf", "train.lr", "expected a finite positive number, got inf"),
    ("train.lr=nan", "train.lr", "expected a finite positive number, got nan"),
    ("train.eps=-1", "train.eps", "expected a finite positive number, got -1.0"),
    ("train.weight_decay=nan", "train.weight_decay", "expected a finite number >= 0, got nan"),
    ("train.grad_clip=nan", "train.grad_clip", "expected a finite number >= 0, got nan"),
    ("train.grad_clip=inf", "train.grad_clip", "expected a finite number >= 0, got inf"),
    ("data.seq_len=128", "data.seq_len", "128 exceeds model.max_position_embeddings (64)"),
    ("name=..", "name", "expected a plain directory name (no '/', not '.' or '..'), got '..'"),
    ("name=a/b", "name", "expected a plain directory name"),
    ("resume=maybe", "resume", "expected true, false or restart, got 'maybe'"),
])
def test_config_gaps_are_one_line_exit_2(override: str, field: str, message: str, run_overrides: list[str],
                                         tmp_path: Path, capsys) -> None:
    assert main([*run_overrides, "train.max_steps=2", override]) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert line.startswith(f"error: {field}: {message}")
    assert not (tmp_path / "runs").exists() and not (tmp_path.parent / "config.yaml").exists()
