"""Which parallel engine a run trains with, and which one its launch configuration asked for.

They can differ without a word from Accelerate: on CPU, ``accelerate launch --config_file
launch/accelerate/fsdp2.yaml`` (or a DeepSpeed config) sets ``ACCELERATE_USE_FSDP`` /
``ACCELERATE_USE_DEEPSPEED`` for the processes, but ``Accelerator(cpu=True)`` drops the plugin and
reports ``MULTI_CPU``: the model is wrapped in DDP (or not at all with one process), nothing is sharded,
and the loss equals the DDP run's. The trainer therefore records the engine read off the prepared
model, not the one the configuration named, and says so at start when the two differ.

Engine names: ``single`` (one process, no wrapper), ``ddp``, ``fsdp2-full_shard`` /
``fsdp2-shard_grad_op`` (FSDP2 with / without resharding parameters after forward), ``fsdp1-<strategy>``,
``deepspeed-zero<stage>``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

__all__ = ["engine_in_use", "engine_mismatch", "engine_requested", "set_deepspeed_micro_batch"]


def set_deepspeed_micro_batch(accelerator: Accelerator, micro_batch_size: int) -> None:
    """Give a DeepSpeed launch its ``train_micro_batch_size_per_gpu`` before ``accelerator.prepare``.

    launch/deepspeed/*.json leave it "auto", which Accelerate fills from the ``batch_size`` of a dataloader
    passed to ``prepare``; the trainer's loader is not prepared (it shards windows itself), so without this
    ``prepare`` refuses the run (found on the first GPU check: on CPU Accelerate drops the plugin)."""
    if (plugin := accelerator.state.deepspeed_plugin) is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size


def _fsdp2_name(reshard_after_forward: bool) -> str:
    return "fsdp2-full_shard" if reshard_after_forward else "fsdp2-shard_grad_op"


def engine_in_use(model: nn.Module, accelerator: Accelerator) -> str:
    """The engine of ``model`` as ``accelerator.prepare`` returned it."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return f"deepspeed-zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if isinstance(model, FSDPModule):
        return _fsdp2_name(bool(accelerator.state.fsdp_plugin.reshard_after_forward))
    if isinstance(model, FullyShardedDataParallel):
        return f"fsdp1-{model.sharding_strategy.name.lower()}"
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    return "single"


def _zero_stage(env: Mapping[str, str]) -> str:
    """The ZeRO stage a DeepSpeed launch asked for: Accelerate's own variable, else the JSON's
    ``zero_optimization.stage`` (paths relative to the working directory, as Accelerate reads them)."""
    if env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        return env["ACCELERATE_DEEPSPEED_ZERO_STAGE"]
    path = Path(env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", ""))
    try:
        return str(json.loads(path.read_text())["zero_optimization"]["stage"])
    except (OSError, ValueError, KeyError, TypeError):
        return "?"


def engine_requested(env: Mapping[str, str] | None = None) -> str | None:
    """The sharding engine the launch configuration asked for (from the variables ``accelerate launch``
    sets), or None when it asked for none (plain data parallel or a single process)."""
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return f"deepspeed-zero{_zero_stage(env)}"
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        if env.get("FSDP_VERSION", "1") == "2":
            return _fsdp2_name(env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true")
        return f"fsdp1-{env.get('FSDP_SHARDING_STRATEGY', 'FULL_SHARD').lower()}"
    return None


def engine_mismatch(requested: str | None, in_use: str) -> str | None:
    """One line saying the run does not train with the engine its launch configuration asked for."""
    if requested is None or requested == in_use:
        return None
    return (f"engine: the launch configuration asked for {requested}, but this run trains with {in_use} "
            f"(Accelerate drops FSDP and DeepSpeed plugins on CPU); nothing is sharded by {requested}")
