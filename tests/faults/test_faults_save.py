"""A full disk during a save, as each writer reports it: torch's ``RuntimeError`` (inline_container.cc), a
``SafetensorError``, a bare ``Exception`` from the tokenizer's save, an ``OSError`` while the manifest or the
``latest`` pointer is written. Every one removes the partial checkpoint, leaves the previous one and the pointer
as they were, and stops the run with one ``error:`` line that names the failed checkpoint, the writer's error and
the previous checkpoint (exit 1, no traceback). A resume while the disk is still full is one line too, and so is a
metrics row that cannot be written (no checkpoint is written after it); with two processes both ranks stop with the
same line, whichever rank failed.

The disk is filled by injection (the writer raises when it writes into the failing checkpoint), so the test needs
no tmpfs mount and runs as any user."""

from __future__ import annotations

import errno
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors
import torch
import transformers
import transformers.modeling_utils
from tiny import metrics_rows, run, torchrun
from write_fail_worker import failing_write_line

import llm.train.checkpoint as checkpoint
import llm.train.checkpoint_files as checkpoint_files
import llm.train.setup as setup
import llm.train.trainer as trainer
from llm.cli.train import main
from llm.train.checkpoint_files import verify_checkpoint
from llm.train.logging import MetricsLog

FAILING = "step_00000004"
ENOSPC = OSError(errno.ENOSPC, "No space left on device")
WORKER = Path(__file__).with_name("write_fail_worker.py")


def _torch_save(monkeypatch: pytest.MonkeyPatch) -> str:
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if f"{FAILING}.tmp" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4416 vs 4310\n"
                               "frame #0: c10::ThrowEnforceNotMet")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return "RuntimeError: [enforce fail at inline_container.cc:664] . unexpected pos 4416 vs 4310"


def _safetensors(monkeypatch: pytest.MonkeyPatch) -> str:
    real = transformers.modeling_utils.safe_save_file

    def save_file(tensors, filename, metadata=None):
        if f"{FAILING}.tmp" in str(filename):
            raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)
    return "SafetensorError: Error while serializing: IoError(Os { code: 28, kind: StorageFull })"


def _tokenizer(monkeypatch: pytest.MonkeyPatch) -> str:
    real = transformers.PreTrainedTokenizerFast.save_pretrained

    def save_pretrained(self, directory, *args, **kwargs):
        if f"{FAILING}.tmp" in str(directory):
            raise Exception("No space left on device (os error 28)")  # what the Rust tokenizer raises
        return real(self, directory, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", save_pretrained)
    return "Exception: No space left on device (os error 28)"


def _manifest(monkeypatch: pytest.MonkeyPatch) -> str:
    real = checkpoint.write_manifest

    def write_manifest(root: Path) -> None:
        if root.name != f"{FAILING}.tmp":
            return real(root)
        (root / checkpoint_files.MANIFEST).write_text("{")
        raise ENOSPC

    monkeypatch.setattr(checkpoint, "write_manifest", write_manifest)
    return "OSError: [Errno 28] No space left on device"


def _pointer(monkeypatch: pytest.MonkeyPatch) -> str:
    """The pointer write fails after the new directory was renamed: it is removed again, and the message
    names the previous checkpoint, not the new one, as intact."""
    real = checkpoint.write_pointer

    def write_pointer(ckpt_dir: Path, name: str) -> None:
        if name != FAILING:
            return real(ckpt_dir, name)
        (ckpt_dir / ".latest.tmp").write_text(name[:3])
        raise ENOSPC

    monkeypatch.setattr(checkpoint, "write_pointer", write_pointer)
    return "OSError: [Errno 28] No space left on device"


INJECTIONS: dict[str, Callable[[pytest.MonkeyPatch], str]] = {
    "torch.save": _torch_save, "safetensors": _safetensors, "tokenizer": _tokenizer, "manifest": _manifest,
    "pointer": _pointer,
}


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def _per_rank_error_lines(logs: Path, proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The ``error:`` lines of each rank's stderr (torchrun ``--log-dir logs --redirects 2``), rank 0's first;
    asserts that each rank exited 1 (torchrun's failure summary) and that none printed a traceback."""
    exits = re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)", proc.stderr)
    assert sorted(exits) == [("0", "1"), ("1", "1")], proc.stderr[-3000:]
    per_rank = sorted(logs.rglob("stderr.log"), key=lambda p: p.parent.name)
    assert [p.parent.name for p in per_rank] == ["0", "1"], proc.stderr[-3000:]
    for p in per_rank:
        assert "Traceback" not in p.read_text(), p.read_text()[-3000:]
    return [line for p in per_rank for line in _error_lines(p.read_text())]


def _row_lost(run_dir: Path, step: int, last_checkpoint: str) -> str:
    metrics = run_dir / "metrics.jsonl"
    return (f"error: could not write the train row of step {step} to {metrics} (OSError: [Errno 28] No space left on "
            f"device: '{metrics}'); the rows and checkpoints written before it are intact (last checkpoint: "
            f"{run_dir / 'checkpoints' / last_checkpoint})")


@pytest.mark.parametrize("writer", list(INJECTIONS))
def test_failed_save_is_one_line_and_leaves_previous_checkpoint(writer: str, run_overrides: list[str],
                                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys) -> None:
    args = [*run_overrides, "name=full", "train.max_steps=4", "train.checkpoint_every=2"]
    ckpts = tmp_path / "runs" / "full" / "checkpoints"
    reported = INJECTIONS[writer](monkeypatch)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert _error_lines(err) == [
        f"error: could not write checkpoint {ckpts / (FAILING + '.tmp')} ({reported}); the previous checkpoint "
        f"is intact: {ckpts / 'step_00000002'}"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]  # nothing partial is left
    assert (ckpts / "latest").read_text() == "step_00000002\n"
    verify_checkpoint(ckpts / "step_00000002")
    assert not (tmp_path / "runs" / "full" / "run.lock").exists()

    monkeypatch.undo()  # room on the disk again
    assert main([*args, "resume=true"]) == 0
    assert (ckpts / "latest").read_text() == f"{FAILING}\n"
    verify_checkpoint(ckpts / FAILING)


def test_resume_while_the_disk_is_still_full_is_one_line(run_overrides: list[str], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    args = [*run_overrides, "name=full", "train.max_steps=2", "train.checkpoint_every=2"]
    assert main(args) == 0
    run_dir = tmp_path / "runs" / "full"
    before = (run_dir / "metrics.jsonl").read_bytes()

    def save_config(config, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(setup, "save_config", save_config)
    capsys.readouterr()
    assert main([*args, "train.max_steps=4", "resume=true"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = _error_lines(err)
    assert re.fullmatch(  # config.yaml is written to a temporary file, then renamed
        re.escape(f"error: could not write to {run_dir} (OSError: [Errno 28] No space left on device: "
                  f"'{run_dir / 'config.yaml'}") + r"\.[0-9a-f]{16}\.tmp" + re.escape(
            "'); its config.yaml and metrics.jsonl are each as they were or wholly rewritten, none cut short"), line)
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("config.yaml")) == ["config.yaml"]
    assert not (run_dir / "run.lock").exists()


@pytest.mark.slow
def test_failed_save_on_one_rank_stops_both_with_the_same_line(run_overrides: list[str], tmp_path: Path) -> None:
    """Rank 1's ``torch.save`` of its data-loader state fails; rank 0 wrote its part. Both ranks print the
    same line (naming rank 1's error) and exit 1, instead of rank 0 dying of "Connection closed by peer"."""
    args = [*run_overrides, "name=full", "train.max_steps=4", "train.checkpoint_every=2"]
    logs = tmp_path / "logs"  # each rank's stderr in its own file: lines of two ranks cannot interleave
    proc = run(torchrun(2, "--log-dir", str(logs), "--redirects", "2", str(WORKER), "save", FAILING, *args), expect=1)
    ckpts = tmp_path / "runs" / "full" / "checkpoints"
    lines = _per_rank_error_lines(logs, proc)
    assert lines == [lines[0]] * 2, proc.stderr[-3000:]
    assert lines[0] == (f"error: could not write checkpoint {ckpts / (FAILING + '.tmp')} (rank 1: OSError: "
                        f"[Errno 28] No space left on device); the previous checkpoint is intact: "
                        f"{ckpts / 'step_00000002'}")
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]
    assert [r["step"] for r in metrics_rows(tmp_path / "runs" / "full", "train")] == [1, 2, 3, 4]


LOST_ROWS = [(3, "step_00000002"), (6, "step_00000004")]
"""(step whose train row cannot be written, the last checkpoint then) in a 6-step run checkpointing every 2 steps:
step 3's failure rides on step 4's all-reduce; step 6 is the last, so its failure is caught where the ranks agree
before the final checkpoint, which is not written."""


@pytest.mark.parametrize(("step", "last"), LOST_ROWS)
def test_disk_full_while_logging_a_row_is_one_line(step: int, last: str, run_overrides: list[str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(MetricsLog, "_write_line", failing_write_line("train", step))
    steps_taken = {"n": 0}
    real_train_step = trainer.train_step

    def train_step(*args, **kwargs):
        steps_taken["n"] += 1
        return real_train_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", train_step)
    assert main([*run_overrides, "name=full", "train.max_steps=6", "train.checkpoint_every=2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    run_dir = tmp_path / "runs" / "full"
    assert _error_lines(err) == [_row_lost(run_dir, step, last)]
    assert steps_taken["n"] == min(step + 1, 6)  # stopped at the next step, not the next checkpoint
    assert [r["step"] for r in metrics_rows(run_dir, "train")] == list(range(1, step))
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(["latest", *{"step_00000002", last}])
    assert (ckpts / "latest").read_text() == f"{last}\n"
    verify_checkpoint(ckpts / last)
    assert not (run_dir / "run.lock").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("step", "last"), LOST_ROWS)
def test_failed_row_on_rank_0_stops_both_ranks_with_the_same_line(step: int, last: str, run_overrides: list[str],
                                                                  tmp_path: Path) -> None:
    """Only rank 0 writes metrics.jsonl; its failed row stops rank 1 too, with rank 0's line and exit 1 (rank 1
    used to die in its next collective with a traceback)."""
    args = [*run_overrides, "name=full", "train.max_steps=6", "train.checkpoint_every=2"]
    logs = tmp_path / "logs"
    proc = run(torchrun(2, "--log-dir", str(logs), "--redirects", "2", str(WORKER), "log", str(step), *args), expect=1)
    run_dir = tmp_path / "runs" / "full"
    assert _per_rank_error_lines(logs, proc) == [_row_lost(run_dir, step, last)] * 2
    assert [r["step"] for r in metrics_rows(run_dir, "train")] == list(range(1, step))
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == f"{last}\n"
    verify_checkpoint(ckpts / last)
    assert sorted(p.name for p in (ckpts / last / "state").glob("data_rank*.pt")) == ["data_rank0.pt", "data_rank1.pt"]
    assert not (run_dir / "run.lock").exists()


def test_disk_full_while_logging_the_meta_row_releases_the_lock(run_overrides: list[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A failure after the lock is taken but before the first step (here the meta row) gives the run directory
    back: a later run of the same name in this process or another is not refused."""
    run_dir = tmp_path / "runs" / "full"
    monkeypatch.setattr(MetricsLog, "_write_line", failing_write_line("meta", 0))
    assert main([*run_overrides, "name=full", "train.max_steps=2"]) == 1
    metrics = run_dir / "metrics.jsonl"
    assert _error_lines(capsys.readouterr().err) == [
        f"error: could not write the meta row of step 0 to {metrics} (OSError: [Errno 28] No space left on device: "
        f"'{metrics}'); the rows and checkpoints written before it are intact (last checkpoint: none)"]
    assert not (run_dir / "run.lock").exists()
    monkeypatch.undo()
    assert main([*run_overrides, "name=full", "train.max_steps=2"]) == 0
