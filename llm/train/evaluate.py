"""Validation loss: the one function both the trainer and eval.py use, so logged numbers reproduce."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llm.data.packing import model_inputs

__all__ = ["evaluate", "lm_loss"]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy computed in fp32 whatever dtype the logits come in (bf16 autocast
    logits would otherwise round the log-softmax). ``logits [B, T, V]``, ``targets [B, T]``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(model: nn.Module, val_windows: torch.Tensor, micro_batch_size: int,
             document_eos: int | None = None) -> dict[str, float]:
    """Mean next-token loss over every token of the validation windows ``[N, seq_len + 1]``
    (``llm.data.build_val_windows``), and its perplexity; ``document_eos``: the EOS id when documents are masked.

    Per-token losses are summed in fp64, so the result is deterministic however N splits into micro-batches; a logged
    ``val_loss`` reproduces bit for bit with the same model (same precision / autocast), windows and the run's
    ``train.micro_batch_size`` (the micro-batch shape changes the kernels' summation order). Every rank evaluates all
    windows, so sharded models (FSDP/DeepSpeed) run their collectives in step and every rank returns the same numbers.
    """
    if val_windows.ndim != 2 or val_windows.shape[1] < 2:
        raise ValueError(f"val_windows: expected [N, seq_len + 1], got shape {tuple(val_windows.shape)}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    try:
        for start in range(0, val_windows.shape[0], micro_batch_size):
            batch = val_windows[start : start + micro_batch_size].to(device)
            logits = model(**model_inputs(batch[:, :-1], document_eos)).logits
            total += lm_loss(logits, batch[:, 1:], reduction="none").double().sum()
    finally:
        model.train(was_training)
    tokens = val_windows.shape[0] * (val_windows.shape[1] - 1)
    val_loss = total.item() / tokens
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)), "val_tokens": tokens}
