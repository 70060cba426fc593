"""Same-size corruption of the newest checkpoint (garbage trainer.json, zeroed optimizer or data-loader state, a
poisoned pickle, flipped bytes in the weights, random bytes in ``latest``): the manifest's checksums catch it, the
resume falls back to the previous checkpoint with one warning, and no pickle runs. Bytes that pass the checksum but
do not load fall back too. When no checkpoint is usable, ``resume=true`` refuses to start over them; a corrupt
validation cache is rebuilt."""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny import metrics_rows, start_train_py

import llm.train.checkpoint_files as checkpoint_files
from llm.cli.train import main
from llm.config import load_config
from llm.data.tokenizer import load_tokenizer
from llm.data.validation import build_val_windows, val_cache_path
from llm.train.checkpoint_files import CheckpointWarning, latest_checkpoint

NEWEST, PREVIOUS = "step_00000004", "step_00000002"


class _Poison:
    """Unpickles by calling ``Path.touch(marker)``: proof that a pickle ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.fixture(scope="module")
def trained(overrides_under: Callable[[Path], list[str]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/run with checkpoints at steps 2 and 4, trained once; each test corrupts a copy."""
    root = tmp_path_factory.mktemp("trained")
    assert main([*overrides_under(root), "name=run", "train.max_steps=4", "train.checkpoint_every=2"]) == 0
    return root / "runs" / "run"


@pytest.fixture
def run_copy(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run under ``tmp_path`` (where ``run_overrides`` writes)."""
    shutil.copytree(trained, tmp_path / "runs" / "run")
    return tmp_path / "runs" / "run"


def _same_size(path: Path, data: bytes) -> None:
    size = path.stat().st_size
    path.write_bytes((data * (size // max(len(data), 1) + 1))[:size])


def _garbage_trainer_json(ckpt: Path, marker: Path) -> str:
    _same_size(ckpt / "trainer.json", b"{garbage")
    return "trainer.json"


def _zeroed_optimizer(ckpt: Path, marker: Path) -> str:
    _same_size(ckpt / "state" / "optimizer.bin", b"\0")
    return "state/optimizer.bin"


def _zeroed_data_state(ckpt: Path, marker: Path) -> str:
    _same_size(ckpt / "state" / "data_rank0.pt", b"\0")
    return "state/data_rank0.pt"


def _poisoned_random_states(ckpt: Path, marker: Path) -> str:
    state = ckpt / "state" / "random_states_0.pkl"
    poison = pickle.dumps(_Poison(marker))  # bytes after the pickle's STOP are never read: pad to the same size
    state.write_bytes(poison + bytes(state.stat().st_size - len(poison)))
    return "state/random_states_0.pkl"


def _flipped_weights(ckpt: Path, marker: Path) -> str:
    weights = ckpt / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100:-90] = bytes(b ^ 0xFF for b in data[-100:-90])  # tensor bytes: the header still parses
    weights.write_bytes(bytes(data))
    return "model/model.safetensors"


CORRUPTIONS: dict[str, Callable[[Path, Path], str]] = {
    "trainer.json": _garbage_trainer_json, "optimizer.bin": _zeroed_optimizer, "data_rank0.pt": _zeroed_data_state,
    "random_states_0.pkl": _poisoned_random_states, "weights": _flipped_weights,
}


def _resume(run_overrides: list[str], capsys, *more: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*run_overrides, "name=run", "train.max_steps=6", "train.checkpoint_every=2", *more])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_file_in_newest_checkpoint_falls_back_to_previous(corruption: str, run_copy: Path,
                                                                  run_overrides: list[str], tmp_path: Path,
                                                                  capsys) -> None:
    ckpts = run_copy / "checkpoints"
    marker = tmp_path / "pickle-ran"
    rel = CORRUPTIONS[corruption](ckpts / NEWEST, marker)
    with pytest.warns(CheckpointWarning, match=rf"skipping checkpoint .*{NEWEST}: .*{rel} does not match its checksum"):
        assert latest_checkpoint(ckpts) == ckpts / PREVIOUS

    code, out, err = _resume(run_overrides, capsys, "resume=true")
    assert code == 0, err
    assert f"resumed from {ckpts / PREVIOUS} at step 2" in out
    assert "Traceback" not in err
    assert not marker.exists()  # the poisoned pickle never ran
    assert [r["step"] for r in metrics_rows(run_copy, "train")] == [1, 2, 3, 4, 5, 6]


def test_checkpoint_that_verifies_but_does_not_load_falls_back(run_copy: Path, trained: Path,
                                                               run_overrides: list[str], capsys,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes written corrupt (so the manifest's checksum is theirs): loading fails, the previous checkpoint is
    loaded over whatever the failed attempt had restored, and the resumed steps equal the original ones. Each
    candidate is read and hashed once."""
    ckpt = run_copy / "checkpoints" / NEWEST
    _zeroed_optimizer(ckpt, Path())
    (ckpt / checkpoint_files.MANIFEST).unlink()
    checkpoint_files.write_manifest(ckpt)
    verified = []
    real_verify = checkpoint_files.verify_checkpoint
    monkeypatch.setattr(checkpoint_files, "verify_checkpoint", lambda path: verified.append(Path(path).name)
                        or real_verify(path))
    with pytest.warns(CheckpointWarning, match=rf"skipping checkpoint .*{NEWEST}: cannot load it \("):
        code, out, err = _resume(run_overrides, capsys, "resume=true", "train.max_steps=4")
    assert code == 0, err
    assert verified == [NEWEST, PREVIOUS]
    assert f"resumed from {run_copy / 'checkpoints' / PREVIOUS}" in out
    original = {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics_rows(trained, "train")}
    resumed = {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics_rows(run_copy, "train")}
    assert resumed == original  # steps 3 and 4 again, bit for bit


def test_random_bytes_in_latest_pointer_are_ignored(run_copy: Path, run_overrides: list[str], capsys) -> None:
    ckpts = run_copy / "checkpoints"
    (ckpts / "latest").write_bytes(bytes(range(200, 256)))
    with pytest.warns(CheckpointWarning, match=r"ignoring unreadable .*latest \(UnicodeDecodeError"):
        assert latest_checkpoint(ckpts) == ckpts / NEWEST
    code, out, err = _resume(run_overrides, capsys, "resume=true")
    assert code == 0, err
    assert f"resumed from {ckpts / NEWEST} at step 4" in out


@pytest.mark.slow
def test_no_usable_checkpoint_refuses_to_start_over_them(run_copy: Path, run_overrides: list[str], tmp_path: Path,
                                                         capsys) -> None:
    ckpts = run_copy / "checkpoints"
    for name in (NEWEST, PREVIOUS):
        _flipped_weights(ckpts / name, Path())
    before = {p: p.read_bytes() for p in sorted(run_copy.rglob("*")) if p.is_file()}
    train_py = start_train_py(tmp_path, *run_overrides, "name=run", "train.max_steps=6", "resume=true")
    _, err = train_py.communicate(timeout=300)
    assert train_py.returncode == 2, err
    assert [line for line in err.splitlines() if line.startswith(("warning:", "error:"))] == [
        *(f"warning: skipping checkpoint {ckpts / name}: model/model.safetensors does not match its checksum in "
          f"manifest.json (altered on disk)" for name in (NEWEST, PREVIOUS)),
        f"error: resume: no usable checkpoint in {ckpts} (found {NEWEST}, {PREVIOUS}; each skipped, see the "
        f"warnings): not starting over them; repair or move them, or pass resume=restart to start from step 0"]
    assert "Traceback" not in err
    assert {p: p.read_bytes() for p in sorted(run_copy.rglob("*")) if p.is_file()} == before  # history kept

    code, out, err = _resume(run_overrides, capsys, "resume=restart")
    assert code == 0, err
    assert "holds no usable checkpoint: starting from step 0" in out
    assert [r["step"] for r in metrics_rows(run_copy, "train")] == [1, 2, 3, 4, 5, 6]


def test_corrupt_validation_cache_is_rebuilt(run_overrides: list[str]) -> None:
    config = load_config(None, [*run_overrides, "train.max_steps=1"])
    tokenizer = load_tokenizer(config.data.tokenizer)
    windows = build_val_windows(config.data, tokenizer)
    path = val_cache_path(config.data, tokenizer)
    for corrupt in (lambda data: bytes(len(data)),  # zeroed: not a torch file
                    lambda data: data[:-300] + bytes(b ^ 1 for b in data[-300:-200]) + data[-200:]):  # bit flips
        path.write_bytes(corrupt(path.read_bytes()))
        with pytest.warns(UserWarning, match=rf"rebuilding the validation cache {path}: unreadable"):
            assert torch.equal(build_val_windows(config.data, tokenizer), windows)
        assert torch.equal(torch.load(path)["windows"], windows)  # the cache file is whole again


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_checkpoint_renamed_by_hand_is_refused_not_resumed_over_newer_ones(run_copy: Path, run_overrides: list[str],
                                                                             capsys) -> None:
    """step_2 renamed step_8: before, chosen by its name as the newest, resumed at step 2 and then saved over the
    newer complete step_4, while the warning said "never overwriting newer ones"."""
    ckpts = run_copy / "checkpoints"
    (ckpts / PREVIOUS).rename(renamed := ckpts / "step_00000008")
    before = _files(run_copy)
    with pytest.warns(CheckpointWarning):  # latest names step_4, older than step_8
        code, _, err = _resume(run_overrides, capsys, "resume=true")
    assert code == 2
    assert err == (f"error: resume: {renamed} holds step 2 (its trainer.json): a directory renamed by hand; resumed, "
                   f"the run would save over newer checkpoints. Rename it {PREVIOUS} or move it out of {ckpts}\n")
    assert _files(run_copy) == before


def test_a_directory_in_place_of_the_latest_pointer_is_refused_before_training(run_copy: Path,
                                                                               run_overrides: list[str],
                                                                               capsys) -> None:
    """Before: 2 steps trained, then "could not write checkpoint ...; the previous checkpoint is intact: none"."""
    ckpts = run_copy / "checkpoints"
    (ckpts / "latest").unlink()
    (ckpts / "latest").mkdir()
    before = _files(run_copy)
    code, _, err = _resume(run_overrides, capsys, "resume=true")
    assert code == 2
    assert err == (f"error: resume: {ckpts / 'latest'} is not the pointer file the run writes there (a directory?): "
                   f"move it out of {ckpts}\n")
    assert _files(run_copy) == before
