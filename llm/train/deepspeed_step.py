"""DeepSpeed's backward and optimizer step, with what the trainer does around torch's optimizer step.

``accelerator.prepare`` returns the ``DeepSpeedEngine`` as the model, and ZeRO takes its optimizer step inside
the engine (Accelerate's ``backward`` calls ``engine.step`` at the accumulation boundary). Two things the
other engines get from torch's optimizer would be lost there, so a comparison run on ZeRO would silently
differ from the same run on DDP or FSDP2:

- the per-group gradient norms: ZeRO reduces the gradients into its own partitions, so ``p.grad`` is empty;
  they are read between the boundary's backward and its step through ``deepspeed.utils.safe_get_full_grad``
  (one all-reduce per parameter tensor: about one more gradient all-reduce per step);
- the focusing neuron's clipping (Algorithm 3): ZeRO updates its own fp32 copies of the weights and then
  overwrites the model's from them, so the clip is applied to both after the step, through
  ``safe_get_full_fp32_param`` / ``safe_set_full_fp32_param`` and ``deepspeed.zero.GatheredParameters``
  (ZeRO-3 holds each rank's partition only).

tests/launch/test_distributed.py runs a focus model under ZeRO-2 and ZeRO-3 against one process.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import nn

from llm.metrics.gradnorm import GroupGradNorms
from llm.train.optim import clipped_modules

# ``clipped_modules`` of each engine's model, found at its first step (not a walk over every module per step).
_CLIPPED: weakref.WeakKeyDictionary[nn.Module, list[nn.Module]] = weakref.WeakKeyDictionary()


def deepspeed_engine(model: nn.Module) -> nn.Module | None:
    """``model`` when it is a DeepSpeed engine (what ``accelerator.prepare`` returns under DeepSpeed), else None.
    DeepSpeed is imported only when it is already loaded: no other engine pays for its import."""
    if "deepspeed" not in sys.modules:
        return None
    from deepspeed import DeepSpeedEngine

    return model if isinstance(model, DeepSpeedEngine) else None


def clip_focus_(model: nn.Module) -> None:
    """Clip the focusing neuron's mu and sigma (each module's ``CLIP_RANGES``) in the engine's fp32 copy, then in
    the model's own weight through the module's ``clip_parameters_``, after the engine's step. A collective: call
    on every rank."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    if model not in _CLIPPED:
        _CLIPPED[model] = clipped_modules(model)
    modules = _CLIPPED[model]
    if not modules:
        return
    params = [(getattr(module, name), bounds) for module in modules for name, bounds in module.CLIP_RANGES.items()]
    with torch.no_grad():
        for param, bounds in params:
            safe_set_full_fp32_param(param, safe_get_full_fp32_param(param).clamp(*bounds))
    # ZeRO-1/2: every rank holds the whole weight and clips it; ZeRO-3: gathered, clipped, re-partitioned
    with deepspeed.zero.GatheredParameters([param for param, _ in params], modifier_rank=0):
        for module in modules:
            module.clip_parameters_()


def deepspeed_backward(engine: nn.Module, loss: torch.Tensor, boundary: bool,
                       grad_groups: GroupGradNorms | None) -> torch.Tensor | None:
    """One micro-batch's backward through ``engine``, as Accelerate's ``DeepSpeedEngineWrapper.backward`` does it
    (the accumulation boundary set from ``boundary``, the engine's step taken on it), with the per-group gradient
    norms measured before that step (returned on the boundary: ``grad_groups.norms()``, else None) and the focus
    parameters clipped after it."""
    from deepspeed.utils import safe_get_full_grad

    engine.set_gradient_accumulation_boundary(is_boundary=boundary)
    engine.backward(loss)
    if not boundary:
        return None
    norms = grad_groups.norms(grad_of=safe_get_full_grad) if grad_groups is not None else None
    engine.step()
    clip_focus_(engine.module)
    return norms
