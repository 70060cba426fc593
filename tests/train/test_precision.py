"""One precision rule, ``TrainConfig.autocast_dtype``: the trainer's Accelerate setting and MFU peak and
evaluation's autocast all follow it. (A bf16 run on CPU is trained end to end in test_fit.py.) And ``train.tf32``:
the training step's fp32 matmuls on TF32 tensor cores, on CUDA only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from llm.config import RunConfig, TrainConfig, load_config
from llm.model.acceleration import POLICIES, PORTABLE
from llm.train import step
from llm.train.setup import _mixed_precision, build_model
from llm.train.step import tf32_matmuls


@pytest.mark.parametrize(("precision", "device_type", "dtype", "accelerate"), [
    ("auto", "cuda", torch.bfloat16, "bf16"),
    ("bf16", "cuda", torch.bfloat16, "bf16"),
    ("fp32", "cuda", None, "no"),
    ("auto", "cpu", None, "no"),
    ("bf16", "cpu", torch.bfloat16, "bf16"),
    ("fp32", "cpu", None, "no"),
    ("auto", "mps", None, "no"),
])
def test_autocast_dtype_and_the_trainers_mixed_precision(precision: str, device_type: str,
                                                         dtype: torch.dtype | None, accelerate: str) -> None:
    train = TrainConfig(precision=precision)
    assert train.autocast_dtype(device_type) == dtype
    assert _mixed_precision(RunConfig(train=train), device_type) == accelerate


@pytest.mark.parametrize(("device", "enabled", "inside"), [
    ("cuda", True, "high"), ("cuda", False, "highest"), ("cpu", True, "highest")])
def test_tf32_matmuls_only_on_cuda_and_restored_even_on_error(device: str, enabled: bool, inside: str) -> None:
    assert torch.get_float32_matmul_precision() == "highest"
    with pytest.raises(KeyError), tf32_matmuls(torch.device(device), enabled):
        assert torch.get_float32_matmul_precision() == inside
        raise KeyError("a failed step")
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize("tf32", [True, False])
def test_train_step_runs_forward_and_backward_at_train_tf32(monkeypatch: pytest.MonkeyPatch, tiny_overrides: list[str],
                                                            tf32: bool) -> None:
    """What ``train.tf32`` reaches: the precision the step's passes run at (CUDA's TF32 choice, the CPU's policy
    here), fp32's default after the step."""
    monkeypatch.setitem(POLICIES, "cpu", dataclasses.replace(PORTABLE, tf32=True))
    config = load_config(None, tiny_overrides)
    model = build_model(config.model)
    seen: list[str] = []
    model.register_forward_hook(lambda *_: seen.append(torch.get_float32_matmul_precision()))
    next(model.parameters()).register_hook(lambda _: seen.append(torch.get_float32_matmul_precision()))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = torch.randint(0, config.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    step.train_step(model, [batch], optimizer, accelerator, grad_clip=1.0, tf32=tf32)
    assert seen == ["high" if tf32 else "highest"] * 2
    assert torch.get_float32_matmul_precision() == "highest"
