"""A run's checkpoints on disk: the format, its manifest, which checkpoint is usable, and retention.

The reading side is what eval.py and publishing share with the trainer (``latest_checkpoint``,
``verify_checkpoint``); writing and resuming are ``llm.train.checkpoint``'s. Layout::

    checkpoints/
      latest              the name of the newest published checkpoint (replaced atomically)
      step_XXXXXXXX/      a complete checkpoint (``llm.train.checkpoint`` lists its contents)
        manifest.json     relative path -> {"size": bytes, "xxh3_128": hex digest} of every other file
      step_XXXXXXXX.tmp/  a save in progress, or one a crash interrupted (removed by the next save)
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import xxhash
from safetensors import safe_open

from llm.data.cache_io import file_checksum
from llm.errors import IsollmWarning, one_line
from llm.train.distributed import gather_messages, is_main_process

__all__ = ["MANIFEST", "MODEL_DIR", "POINTER", "CheckpointError", "CheckpointWarning", "checkpoint_name",
           "checkpoint_names", "fsync_path", "latest_checkpoint", "pointer_target", "prune", "usable_checkpoints",
           "verify_checkpoint", "write_manifest", "write_pointer"]

POINTER = "latest"
MANIFEST = "manifest.json"
PREFIX = "step_"
MODEL_DIR = "model"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointWarning(IsollmWarning):
    """A checkpoint was skipped on resume (incomplete or corrupt)."""


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(root: Path) -> None:
    """Hash and fsync every file of ``root``, write ``manifest.json`` and fsync it, then fsync the
    directories bottom-up, so the rename publishes durable data."""
    files = {str(p.relative_to(root)): {"size": p.stat().st_size,
                                        "xxh3_128": file_checksum(p, xxhash.xxh3_128, fsync=True)}
             for p in sorted(root.rglob("*")) if p.is_file()}
    with open(root / MANIFEST, "w") as f:
        f.write(json.dumps(files, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    for dirpath, _, _ in os.walk(root, topdown=False):  # their files were fsynced as they were hashed
        fsync_path(Path(dirpath))


def write_pointer(ckpt_dir: Path, name: str) -> None:
    tmp = ckpt_dir / f".{POINTER}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / POINTER)
    fsync_path(ckpt_dir)


def _complete_dirs(ckpt_dir: Path) -> list[Path]:
    """Renamed (not ``.tmp``) checkpoint directories, newest first."""
    if not ckpt_dir.is_dir():
        return []
    dirs = [p for p in ckpt_dir.iterdir() if p.is_dir() and p.name[len(PREFIX):].isdigit()
            and p.name.startswith(PREFIX)]
    return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def checkpoint_names(ckpt_dir: str | Path) -> list[str]:
    """Names of the renamed (complete or corrupt, not ``.tmp``) checkpoint directories, newest first."""
    return [p.name for p in _complete_dirs(Path(ckpt_dir))]


def pointer_target(ckpt_dir: Path, *, warn: bool) -> str | None:
    """The checkpoint name in the ``latest`` pointer, or None when it is missing or not a checkpoint name
    (torn, overwritten with garbage: then resume scans the directories instead)."""
    pointer = ckpt_dir / POINTER
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as err:
        name, reason = None, one_line(err)
    else:
        reason = f"{name[:40]!r} is not a checkpoint name"
    if name is not None and name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
        return name
    if warn:
        warnings.warn(f"ignoring unreadable {pointer} ({reason}); scanning {ckpt_dir}", CheckpointWarning,
                      stacklevel=3)
    return None


def prune(ckpt_dir: Path, keep: int, current: str) -> None:
    """Retention: remove stale ``.tmp`` saves and all but the newest ``keep`` checkpoints (never ``current``)."""
    for stale in ckpt_dir.glob(f"{PREFIX}*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in _complete_dirs(ckpt_dir)[keep:]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: str | Path) -> None:
    """Raise ``CheckpointError`` unless every file of the manifest exists with its size and checksum and
    the safetensors files parse. (Manifests written before checksums, sizes only, are checked by size.)"""
    path = Path(path)
    try:
        entries = json.loads((path / MANIFEST).read_text())
        entries = {rel: entry if isinstance(entry, dict) else {"size": entry} for rel, entry in entries.items()}
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}: unreadable {MANIFEST} ({one_line(err)})") from None
    for rel, entry in entries.items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"{path}: {rel} is missing (its {MANIFEST} lists it)")
        if (actual := file.stat().st_size) != entry.get("size"):
            raise CheckpointError(f"{path}: {rel} has {actual} bytes, expected {entry.get('size')}")
        if "xxh3_128" in entry and file_checksum(file, xxhash.xxh3_128) != entry["xxh3_128"]:
            raise CheckpointError(f"{path}: {rel} does not match its checksum in {MANIFEST} (altered on disk)")
        if file.suffix == ".safetensors":
            try:
                with safe_open(str(file), framework="pt"):
                    pass
            except Exception as err:  # safetensors raises its own error types for a bad header
                raise CheckpointError(f"{path}: {rel} is not a valid safetensors file ({err})") from None


def usable_checkpoints(ckpt_dir: str | Path, *, all_ranks: bool = False) -> Iterator[Path]:
    """The complete checkpoints that verify, newest first; each that does not verify is skipped with a
    ``CheckpointWarning`` naming it and why. A ``latest`` pointer that names another (an older one, one that is not
    there, or one before a newer complete checkpoint that a kill left unnamed) is one ``CheckpointWarning``: a resume
    from an older checkpoint would overwrite the newer ones, and a complete checkpoint holds exact training state.

    ``all_ranks``: every rank calls this together; the main process alone reads and hashes each candidate
    and every rank takes its verdict (one read of the checkpoint, not one per rank, and the same decision
    everywhere)."""
    ckpt_dir = Path(ckpt_dir)
    target = pointer_target(ckpt_dir, warn=True)
    dirs = _complete_dirs(ckpt_dir)
    if target is not None and dirs and dirs[0].name != target:
        why = (f"older than {dirs[0].name}: using the newest checkpoint that verifies, never overwriting newer ones "
               f"(to go back to {target}, move those out of {ckpt_dir})" if target in {d.name for d in dirs} else
               f"which is not there: using the newest checkpoint that verifies ({dirs[0].name} first)")
        warnings.warn(f"{ckpt_dir / POINTER} names {target}, {why}", CheckpointWarning, stacklevel=2)
    for candidate in dirs:
        error = None
        if not all_ranks or is_main_process():
            try:
                verify_checkpoint(candidate)
            except CheckpointError as err:
                error = str(err)  # it names the checkpoint
        if all_ranks:
            error = next(iter(gather_messages(error)), None)
        if error is not None:
            warnings.warn(f"skipping checkpoint {error}", CheckpointWarning, stacklevel=2)
            continue
        yield candidate


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The first of ``usable_checkpoints`` (the newest that verifies), or None."""
    return next(usable_checkpoints(ckpt_dir), None)
