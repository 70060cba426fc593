"""The engine a run trains with is read off the prepared model, and the one its launch configuration asked
for off the variables ``accelerate launch`` sets; on CPU they differ (Accelerate drops the FSDP and DeepSpeed
plugins) and the run says so."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from accelerate.utils import DistributedType
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from llm.train.engine import engine_in_use, engine_mismatch, engine_requested, set_deepspeed_micro_batch

REPO = Path(__file__).resolve().parents[2]
FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true"}


def stub_accelerator(kind: DistributedType, **state: object) -> SimpleNamespace:
    return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(**state))


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"ACCELERATE_USE_CPU": "1"}, None),
    (FSDP2_ENV, "fsdp2-full_shard"),
    ({**FSDP2_ENV, "FSDP_RESHARD_AFTER_FORWARD": "false"}, "fsdp2-shard_grad_op"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}, "fsdp1-shard_grad_op"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "deepspeed-zero2"),
])
def test_requested_engine_from_launch_variables(env: dict[str, str], expected: str | None) -> None:
    assert engine_requested(env) == expected


@pytest.mark.parametrize("stage", [2, 3])
def test_requested_zero_stage_from_the_repository_deepspeed_json(stage: int) -> None:
    path = Path(__file__).resolve().parents[2] / "launch" / "deepspeed" / f"zero{stage}.json"
    assert json.loads(path.read_text())["zero_optimization"]["stage"] == stage
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)}
    assert engine_requested(env) == f"deepspeed-zero{stage}"


@pytest.fixture
def one_process_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_engine_read_off_the_prepared_model(one_process_group: None) -> None:
    plain = stub_accelerator(DistributedType.NO)
    assert engine_in_use(nn.Linear(2, 2), plain) == "single"
    assert engine_in_use(DistributedDataParallel(nn.Linear(2, 2)), stub_accelerator(DistributedType.MULTI_CPU)) == "ddp"
    sharded = fully_shard(nn.Sequential(nn.Linear(2, 2)))
    fsdp = stub_accelerator(DistributedType.FSDP, fsdp_plugin=SimpleNamespace(reshard_after_forward=True))
    assert engine_in_use(sharded, fsdp) == "fsdp2-full_shard"
    zero = stub_accelerator(DistributedType.DEEPSPEED, deepspeed_plugin=SimpleNamespace(zero_stage=3))
    assert engine_in_use(nn.Linear(2, 2), zero) == "deepspeed-zero3"


def test_mismatch_is_one_line_naming_both_engines() -> None:
    assert engine_mismatch(None, "ddp") is None
    assert engine_mismatch("fsdp2-full_shard", "fsdp2-full_shard") is None
    line = engine_mismatch("deepspeed-zero3", "ddp")
    assert "\n" not in line and "deepspeed-zero3" in line and "ddp" in line
    # which is which: the configuration's engine is the one asked for, the model's the one in use
    assert "asked for deepspeed-zero3, but this run trains with ddp" in line
    assert "nothing is sharded by deepspeed-zero3" in line


def test_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_USE_", "FSDP_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert engine_requested() == "fsdp2-full_shard"


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_launch_gets_the_micro_batch_before_prepare(stage: int) -> None:
    """launch/deepspeed/*.json leave the micro batch "auto", which Accelerate fills only from a prepared
    dataloader; the trainer's is not, so without this ``prepare`` refused every DeepSpeed run on GPU."""
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(hf_ds_config=str(REPO / "launch" / "deepspeed" / f"zero{stage}.json"))
    assert plugin.is_auto("train_micro_batch_size_per_gpu")
    set_deepspeed_micro_batch(stub_accelerator(DistributedType.DEEPSPEED, deepspeed_plugin=plugin), 6)
    assert plugin.get_value("train_micro_batch_size_per_gpu") == 6
    set_deepspeed_micro_batch(stub_accelerator(DistributedType.MULTI_CPU, deepspeed_plugin=None), 6)  # no-op
