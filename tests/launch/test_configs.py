"""Every Accelerate / DeepSpeed config in launch/ loads the way `accelerate launch` loads it, and says what
docs/distributed.md promises (bf16, FSDP2 full shard per decoder layer with sharded checkpoints, ZeRO
stage and consolidated ZeRO-3 export). Accelerate ignores its FSDP plugin on CPU, so the FSDP2 config
is checked here, and FSDP2 itself is run through torch's fully_shard in test_sharded.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import accelerate.commands.launch as accelerate_launch
import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils import launch as launch_utils

from llm.model.configuration_isollm import IsoLLMConfig
from llm.model.modeling_isollm import IsoLLMDecoderLayer, IsoLLMForCausalLM

REPO = Path(__file__).resolve().parents[2]
ACCELERATE_CONFIGS = sorted((REPO / "launch" / "accelerate").glob("*.yaml"))
DEEPSPEED_CONFIGS = sorted((REPO / "launch" / "deepspeed").glob("*.json"))
EXPECTED_TYPE = {
    "single_gpu": DistributedType.NO,
    "ddp": DistributedType.MULTI_GPU,
    "fsdp2": DistributedType.FSDP,
    "deepspeed_zero2": DistributedType.DEEPSPEED,
    "deepspeed_zero3": DistributedType.DEEPSPEED,
}
ZERO_STAGE = {"deepspeed_zero2": 2, "deepspeed_zero3": 3}


def launch_env(config: Path, *extra: str) -> tuple[Any, dict[str, str]]:
    """What `accelerate launch --config_file config [extra] train.py` resolves and exports to train.py,
    on a pretend 8-GPU node: the launcher functions are intercepted right before they would spawn."""
    args = accelerate_launch.launch_command_parser().parse_args(
        ["--config_file", str(config), *extra, "train.py", "--config", "x.yaml"])
    seen: dict[str, Any] = {}
    launchers = {"multi_gpu_launcher": launch_utils.prepare_multi_gpu_env,
                 "deepspeed_launcher": lambda a: launch_utils.prepare_deepspeed_cmd_env(a)[1],
                 "simple_launcher": lambda a: launch_utils.prepare_simple_launcher_cmd_env(a)[1]}
    patches = [mock.patch.object(accelerate_launch, name, lambda a, p=prepare: seen.update(args=a, env=p(a)))
               for name, prepare in launchers.items()]
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=8):
        for patch in patches:
            patch.start()
        try:
            accelerate_launch.launch_command(args)
        finally:
            for patch in patches:
                patch.stop()
    return seen["args"], seen["env"]


def test_every_mode_has_a_config() -> None:
    assert sorted(p.stem for p in ACCELERATE_CONFIGS) == sorted(EXPECTED_TYPE)
    assert sorted(p.name for p in DEEPSPEED_CONFIGS) == ["zero2.json", "zero3.json"]


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_accelerate_config_loads(path: Path) -> None:
    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type == EXPECTED_TYPE[path.stem]
    assert config.num_machines == 1 and config.machine_rank == 0  # multi-node: command-line overrides
    assert not config.use_cpu  # `--cpu` would start one process (verified with accelerate 1.15)
    args, env = launch_env(path)
    assert args.num_processes == (1 if path.stem == "single_gpu" else 8)
    if path.stem in ZERO_STAGE:
        # bf16 comes from the JSON's "auto" (Accelerate refuses mixed_precision beside a DeepSpeed file)
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    else:
        assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_multi_node_overrides_reach_the_launcher() -> None:
    """The overrides launch/slurm/train.sbatch passes turn the one-node DDP config into 4 x 8 ranks."""
    args, _ = launch_env(REPO / "launch/accelerate/ddp.yaml", "--num_machines", "4", "--num_processes",
                           "32", "--machine_rank", "3", "--main_process_ip", "node001",
                           "--main_process_port", "23456", "--same_network")
    assert (args.num_machines, args.num_processes, args.machine_rank) == (4, 32, 3)
    # torchrun's own arguments, as accelerate hands them on: 8 per node, static rendezvous on node001
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("8", "4", 3)
    assert (args.master_addr, args.master_port) == ("node001", "23456")


def test_fsdp2_full_shard_per_decoder_layer_with_sharded_state() -> None:
    _, env = launch_env(REPO / "launch/accelerate/fsdp2.yaml")
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True  # FULL_SHARD: free gathered params after each unit
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert plugin.cpu_ram_efficient_loading  # rank 0's init is broadcast: fully_shard does not sync
    # The wrap unit names our decoder layer, and Accelerate resolves it on a real model.
    assert plugin.transformer_cls_names_to_wrap == [IsoLLMDecoderLayer.__name__]
    model = IsoLLMForCausalLM(IsoLLMConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1))
    plugin.set_auto_wrap_policy(model)
    policy = plugin.auto_wrap_policy
    assert policy(model.model.layers[0], recurse=False, nonwrapped_numel=0)
    assert not policy(model.model.layers[0].mlp, recurse=False, nonwrapped_numel=0)


@pytest.mark.parametrize("stem", sorted(ZERO_STAGE))
def test_deepspeed_plugin_reads_our_json(stem: str) -> None:
    _, env = launch_env(REPO / f"launch/accelerate/{stem}.yaml")
    with mock.patch.dict(os.environ, env):
        plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == ZERO_STAGE[stem]
    expected = json.loads((REPO / f"launch/deepspeed/zero{ZERO_STAGE[stem]}.json").read_text())
    # Accelerate adds only its own logging key (steps_per_print) to what the file says.
    assert {k: v for k, v in plugin.deepspeed_config.items() if k != "steps_per_print"} == expected


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys in {keys}"
    return dict(pairs)


@pytest.mark.parametrize("path", DEEPSPEED_CONFIGS, ids=lambda p: p.stem)
def test_deepspeed_json(path: Path) -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    config = json.loads(path.read_text(), object_pairs_hook=_no_duplicate_keys)
    stage = int(path.stem.removeprefix("zero"))
    # Batch sizes, clipping and precision come from the trainer through Accelerate, never twice.
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "gradient_clipping"):
        assert config[key] == "auto", key
    assert config["bf16"] == {"enabled": "auto"} and config["fp16"] == {"enabled": False}
    assert "optimizer" not in config and "scheduler" not in config  # the trainer's AdamW + schedule
    zero = DeepSpeedZeroConfig(**config["zero_optimization"])  # DeepSpeed's own schema: typos fail
    assert zero.stage == stage
    if stage == 3:  # model/ in a checkpoint is consolidated and loads on one CPU process
        assert zero.gather_16bit_weights_on_model_save
