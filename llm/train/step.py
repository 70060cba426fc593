"""One optimizer step (``train_step``): micro-batches accumulated through Accelerate, the loss and the stop and
write-failure flags agreed over ranks in one all-reduce, the gradient norms clipped and measured, a non-finite step
skipped, the parameters checked after an applied update. The loop that calls it is llm/train/trainer.py.

Works with any model ``accelerator.prepare`` returned (DDP, FSDP2, DeepSpeed): the loop calls only
``accelerator.accumulate / backward / clip_grad_norm_`` and the prepared optimizer, with one
exception: DeepSpeed takes its optimizer step inside the backward pass, so its backward goes through
llm/train/deepspeed_step.py (group norms measured before that step, focus clipping after it), and a non-finite
step is handled by DeepSpeed itself rather than skipped here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from llm.config import RunConfig
from llm.data.packing import model_inputs
from llm.metrics.gradnorm import GroupGradNorms
from llm.model.acceleration import acceleration
from llm.model.config import ConfigError
from llm.model.lm_head import IGNORE_INDEX
from llm.train.deepspeed_step import deepspeed_backward, deepspeed_engine
from llm.train.distributed import all_ranks_agree, is_distributed

__all__ = ["StepResult", "TrainingError", "gradient_accumulation_steps", "tf32_matmuls", "train_step"]


class TrainingError(RuntimeError):
    """The run stopped on its own account (too many consecutive non-finite steps, non-finite parameters,
    a run-directory file, its lock included, that it could not write)."""


@contextlib.contextmanager
def tf32_matmuls(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """fp32 matmuls on ``device`` run on TF32 tensor cores inside the block (``train.tf32``), the precision before
    it restored after it; a no-op where the device's policy says no TF32 (``Acceleration.tf32``: off CUDA, where
    "high" may pick other reduced-precision paths).

    Under bf16 autocast the step's only fp32 matmuls are those that leave autocast to accumulate in fp32,
    iso_tanh's chunked running sums (llm/model/iso_tanh.py). TF32 keeps 10 mantissa bits of each operand and fp32's
    8-bit exponent, so an operand born in bf16 (7 mantissa bits, the same exponent) passes unrounded; only an
    operand that is itself a running sum is rounded, to 10 bits, 8x finer than bf16, and the products still
    accumulate in fp32. On an H100 that made the swiglu+iso_tanh step 1.13x faster (docs/performance.md).
    """
    before = torch.get_float32_matmul_precision()
    if enabled and acceleration(device).tf32:
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@dataclass
class StepResult:
    loss: float
    """Mean token loss of the step over all micro-batches and ranks (fp32)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    skipped: bool
    """True when loss or norm was not finite and the update was not applied."""
    stop: bool
    """True on every rank when ``stop_requested()`` returned True on any rank."""
    params_finite: bool = True
    """False on every rank when the applied update left a non-finite parameter on any rank."""
    write_failed: bool = False
    """True on every rank when any rank passed ``write_failed`` (it could not write a run-directory file)."""
    no_target_batches: int = 0
    """Micro-batches, over all ranks, whose targets were all ``IGNORE_INDEX``: their loss is NaN (a mean over no
    target, as ``F.cross_entropy`` gives), their gradient zero; ``loss`` is the mean over the other micro-batches."""


def gradient_accumulation_steps(config: RunConfig, world_size: int) -> int:
    """``global_batch_tokens / (micro_batch_size * seq_len * world_size)``; must be a whole number >= 1."""
    per_pass = config.train.micro_batch_size * config.data.seq_len * world_size
    accum, remainder = divmod(config.train.global_batch_tokens, per_pass)
    if accum < 1 or remainder:
        raise ConfigError("train.global_batch_tokens", (
            f"{config.train.global_batch_tokens} is not a positive multiple of micro_batch_size * seq_len * processes "
            f"= {config.train.micro_batch_size} * {config.data.seq_len} * {world_size} = {per_pass}"))
    return accum


def _all_reduce_step_scalars(loss: torch.Tensor, *flags: bool | torch.Tensor) -> torch.Tensor:
    """``[loss averaged over ranks, each flag's count over ranks]`` in one all-reduce, left on the device: the flags
    ride on the collective the loss needs anyway (a count > 0 means some rank set the flag), and the host copy is
    made once per step with the gradient norms (``train_step``)."""
    packed = torch.stack([loss, *(torch.as_tensor(flag, dtype=loss.dtype, device=loss.device) for flag in flags)])
    if is_distributed():
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        packed[0] /= dist.get_world_size()
    return packed


def _parameters_finite(model: nn.Module) -> bool:
    """Whether every parameter is finite: their largest ``|x|`` (``get_total_norm`` with ord=inf, one reduction per
    tensor: no overflow, NaN propagates) and one sync, a fraction of the optimizer's own passes over the parameters.
    Replicated parameters (one process, DDP) give every rank the same answer with no collective; FSDP2's
    shards (DTensors) are checked locally and agreed over ranks."""
    params = list(model.parameters())
    sharded = any(hasattr(p, "to_local") for p in params)
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in params]
    local = [t for t in local if t.numel()]  # DeepSpeed ZeRO-3 leaves empty placeholders
    finite = not local or bool(torch.isfinite(torch.nn.utils.get_total_norm(local, math.inf)))
    return all_ranks_agree(finite, any_rank=False) if sharded else finite


def train_step(model: nn.Module, batches: list[torch.Tensor], optimizer: torch.optim.Optimizer,
               accelerator: Accelerator, grad_clip: float, stop_requested: Callable[[], bool] | None = None,
               grad_groups: GroupGradNorms | None = None, write_failed: bool = False,
               document_eos: int | None = None, tf32: bool = True) -> StepResult:
    """One optimizer step over ``len(batches)`` micro-batches (``accelerator.gradient_accumulation_steps``
    of them), each ``LongTensor[B, seq_len + 1]`` on the model's device.

    ``accumulate`` skips the gradient all-reduce on all but the last micro-batch and ``backward`` divides each
    micro-batch loss by their number, so the gradient is that of the mean loss over the global batch (all
    micro-batches hold the same number of tokens). The model computes the loss itself (in training mode fused with
    the LM head, softmax in fp32, no ``[B, T, V]`` logits). The skip decision uses the rank-averaged loss and the
    all-reduced norm, so every rank takes the same branch. ``stop_requested()`` (polled once, after the backward
    passes) and ``write_failed`` (this rank could not write a run-directory file) reach the host with the loss and
    every norm in one copy (``_all_reduce_step_scalars``); the parameter check after an applied update is the step's
    second and last. ``grad_clip = 0``: no clipping. ``document_eos``: the EOS id when documents are masked.
    ``tf32``: the forward and backward passes run their fp32 matmuls on TF32 tensor cores (``tf32_matmuls``).
    """
    model.train()
    loss_sum, target_batches = torch.zeros((), device=accelerator.device), torch.zeros((), device=accelerator.device)
    engine, group_norms = deepspeed_engine(model), None
    for batch in batches:
        with accelerator.accumulate(model), tf32_matmuls(accelerator.device, tf32):
            inputs = model_inputs(batch[:, :-1], document_eos)  # the loss fused with the head: no [B, T, V] logits
            loss = model(**inputs, shift_labels=batch[:, 1:], fused_loss=True).loss
            if engine is None:
                accelerator.backward(loss)
            else:  # the engine steps on the boundary; the group norms are read before, focus clipped after
                group_norms = deepspeed_backward(engine, loss, accelerator.sync_gradients, grad_groups)
            has_targets = (batch[:, 1:] != IGNORE_INDEX).any()
            loss_sum += torch.where(has_targets, loss.detach(), 0)
            target_batches += has_targets
    this_rank_stops = stop_requested is not None and stop_requested()
    scalars = _all_reduce_step_scalars(loss_sum / target_batches, this_rank_stops, write_failed,
                                       len(batches) - target_batches)
    if engine is None and grad_groups is not None:
        group_norms = grad_groups.norms()
    norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    on_device = [scalars, torch.as_tensor(norm, dtype=torch.float32, device=scalars.device).reshape(1)]
    if group_norms is not None:
        on_device.append(group_norms.to(scalars.device))
    mean_loss, stops, write_fails, no_targets, grad_norm, *groups = torch.cat(on_device).tolist()
    stop, any_write_failed = stops > 0, write_fails > 0
    if grad_groups is not None:
        grad_groups.record(groups if group_norms is not None else None)
    skipped = not (math.isfinite(mean_loss) and math.isfinite(grad_norm))
    params_finite = True
    if not skipped:
        optimizer.step()
        params_finite = _parameters_finite(model)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=mean_loss, grad_norm=grad_norm, skipped=skipped, stop=stop, params_finite=params_finite,
                      write_failed=any_write_failed, no_target_batches=int(no_targets))
