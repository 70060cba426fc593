"""A full disk during a save, as each writer reports it: torch's ``RuntimeError`` (inline_container.cc), a
``SafetensorError``, a bare ``Exception`` from the tokenizer's save, an ``OSError`` while the manifest or the
``latest`` pointer is written. Every one removes the partial checkpoint, leaves the previous one and the pointer
as they were, and stops the run with one ``error:`` line that names the failed checkpoint, the writer's error and
the previous checkpoint (exit 1, no traceback). A resume while the disk is still full is one line too; with two
processes both ranks stop with the same line.

The disk is filled by injection (the writer raises when it writes into the failing checkpoint), so the test needs
no tmpfs mount and runs as any user."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors
import torch
import transformers
import transformers.modeling_utils
from tiny import metrics_rows, run, torchrun

import llm.train.checkpoint as checkpoint
import llm.train.trainer as trainer
from llm.cli.train import main
from llm.train.checkpoint import verify_checkpoint
from llm.train.logging import MetricsLog

FAILING = "step_00000004"
ENOSPC = OSError(errno.ENOSPC, "No space left on device")
WORKER = Path(__file__).with_name("save_fail_worker.py")


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
    real = checkpoint._write_manifest

    def write_manifest(root: Path) -> None:
        if root.name != f"{FAILING}.tmp":
            return real(root)
        (root / checkpoint.MANIFEST).write_text("{")
        raise ENOSPC

    monkeypatch.setattr(checkpoint, "_write_manifest", write_manifest)
    return "OSError: [Errno 28] No space left on device"


def _pointer(monkeypatch: pytest.MonkeyPatch) -> str:
    """The pointer write fails after the new directory was renamed: it is removed again, and the message
    names the previous checkpoint, not the new one, as intact."""
    real = checkpoint._write_pointer

    def write_pointer(ckpt_dir: Path, name: str) -> None:
        if name != FAILING:
            return real(ckpt_dir, name)
        (ckpt_dir / ".latest.tmp").write_text(name[:3])
        raise ENOSPC

    monkeypatch.setattr(checkpoint, "_write_pointer", write_pointer)
    return "OSError: [Errno 28] No space left on device"


INJECTIONS: dict[str, Callable[[pytest.MonkeyPatch], str]] = {
    "torch.save": _torch_save, "safetensors": _safetensors, "tokenizer": _tokenizer, "manifest": _manifest,
    "pointer": _pointer,
}


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


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

    monkeypatch.setattr(trainer, "save_config", save_config)
    capsys.readouterr()
    assert main([*args, "train.max_steps=4", "resume=true"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert _error_lines(err) == [
        f"error: could not write to {run_dir} (OSError: [Errno 28] No space left on device: "
        f"'{run_dir / 'config.yaml'}'); nothing in it was changed"]
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    assert not (run_dir / "run.lock").exists()


@pytest.mark.slow
def test_failed_save_on_one_rank_stops_both_with_the_same_line(run_overrides: list[str], tmp_path: Path) -> None:
    """Rank 1's ``torch.save`` of its data-loader state fails; rank 0 wrote its part. Both ranks print the
    same line (naming rank 1's error) and exit 1, instead of rank 0 dying of "Connection closed by peer"."""
    args = [*run_overrides, "name=full", "train.max_steps=4", "train.checkpoint_every=2"]
    logs = tmp_path / "logs"  # each rank's stderr in its own file: lines of two ranks cannot interleave
    proc = run(torchrun(2, "--log-dir", str(logs), "--redirects", "2", str(WORKER), FAILING, *args), expect=None)
    ckpts = tmp_path / "runs" / "full" / "checkpoints"
    per_rank = sorted(logs.rglob("stderr.log"), key=lambda p: p.parent.name)
    assert [p.parent.name for p in per_rank] == ["0", "1"], proc.stderr[-3000:]
    lines = [line for p in per_rank for line in _error_lines(p.read_text())]
    assert lines == [lines[0]] * 2, proc.stderr[-3000:]
    assert lines[0] == (f"error: could not write checkpoint {ckpts / (FAILING + '.tmp')} (rank 1: OSError: "
                        f"[Errno 28] No space left on device); the previous checkpoint is intact: "
                        f"{ckpts / 'step_00000002'}")
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]
    assert [r["step"] for r in metrics_rows(tmp_path / "runs" / "full", "train")] == [1, 2, 3, 4]


def test_disk_full_while_logging_a_row_is_one_line(run_overrides: list[str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    real = MetricsLog.log

    def log(self, kind, step, tokens, **fields):
        if kind == "train" and step == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "runs" / "full" / "metrics.jsonl"))
        return real(self, kind, step, tokens, **fields)

    monkeypatch.setattr(MetricsLog, "log", log)
    assert main([*run_overrides, "name=full", "train.max_steps=4", "train.checkpoint_every=2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    run_dir = tmp_path / "runs" / "full"
    assert _error_lines(err) == [f"error: [Errno 28] No space left on device: '{run_dir / 'metrics.jsonl'}'"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000002\n"
    assert not (run_dir / "run.lock").exists()


def test_disk_full_while_logging_the_meta_row_releases_the_lock(run_overrides: list[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A failure after the lock is taken but before the first step (here the meta row) gives the run directory
    back: a later run of the same name in this process or another is not refused."""
    run_dir = tmp_path / "runs" / "full"
    real = MetricsLog.log

    def log(self, kind, step, tokens, **fields):
        if kind == "meta":
            raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "metrics.jsonl"))
        return real(self, kind, step, tokens, **fields)

    monkeypatch.setattr(MetricsLog, "log", log)
    assert main([*run_overrides, "name=full", "train.max_steps=2"]) == 1
    assert _error_lines(capsys.readouterr().err) == [
        f"error: [Errno 28] No space left on device: '{run_dir / 'metrics.jsonl'}'"]
    assert not (run_dir / "run.lock").exists()
