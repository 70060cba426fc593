"""Saving and resuming atomic checkpoints (layout: docs/ARCHITECTURE.md, "Run directory"; the files, the manifest,
which checkpoint is usable and retention: ``llm.train.checkpoint_files``).

A checkpoint is written into ``step_XXXXXXXX.tmp/``; every file is flushed and fsynced, a
``manifest.json`` of file sizes and xxh3-128 checksums is written last inside it, the directory is
renamed to ``step_XXXXXXXX/`` and only then is the ``latest`` pointer replaced (write a temp file,
fsync, ``os.replace``). A crash at any point therefore leaves the previous checkpoint and pointer
intact; at worst a stale ``.tmp`` directory, which the next save removes. A save that fails (any
exception, on any rank: a full disk surfaces as ``OSError``, torch's ``RuntimeError``, a
``SafetensorError`` or a bare ``Exception`` from the tokenizer) removes its ``.tmp`` and raises the
same one-line ``CheckpointError`` on every rank. On resume a checkpoint whose files do not match its
manifest (truncated, missing, altered bytes) or that fails to load is skipped with a
``CheckpointWarning`` and the previous complete one is used.

The weights are written once. Single-process and DDP runs keep them in ``model/`` (``llm.train.model_dir``) only:
``save_state`` skips its copy and ``load_state`` reads them back from ``model/`` (bitwise: the export
is a safetensors file of the same tensors, in their training dtype). FSDP2 and DeepSpeed save their
sharded model state into ``state/`` themselves, beside their sharded optimizer state (Accelerate offers
no way to leave it out), so under those engines ``model/`` is a second, consolidated copy.

Every collective step (``save_state``, ``get_state_dict``) runs on every rank; files that exist
once are written by the main process only.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import extract_model_from_parallel
from safetensors.torch import load_model
from tokenizers import Tokenizer
from torch import nn

from llm.config import RunConfig, load_config, save_config
from llm.data.errors import DataError
from llm.data.identity import data_identity, identity_differences
from llm.data.tokenizer import tokenizer_identity
from llm.errors import one_line
from llm.model.config import ConfigError
from llm.train.checkpoint_files import (
    MODEL_DIR,
    POINTER,
    CheckpointError,
    CheckpointWarning,
    checkpoint_name,
    checkpoint_names,
    fsync_path,
    pointer_target,
    prune,
    usable_checkpoints,
    write_manifest,
    write_pointer,
)
from llm.train.distributed import all_ranks_agree, gather_messages, is_main_process, rank_and_world_size
from llm.train.model_dir import save_model_dir
from llm.train.run_identity import run_identity

__all__ = ["load_checkpoint", "resume_checkpoint", "save_checkpoint"]


def _load_exported_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy the weights of the ``save_pretrained`` directory ``model_dir`` (one file or shards) into
    ``model`` in place; every parameter must be restored, tied ones (saved once) by their twin."""
    index = model_dir / "model.safetensors.index.json"
    shards = ["model.safetensors"]
    if index.is_file():  # sharded: the files its weight map names
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    missing, unexpected = set(model.state_dict()), []
    device = str(next(model.parameters()).device)  # straight to the GPU: no rank holds a CPU copy
    for shard in shards:
        not_in_shard, extra = load_model(model, model_dir / shard, strict=False, device=device)
        missing &= set(not_in_shard)
        unexpected += extra
    if missing or unexpected:
        raise CheckpointError(f"{model_dir}: weights do not fit the model (missing {sorted(missing)}, "
                              f"unexpected {sorted(unexpected)})")


def _skip_weights(models: list[nn.Module], weights: list[dict], output_dir: str) -> None:
    """``save_state`` pre-hook: write no plain model weights (``model/`` holds them)."""
    weights.clear()


def _load_weights_from_model_dir(models: list[nn.Module], input_dir: str) -> None:
    """``load_state`` pre-hook: restore plain models from ``model/`` beside ``state/`` instead."""
    for model in models:
        _load_exported_weights(extract_model_from_parallel(model), Path(input_dir).parent / MODEL_DIR)
    models.clear()


@contextmanager
def _weights_in_model_dir(accelerator: Accelerator) -> Iterator[None]:
    """While active, ``save_state`` / ``load_state`` leave plain (single-process, DDP) model weights to
    ``model/``. Under FSDP2 and DeepSpeed Accelerate hands the hooks no weights, so they change nothing."""
    handles = [accelerator.register_save_state_pre_hook(_skip_weights),
               accelerator.register_load_state_pre_hook(_load_weights_from_model_dir)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def save_checkpoint(ckpt_dir: str | Path, step: int, *, accelerator: Accelerator, model: nn.Module,
                    tokenizer: Tokenizer, config: RunConfig, trainer_state: dict[str, Any], loader: Any,
                    keep: int) -> Path:
    """Write checkpoint ``step`` atomically on every rank together; return its final path. A failed save on any
    rank is the same ``CheckpointError`` on every rank (module docstring)."""
    ckpt_dir = Path(ckpt_dir)
    name = checkpoint_name(step)
    tmp, final = ckpt_dir / f"{name}.tmp", ckpt_dir / name
    main = is_main_process()
    rank, world_size = rank_and_world_size()
    error: str | None = None
    if main:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "state").mkdir(parents=True)
        except OSError as err:
            error = one_line(err)
    errors = gather_messages(error)  # every rank waits for the directory, and learns if it failed
    if not errors:
        try:
            with _weights_in_model_dir(accelerator):
                accelerator.save_state(str(tmp / "state"))
            torch.save(loader.state_dict(), tmp / "state" / f"data_rank{rank}.pt")
            state_dict = accelerator.get_state_dict(model)
            if main:
                hf_model = accelerator.unwrap_model(model)
                save_model_dir(hf_model, tmp / MODEL_DIR, tokenizer, state_dict=state_dict)
                (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=1))
                save_config(config, tmp / "config.yaml")
        except Exception as err:  # a full disk raises OSError, RuntimeError, SafetensorError or a bare Exception
            error = f"rank {rank}: {one_line(err)}" if world_size > 1 else one_line(err)
        errors = gather_messages(error)
    if not errors and main:
        renamed = False
        try:
            write_manifest(tmp)
            if final.exists():  # a step saved before, by a run this one did not resume from (resume=false or
                # restart, or a checkpoint the resume skipped as unusable)
                shutil.rmtree(final)
            os.rename(tmp, final)
            renamed = True
            fsync_path(ckpt_dir)
            write_pointer(ckpt_dir, name)
        except Exception as err:
            error = one_line(err)
            if renamed and pointer_target(ckpt_dir, warn=False) != name:  # renamed, never published
                shutil.rmtree(final, ignore_errors=True)
        else:
            prune(ckpt_dir, keep, name)
    errors = errors or gather_messages(error)
    if errors:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            (ckpt_dir / f".{POINTER}.tmp").unlink(missing_ok=True)
        accelerator.wait_for_everyone()  # the pointer is read after the main process cleaned up
        # the pointer, else the newest renamed directory (a pointer that is not a file names none)
        previous = pointer_target(ckpt_dir, warn=False) or next(iter(checkpoint_names(ckpt_dir)), None)
        raise CheckpointError(
            f"could not write checkpoint {tmp} ({'; '.join(errors)}); the previous checkpoint is intact: "
            f"{ckpt_dir / previous if previous else 'none'}")
    return final


def load_checkpoint(path: str | Path, *, accelerator: Accelerator, loader: Any, config: RunConfig,
                    tokenizer: Tokenizer) -> dict:
    """Restore model, optimizer, RNG and this rank's data-loader state from ``path``; return the saved ``trainer.json``
    dict. First, before anything is read or written, the checkpoint's config.yaml is checked against ``config``: the
    run's identity (``llm.train.run_identity``: every field but the model, the data and a declared few, the seed
    and the optimizer's betas among them), the model config (every field) and the data's identity
    (``llm.data.identity``), each a ``ConfigError`` naming every field that differs with both values; then the
    tokenizer. A field the checkpoint predates is read as ``load_config`` reads a saved run: as runs had it before
    the field existed (``train.tf32`` false, ``data.document_masking`` false), else its default, which was the
    behaviour then (``train.optimizer`` adamw): an old checkpoint is refused only where this run would train
    otherwise than it did. A checkpoint from before the schedule was a function of the step (llm/train/optim.py)
    also holds a scheduler.bin, which nothing reads."""
    path = Path(path)
    saved_config = load_config(str(path / "config.yaml"), saved_run=True)
    recorded = run_identity(saved_config)
    if changed := {key: f"{key} (checkpoint {recorded[key]!r}, config {value!r})"
                   for key, value in run_identity(config).items() if recorded[key] != value}:
        raise ConfigError(", ".join(changed), f"checkpoint {path} was trained with other run settings: "
                          f"{', '.join(changed.values())}; a resume changes only what "
                          f"llm.train.run_identity.RESUMABLE lists: resume with the checkpoint's values, or start "
                          f"another run (name=)")
    saved = asdict(saved_config.model)  # schema fills newer fields
    current = asdict(config.model)
    if diffs := [f"{k} (checkpoint {saved.get(k)!r}, config {current.get(k)!r})"
                 for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]:
        raise ConfigError("model", f"checkpoint {path} has a different model: {', '.join(diffs)}")
    # every data field but those that cannot change a token, the split or the model's view (llm.data.identity);
    # document_masking among them: changed mid-run, the model would see its data otherwise from here on
    if diffs := identity_differences(data_identity(saved_config.seeded_data()), data_identity(config.seeded_data())):
        raise ConfigError("data", f"checkpoint {path} was trained on other data settings: {', '.join(diffs)}; they "
                                  f"change the tokens, the split or how the model sees them: resume with the "
                                  f"checkpoint's, or start another run (name=)")
    # the checkpoint's own tokenizer: a run older than the loader state's fingerprints is checked by it too
    saved_tokenizer = path / MODEL_DIR / "tokenizer.json"
    if saved_tokenizer.is_file() and (was := tokenizer_identity(Tokenizer.from_file(str(saved_tokenizer)))) != (
            now := tokenizer_identity(tokenizer)):
        raise ConfigError("data.tokenizer", f"checkpoint {path} was trained with another tokenizer (fingerprint {was}, "
                                            f"data.tokenizer's {now}): resume with the tokenizer it saves, "
                                            f"{saved_tokenizer}")
    saved_world = len(list((path / "state").glob("data_rank*.pt")))
    # every rank's loader state: a run resumed with another number of processes continues the global data
    # order from all of them (prepared tokens), or the loader refuses in one line (a streamed source)
    loader.load_state_dicts([torch.load(path / "state" / f"data_rank{r}.pt", weights_only=True)
                             for r in range(saved_world)])
    with _weights_in_model_dir(accelerator):
        accelerator.load_state(str(path / "state"))
    return json.loads((path / "trainer.json").read_text())


def resume_checkpoint(ckpt_dir: str | Path, *, accelerator: Accelerator, loader: Any, config: RunConfig,
                      tokenizer: Tokenizer) -> tuple[Path | None, dict | None]:
    """Load the newest usable checkpoint of ``ckpt_dir`` (``load_checkpoint``); return it and its
    ``trainer.json``. One that fails to load on any rank (bytes that verify but do not parse: a file
    written corrupt) is skipped with a ``CheckpointWarning`` and the previous one is tried, as one that
    fails verification. ``(None, None)`` when none is usable; a checkpoint that does not fit this launch
    (``ConfigError``, or the data loader's ``DataError``: another world size on a streamed source) or whose name is
    not its step (a directory renamed by hand: the newest by name, not by step) stops the search. Every rank takes
    the same decisions."""
    for candidate in usable_checkpoints(ckpt_dir, all_ranks=True):
        error, saved = None, None
        try:
            saved = load_checkpoint(candidate, accelerator=accelerator, loader=loader, config=config,
                                    tokenizer=tokenizer)
            if not isinstance(saved, dict) or not {"state", "grad_norm_tracker"} <= saved.keys():
                raise ValueError("trainer.json lacks its state or grad_norm_tracker")
            if (name := checkpoint_name(saved["state"]["step"])) != candidate.name:  # chosen by its name as newest
                raise ConfigError("resume", f"{candidate} holds step {saved['state']['step']} (its trainer.json): a "
                                            f"directory renamed by hand; resumed, the run would save over newer "
                                            f"checkpoints. Rename it {name} or move it out of {ckpt_dir}")
        except (ConfigError, DataError):  # the checkpoint is sound but does not fit this launch or data
            raise
        except Exception as err:  # torch, pickle, json and accelerate each raise their own types
            error = one_line(err)
        if all_ranks_agree(error is None, any_rank=False):
            return candidate, saved
        if error is not None:
            warnings.warn(f"skipping checkpoint {candidate}: cannot load it ({error})", CheckpointWarning,
                          stacklevel=2)
    return None, None
