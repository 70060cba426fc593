"""Disk full in the middle of a checkpoint: the previous checkpoint, its manifest and the ``latest`` pointer
stay byte-identical, no partial directory is left, the run stops with a one-line error (exit code 1), and a
resume once the disk has room continues from the previous checkpoint.

tests/train/test_checkpoint.py::test_failed_write_keeps_previous_checkpoint fails the *last* write of a
checkpoint (config.yaml, after the whole model is on disk); this one fails half-way through writing
model/model.safetensors (the only copy of the weights), after accelerate's state (optimizer,
RNG) was written."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import safetensors.torch
import transformers.modeling_utils

from llm.cli.train import main
from llm.train.checkpoint_files import verify_checkpoint

FAILING_STEP = 4


def _published(ckpts: Path) -> dict[str, bytes]:
    """Bytes of every file a resume may read: the ``latest`` pointer and the renamed checkpoints."""
    return {str(p.relative_to(ckpts)): p.read_bytes() for p in sorted(ckpts.rglob("*"))
            if p.is_file() and not p.relative_to(ckpts).parts[0].endswith(".tmp")}


def test_disk_full_mid_model_save_keeps_previous_checkpoint(run_overrides: list[str], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    args = [*run_overrides, "name=full", "train.max_steps=6", "train.checkpoint_every=2"]
    ckpts = tmp_path / "runs" / "full" / "checkpoints"
    seen: dict[str, object] = {}

    def disk_full_half_way(tensors, filename, metadata=None) -> None:
        """safetensors' save_file as a disk that fills up half-way through the file."""
        if f"step_{FAILING_STEP:08d}.tmp" not in str(filename):
            safetensors.torch.save_file(tensors, filename, metadata=metadata)
            return
        seen["state"] = sorted(p.name for p in (Path(filename).parents[1] / "state").iterdir())
        seen["before"] = _published(ckpts)
        data = safetensors.torch.save(tensors, metadata=metadata)
        Path(filename).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full_half_way)
    assert main(args) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1  # one line (stderr also holds the progress bars)
    err = errors[0]
    assert err.startswith(f"error: could not write checkpoint {ckpts / 'step_00000004.tmp'} (OSError: [Errno 28] No "
                          f"space left on device: '{ckpts / 'step_00000004.tmp' / 'model' / 'model.safetensors'}'")
    assert err.endswith(f"the previous checkpoint is intact: {ckpts / 'step_00000002'}")

    # the failure hit after the optimizer state was written, and undid nothing of the previous checkpoint
    assert {"optimizer.bin", "data_rank0.pt"} <= set(seen["state"])
    assert {"latest", "step_00000002/manifest.json", "step_00000002/model/model.safetensors",
            "step_00000002/state/optimizer.bin"} <= set(seen["before"])
    assert _published(ckpts) == seen["before"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]  # the partial one is gone
    assert (ckpts / "latest").read_text() == "step_00000002\n"
    verify_checkpoint(ckpts / "step_00000002")

    monkeypatch.undo()  # room on the disk again
    assert main([*args, "resume=true"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert (ckpts / "latest").read_text() == "step_00000006\n"
    verify_checkpoint(ckpts / "step_00000006")
