"""One precision rule, ``TrainConfig.autocast_dtype``: the trainer's Accelerate setting and MFU peak and
evaluation's autocast all follow it; an explicit bf16 without a GPU stops training before any work."""

from __future__ import annotations

import pytest
import torch

from llm.config import RunConfig, TrainConfig
from llm.model.config import ConfigError
from llm.train.trainer import _mixed_precision, fit


@pytest.mark.parametrize(("precision", "device_type", "dtype", "accelerate"), [
    ("auto", "cuda", torch.bfloat16, "bf16"),
    ("bf16", "cuda", torch.bfloat16, "bf16"),
    ("fp32", "cuda", None, "no"),
    ("auto", "cpu", None, "no"),
    ("fp32", "cpu", None, "no"),
    ("auto", "mps", None, "no"),
])
def test_autocast_dtype_and_the_trainers_mixed_precision(precision: str, device_type: str,
                                                         dtype: torch.dtype | None, accelerate: str) -> None:
    train = TrainConfig(precision=precision)
    assert train.autocast_dtype(device_type) == dtype
    assert _mixed_precision(RunConfig(train=train), device_type) == accelerate


def test_bf16_without_gpu_stops_training_but_evaluates_in_fp32() -> None:
    config = RunConfig(train=TrainConfig(precision="bf16"))
    with pytest.raises(ConfigError, match=r"^train\.precision: bf16 needs a GPU; use auto or fp32 on CPU$"):
        _mixed_precision(config, "cpu")
    assert config.train.autocast_dtype("cpu") is None  # eval.py of a bf16 run on a CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without a GPU")
def test_fit_with_bf16_on_cpu_is_a_config_error(tiny_config) -> None:
    config = tiny_config("train.precision=bf16")
    with pytest.raises(ConfigError, match=r"^train\.precision: bf16 needs a GPU"):
        fit(config)
    assert not config.run_dir.exists()
