"""In-process ``fit`` runs of a tiny model on the real FineWeb sample (a few seconds each)."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from accelerate.tracking import TensorBoardTracker
from tiny import assert_same_weights, checkpoint_weights, metrics_rows, trajectory

import llm.model.lm_head as lm_head
import llm.train.setup as setup
import llm.train.signals as signals
import llm.train.trainer as trainer
from llm.model.config import ConfigError
from llm.train.lock import RunLock
from llm.train.logging import MetricsLog, ProgressBar
from llm.train.signals import StopRequest
from llm.train.step import TrainingError
from llm.train.trainer import fit

TRAIN_KEYS = {"kind", "step", "tokens", "loss", "ppl", "lr", "grad_norm", "grad_norm_var_rolling",
              "grad_norm_cv_rolling", "grad_norm_var_run", "grad_norm_cv_run", "grad_norm_nonfinite",
              "tokens_per_s", "mfu", "peak_mem_bytes", "peak_mem_kind", "data_wait_s", "skipped_steps",
              "no_target_batches"}
GROUP_STATS = ("", "_var_rolling", "_cv_rolling", "_var_run", "_cv_run", "_nonfinite")
ISOGMLP_GROUP_KEYS = {f"grad_norm_{group}{stat}" for group in ("embedding", "attention", "ffn", "ffn_mixing", "norm")
                      for stat in GROUP_STATS}
LAYER_KEYS = {"layer", "isoscore", "mean_cos", "eff_rank", "basis_alignment"}


def test_loss_falls_and_metrics_rows_are_documented(tiny_config) -> None:
    config = tiny_config("model.ffn=isogmlp", "model.ffn_param_match=true", "train.eval_every=15",
                         "trackers=[tensorboard]")
    result = fit(config)
    run_dir = result.run_dir
    assert result.step == 30 and result.tokens == 30 * 256

    (meta,) = metrics_rows(run_dir, "meta")
    assert meta["variant"] == "isogmlp+softmax"
    assert meta["params_total"] > meta["params_non_embedding"] > 0
    assert meta["params_total"] - meta["params_non_embedding"] == 512 * 32  # tied embedding counted once
    assert meta["flops_per_token"] > 0 and meta["config"]["model"]["ffn"] == "isogmlp"
    assert (meta["engine"], meta["engine_requested"]) == ("single", None)  # one process, no launch config

    train = metrics_rows(run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, 31))
    for row in train:
        assert set(row) == TRAIN_KEYS | ISOGMLP_GROUP_KEYS
        groups_sq = sum(row[f"grad_norm_{g}"] ** 2 for g in ("embedding", "attention", "ffn", "ffn_mixing", "norm"))
        assert math.sqrt(groups_sq) == pytest.approx(row["grad_norm"], rel=1e-4)  # the global norm, split up
        assert row["tokens"] == row["step"] * 256
        assert row["peak_mem_kind"] == "cpu_max_rss" and row["peak_mem_bytes"] > 0
        assert row["skipped_steps"] == 0 and math.isfinite(row["grad_norm"]) and row["mfu"] > 0
        assert row["ppl"] == pytest.approx(math.exp(row["loss"]))
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-5:]) / 5
    assert first == pytest.approx(math.log(512), abs=0.3)  # a fresh model is close to uniform
    assert last < first - 0.4, (first, last)
    lrs = [r["lr"] for r in train]
    assert lrs[4] == pytest.approx(3e-3) and lrs[0] == pytest.approx(3e-3 / 5)  # warmup_steps=5
    assert lrs[-1] < lrs[10]  # cosine decay

    evals = metrics_rows(run_dir, "eval")
    assert [r["step"] for r in evals] == [15, 30]
    for row in evals:
        assert math.isfinite(row["val_loss"]) and row["val_ppl"] == pytest.approx(math.exp(row["val_loss"]))
        assert [layer["layer"] for layer in row["layers"]] == [0, 1, 2]
        assert all(set(layer) >= LAYER_KEYS for layer in row["layers"])
        assert all({"alpha", "pathway_ratio"} <= set(layer) for layer in row["layers"][1:])  # isogmlp
    assert evals[1]["val_loss"] < evals[0]["val_loss"] + 0.1
    assert any((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert (run_dir / "config.yaml").is_file()


def _stop_after(monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """Deliver SIGTERM to this process during optimizer step ``steps`` (as a scheduler would)."""
    calls = {"n": 0}
    real = trainer.train_step

    def train_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == steps:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", train_step)


@pytest.mark.parametrize("precision", ["auto", "bf16"])  # on CPU: fp32, and bf16 autocast as on a GPU
def test_stop_and_resume_equals_uninterrupted_run(tiny_config, monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    overrides = ("train.max_steps=12", "train.checkpoint_every=100", "train.eval_every=100",
                 f"train.precision={precision}")
    whole = fit(tiny_config(*overrides, "name=whole"))

    _stop_after(monkeypatch, 5)
    stopped = fit(tiny_config(*overrides, "name=split"))
    assert stopped.stopped_by_signal and stopped.step == 5
    assert stopped.last_checkpoint.name == "step_00000005"
    monkeypatch.undo()
    resumed = fit(tiny_config(*overrides, "name=split", "resume=true"))
    assert resumed.step == 12

    assert trajectory(resumed.run_dir) == trajectory(whole.run_dir)  # bitwise: every step's loss, norm and lr
    last = lambda run, kind, key: metrics_rows(run.run_dir, kind)[-1][key]  # noqa: E731
    assert last(resumed, "eval", "val_loss") == last(whole, "eval", "val_loss")
    assert_same_weights(whole.last_checkpoint, resumed.last_checkpoint)
    # the grad-norm statistics continued rather than restarted
    assert last(resumed, "train", "grad_norm_var_run") == last(whole, "train", "grad_norm_var_run")
    assert last(resumed, "train", "grad_norm_ffn_var_run") == last(whole, "train", "grad_norm_ffn_var_run")
    (_, meta_2) = metrics_rows(resumed.run_dir, "meta")
    assert meta_2["resumed_from"].endswith("step_00000005") and meta_2["step"] == 5
    assert meta_2["mixed_precision"] == ("bf16" if precision == "bf16" else "no")


def _nan_loss_on(monkeypatch: pytest.MonkeyPatch, bad_steps: set[int], accum: int = 2) -> None:
    """Make the loss of every micro-batch of the given optimizer steps (1-based) NaN."""
    calls = {"n": 0}
    real = lm_head.linear_cross_entropy

    def linear_cross_entropy(*args, **kwargs):  # the training loss (evaluation goes through the logits)
        calls["n"] += 1
        loss = real(*args, **kwargs)
        step = (calls["n"] - 1) // accum + 1
        return loss * float("nan") if step in bad_steps else loss

    monkeypatch.setattr(lm_head, "linear_cross_entropy", linear_cross_entropy)


def test_nonfinite_step_is_skipped_and_counted(tiny_config, monkeypatch: pytest.MonkeyPatch) -> None:
    _nan_loss_on(monkeypatch, {4})
    result = fit(tiny_config("train.max_steps=8"))
    train = {r["step"]: r for r in metrics_rows(result.run_dir, "train")}
    assert math.isnan(train[4]["loss"]) and not math.isfinite(train[4]["grad_norm"])
    assert [train[s]["skipped_steps"] for s in range(1, 9)] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert train[4]["grad_norm_nonfinite"] == 1
    # no scheduler step on the skipped step: step 5 trains at the lr step 4 would have used
    assert train[5]["lr"] == train[4]["lr"]
    assert all(math.isfinite(train[s]["loss"]) for s in (5, 6, 7, 8))  # the weights were not poisoned
    assert result.step == 8 and result.tokens == 8 * 256  # the step counter and the data advance


def test_consecutive_nonfinite_steps_stop_with_state_saved(tiny_config, monkeypatch) -> None:
    _nan_loss_on(monkeypatch, set(range(3, 100)))
    config = tiny_config("train.max_steps=20", "train.max_bad_steps=3")
    with pytest.raises(TrainingError, match=r"3 consecutive steps.*step_00000005"):
        fit(config)
    ckpt = config.run_dir / "checkpoints" / "step_00000005"
    saved = json.loads((ckpt / "trainer.json").read_text())["state"]
    assert saved == {"step": 5, "tokens": 5 * 256, "skipped_steps": 3, "consecutive_bad_steps": 3}
    assert all(torch.isfinite(t).all() for t in checkpoint_weights(ckpt).values())
    assert (config.run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000005"


def test_new_run_refuses_a_directory_with_checkpoints(tiny_config) -> None:
    fit(tiny_config("train.max_steps=2"))
    with pytest.raises(ConfigError, match=r"^resume: .*pass resume=true"):
        fit(tiny_config("train.max_steps=4"))
    assert fit(tiny_config("train.max_steps=4", "resume=true")).step == 4


def test_resume_rejects_a_different_model(tiny_config) -> None:
    fit(tiny_config("train.max_steps=2"))
    with pytest.raises(ConfigError, match=r"^model: .*hidden_size \(checkpoint 32, config 64\)"):
        fit(tiny_config("train.max_steps=4", "resume=true", "model.hidden_size=64"))


def test_a_tokenizer_whose_eos_id_is_past_the_embedding_is_refused_before_the_first_step(
        run_overrides: list[str], bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """512 tokens, so the count fits a 512-row model, but <|endoftext|> is id 700 (id 0 unused)."""
    from llm.cli.train import main

    tokenizer = json.loads(bpe.read_text())
    (eos,) = tokenizer["added_tokens"]
    tokenizer["model"]["vocab"][eos["content"]] = eos["id"] = 700
    (tmp_path / "eos700.json").write_text(json.dumps(tokenizer))
    assert main([*run_overrides, f"data.tokenizer={tmp_path / 'eos700.json'}", "train.max_steps=2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: model.vocab_size: 512 is too small for tokenizer {tmp_path / 'eos700.json'}, whose ids reach 700 "
        "(<|endoftext|>, appended after every document, is id 700)"]
    assert not (tmp_path / "runs" / "tiny").exists()


RELEASES = {"RunLock.release": 1, "TensorBoardTracker.finish": 1, "MetricsLog.close": 1}


@pytest.mark.parametrize(("failure", "released"), [
    ("setup", RELEASES),  # after the lock, the trackers and metrics.jsonl, before the loop
    ("loop", {**RELEASES, "ProgressBar.close": 1}),
    (None, {**RELEASES, "ProgressBar.close": 1}),
])
def test_everything_acquired_is_released_once(failure: str | None, released: dict[str, int], tiny_config,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[str] = Counter()

    def count(cls: type, name: str) -> None:
        real = getattr(cls, name)

        def counted(self, *args, **kwargs):
            calls[f"{cls.__name__}.{name}"] += 1
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)

    for cls, name in [(RunLock, "release"), (TensorBoardTracker, "finish"), (MetricsLog, "close"),
                      (ProgressBar, "close")]:
        count(cls, name)

    def injected(*args, **kwargs):
        raise RuntimeError("injected")

    if failure == "setup":
        monkeypatch.setattr(setup, "flops_per_token", injected)
    elif failure == "loop":
        monkeypatch.setattr(trainer, "train_step", injected)
    handler = signal.getsignal(signal.SIGTERM)
    config = tiny_config("train.max_steps=2", "trackers=[tensorboard]")
    if failure is None:
        fit(config)
    else:
        with pytest.raises(RuntimeError, match=r"^injected$"):
            fit(config)
    assert calls == released
    assert signal.getsignal(signal.SIGTERM) is handler
    assert not (config.run_dir / "run.lock").exists()


def test_tracker_failure_warns_on_stderr_and_training_goes_on(tiny_config, monkeypatch, capsys) -> None:
    def refuse(self, *args, **kwargs) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(TensorBoardTracker, "__init__", refuse)
    result = fit(tiny_config("train.max_steps=2", "train.eval_every=5", "trackers=[tensorboard]"))
    captured = capsys.readouterr()
    assert "warning: trackers tensorboard could not start (OSError: disk full); training without them" in captured.err
    assert "train.eval_every=5 is longer than the run (2 steps)" in captured.err
    assert "warning:" not in captured.out
    assert result.step == 2 and len(metrics_rows(result.run_dir, "train")) == 2


def test_a_longer_max_steps_on_resume_trains_on_the_longer_schedule_from_its_first_step(tiny_config) -> None:
    # warmup 3: a 4-step run and an 8-step run share the lrs of steps 1-4, so the weights at step 4 agree, and the
    # 4-step schedule ends (0.1x) where the 8-step one is at 0.914x: step 5 tells them apart
    overrides = ("train.warmup_steps=3", "train.checkpoint_every=100", "train.eval_every=100")
    whole = fit(tiny_config(*overrides, "train.max_steps=8", "name=whole"))
    assert fit(tiny_config(*overrides, "train.max_steps=4", "name=extended")).step == 4
    extended = fit(tiny_config(*overrides, "train.max_steps=8", "name=extended", "resume=true"))
    assert extended.step == 8
    assert trajectory(extended.run_dir) == trajectory(whole.run_dir)  # every step's loss, norm and lr, bitwise
    assert_same_weights(whole.last_checkpoint, extended.last_checkpoint)


def test_resuming_past_the_runs_end_is_refused_in_one_line_and_writes_nothing(run_overrides, tmp_path: Path,
                                                                               capsys) -> None:
    """Resuming at step 4 with train.max_steps=3 would train nothing and log a meta row of another max_steps."""
    from llm.cli.train import main

    assert main([*run_overrides, "train.max_steps=4"]) == 0
    run_dir = tmp_path / "runs" / "tiny"
    before = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}
    capsys.readouterr()
    assert main([*run_overrides, "train.max_steps=3", "resume=true"]) == 2
    assert capsys.readouterr().err == (
        f"error: train.max_steps: the run ends at step 3, but {run_dir / 'checkpoints' / 'step_00000004'} is at "
        f"step 4: the run is past that end; pass a later end to extend it\n")
    assert {name: (run_dir / name).read_bytes() for name in before} == before


def test_a_changed_warmup_on_resume_restarts_the_run_statistics_and_says_so(tiny_config, capsys) -> None:
    """The schedule is a function of the step and the config in force, train.warmup_steps included: a resume that
    changes it trains on the new warmup, and the run-level grad-norm statistics, which count the norms after the
    warmup, restart from the resumed step (here steps 5 and 6, after warmup 3 and the resume at 4)."""
    overrides = ("train.log_every=1", "train.checkpoint_every=100", "train.eval_every=100")
    fit(tiny_config(*overrides, "train.warmup_steps=2", "train.max_steps=4"))
    capsys.readouterr()
    resumed = fit(tiny_config(*overrides, "train.warmup_steps=3", "train.max_steps=6", "resume=true"))
    assert ("train.warmup_steps changed from 2 to 3: the run-level grad-norm statistics (*_var_run, *_cv_run) "
            "restart at step 4") in capsys.readouterr().out
    rows = metrics_rows(resumed.run_dir, "train")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    norms = [r["grad_norm"] for r in rows[4:]]
    mean = sum(norms) / 2
    assert rows[4]["grad_norm_var_run"] == 0.0  # one norm since the restart
    assert rows[5]["grad_norm_var_run"] == pytest.approx(sum((n - mean) ** 2 for n in norms) / 2, rel=1e-12)
    # step 5 is update 4: a third of the way from the new warmup's end (3) to the end (6)
    assert rows[4]["lr"] == pytest.approx(3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3))), rel=1e-12)


def test_the_stop_watchdog_line_starts_a_line_of_its_own_below_the_progress_bar(monkeypatch, capsys) -> None:
    exits: list[int] = []
    monkeypatch.setattr(signals.os, "_exit", exits.append)  # the watchdog's exit, recorded
    progress = ProgressBar(0, 10)
    progress.update(6.25, 20_079.0)
    stop = StopRequest(0.05, bar_drawn=progress.drawn)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not exits and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.restore()
        progress.close()
    assert exits == [1]
    (line,) = [line for line in capsys.readouterr().err.split("\n") if "error:" in line]  # the bar ends in \r only
    assert line.startswith("error: still running 0.05 s after signal 15 (train.stop_grace_s)"), line


def test_with_data_seed_run_the_data_order_is_the_runs_seed(tiny_config, bpe, tmp_path: Path) -> None:
    """``data.seed=run``: seed 3 reads the windows ``data.seed=3`` reads, seed 4 others; the two variants of a pair
    read the same; and the saved config reads back to the same order (a resume keeps it)."""
    from llm.config import load_config, save_config
    from llm.data import load_tokenizer
    from llm.data.stream import build_train_loader

    tokenizer = load_tokenizer(str(bpe))

    def first_batch(config) -> torch.Tensor:
        return next(iter(build_train_loader(config.seeded_data(), tokenizer, 2, 0, 1)))

    run = tiny_config("seed=3", "data.seed=run")
    batch = first_batch(run)
    assert torch.equal(batch, first_batch(tiny_config("seed=0", "data.seed=3")))
    assert torch.equal(batch, first_batch(tiny_config("seed=3", "data.seed=run", "model.ffn=isogmlp")))
    assert not torch.equal(batch, first_batch(tiny_config("seed=4", "data.seed=run")))
    save_config(run, tmp_path / "config.yaml")
    saved = load_config([str(tmp_path / "config.yaml")], saved_run=True)
    assert saved.data.seed == "run" and torch.equal(batch, first_batch(saved))
    with pytest.raises(ConfigError, match=r"data\.seed: expected an integer or run"):
        tiny_config("data.seed=shared")
