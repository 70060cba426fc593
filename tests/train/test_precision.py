"""One precision rule, ``TrainConfig.autocast_dtype``: the trainer's Accelerate setting and MFU peak and
evaluation's autocast all follow it. (A bf16 run on CPU is trained end to end in test_fit.py.)"""

from __future__ import annotations

import pytest
import torch

from llm.config import RunConfig, TrainConfig
from llm.train.setup import _mixed_precision


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
