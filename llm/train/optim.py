"""AdamW parameter groups, the focus clipping hook and the warmup + cosine learning-rate schedule.

The schedule is a function, not an object (as OLMo-core computes it): before every optimizer step ``set_schedule``
gives each group the lr and weight decay that the config in force assigns to the number of updates applied so
far. Nothing of it is saved in a checkpoint, so a run resumed with another ``train.lr``, ``max_steps`` or
``warmup_steps`` trains on the new schedule from its first step, by construction.

Weight decay (decoupled, AdamW) is applied to projection matrices only. Norm gains, biases and the
embeddings (hence also a tied LM head) are not decayed: decaying them pulls gains towards 0 and
rare-token embeddings towards the origin, which is a regulariser none of the papers intend.

Mixing parameters get their own groups, without weight decay, at ``lr`` times a multiplier from the
model config: every module lists them in ``LR_MULTIPLIERS`` (parameter name -> multiplier field):

- ``mixing`` (``mixing_lr_mult``, default 5): iso_ln's alpha/beta scalars, IsoGMLP's gamma/beta and alpha
  gate. Adam moves a parameter by about lr per step whatever its gradient, so on the 83m schedule
  (configs/experiments/fineweb-83m.yaml: 400 warmup + 3,600 cosine steps to 0.1x of 3e-4) a parameter
  travels at most ``3e-4 * (400/2 + 3600 * 0.55) = 0.654``: iso_ln's ``alpha = 0.5 + 1.5 sigmoid(a)``
  stops at 1.49 (a <= 0.654), below the paper's learned 1.81 +- 0.03 (a = 1.93, i.e. 2.95x), and
  ``beta = 0.1 tanh(b)`` at |beta| <= 0.057. 5x (a <= 3.27, alpha <= 1.94) lets both reach their whole
  range on that schedule; the weight matrices stay at 1x.
- ``focus_mu`` / ``focus_sigma`` (``focus_mu_lr_mult``, ``focus_sigma_lr_mult``): the focusing neuron's
  centres and apertures (the paper trains them at 0.1x and 0.1-0.005x the global rate, e.g.
  eta_g = 0.1, eta_mu = eta_sigma = 0.01 on MNIST).
"""

from __future__ import annotations

import math
from contextlib import suppress

import torch
from torch import nn

from llm.config import RunConfig
from llm.model.modeling_isollm import mup_scaled_parameters

__all__ = ["build_optimizer", "lr_multiplier", "multiplier_of", "param_groups", "schedule_warnings", "set_schedule"]

# ``ModelConfig`` multiplier field -> optimizer group name, in group order.
MULTIPLIER_GROUPS = {"mixing_lr_mult": "mixing", "focus_mu_lr_mult": "focus_mu", "focus_sigma_lr_mult": "focus_sigma"}


def multiplier_of(model: nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> its multiplier field, for every parameter a module lists in ``LR_MULTIPLIERS``."""
    fields: dict[int, str] = {}
    for module in model.modules():
        for name, field in getattr(module, "LR_MULTIPLIERS", {}).items():
            with suppress(AttributeError):  # an ablated parameter (iso_ln with a fixed alpha has no alpha_raw)
                fields[id(module.get_parameter(name))] = field
    return fields


def param_groups(model: nn.Module, config: RunConfig) -> list[dict]:
    """AdamW groups (their lr and weight decay: ``group_settings``), in a fixed order so optimizer state lines up
    on resume.

    ``decay``: matrices (ndim >= 2) that are neither embeddings nor mixing parameters; ``mup_hidden``: under
    ``parametrization=mup``, the hidden matrices (``mup_scaled_parameters``); ``no_decay``: the other non-mixing
    parameters; then one group per multiplier (``MULTIPLIER_GROUPS``), each followed by its muP-scaled members
    (``<group>_mup``: isogmlp's width -> 1 gate). Empty groups are dropped, so a standard run's groups are what they
    were before muP; tied parameters appear once (``parameters`` deduplicates).
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    multipliers = multiplier_of(model)
    scaled = {id(p) for p in mup_scaled_parameters(model)} if config.model.parametrization == "mup" else set()
    settings = group_settings(config)
    buckets: dict[str, list[nn.Parameter]] = {name: [] for name in settings}  # in the groups' order
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in multipliers:
            group = MULTIPLIER_GROUPS[multipliers[id(p)]]
            buckets[f"{group}_mup" if id(p) in scaled else group].append(p)
        elif id(p) in scaled:
            buckets["mup_hidden"].append(p)
        elif p.ndim >= 2 and id(p) not in embeddings:
            buckets["decay"].append(p)
        else:
            buckets["no_decay"].append(p)
    return [{"name": name, "params": params, "lr": settings[name][0], "weight_decay": settings[name][1]}
            for name, params in buckets.items() if params]


def group_settings(config: RunConfig) -> dict[str, tuple[float, float]]:
    """Group name -> its peak lr and weight decay under ``config``, in the order of ``param_groups``."""
    lr, decay, width = config.train.lr, config.train.weight_decay, config.model.width_multiplier
    settings = {"decay": (lr, decay), "mup_hidden": (lr / width, decay), "no_decay": (lr, 0.0)}
    for field, group in MULTIPLIER_GROUPS.items():
        group_lr = lr * getattr(config.model, field)
        settings[group] = (group_lr, 0.0)
        settings[f"{group}_mup"] = (group_lr / width, 0.0)
    return settings


def build_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups`` (clipping the focus parameters after each step), fused: one kernel for
    all parameters, on CPU as on CUDA (4x faster than the default multi-tensor path on these CPUs;
    bench/bench_train_step.py). Under DeepSpeed, which updates its own fp32 copies of the weights and overwrites
    the model's, the hook's clip is lost; llm/train/deepspeed_step.py clips both after the engine's step."""
    t = config.train
    optimizer = torch.optim.AdamW(param_groups(model, config), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                  fused=True)
    clipped = clipped_modules(model)  # found once, not a walk over every module at every step

    def clip_after_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        # the method is looked up at call time, so modules that DDP wraps or FSDP2 shards in place work
        for module in clipped:
            module.clip_parameters_()

    if clipped:
        optimizer.register_step_post_hook(clip_after_step)
    return optimizer


def clipped_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose parameters are clipped after every update (``clip_parameters_``: the
    focusing neuron's Algorithm 3), found once per run by ``build_optimizer`` and llm/train/deepspeed_step.py."""
    return [module for module in model.modules() if hasattr(module, "clip_parameters_")]


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer update ``step`` (0-based).

    Linear warmup reaching 1 at step ``warmup_steps - 1`` (so step 0 already trains, at
    lr/warmup), then half a cosine from 1 at ``warmup_steps`` down to ``min_lr_ratio`` at
    ``max_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_schedule(optimizer: torch.optim.Optimizer, config: RunConfig, max_steps: int, step: int) -> float:
    """Give every group of ``optimizer`` (``param_groups``) its peak lr and weight decay under ``config``
    (``group_settings``), the lr times ``lr_multiplier`` of update ``step`` in a run of ``max_steps``; return the
    first group's lr (the one the metrics log). A warmup longer than the run is clamped to it, reaching train.lr
    at the last step (``schedule_warnings`` says so)."""
    t = config.train
    multiplier = lr_multiplier(step, min(t.warmup_steps, max_steps), max_steps, t.min_lr_ratio)
    settings = group_settings(config)
    for group in optimizer.param_groups:
        peak, group["weight_decay"] = settings[group["name"]]
        group["lr"] = peak * multiplier
    return optimizer.param_groups[0]["lr"]


def schedule_warnings(config: RunConfig, max_steps: int) -> list[str]:
    """One line for each schedule setting that cannot happen as written in a run of ``max_steps`` steps."""
    t, lines = config.train, []
    if t.warmup_steps > max_steps:
        lines.append(f"train.warmup_steps={t.warmup_steps} is longer than the run ({max_steps} steps): warming up "
                     f"over all {max_steps} instead, so the lr reaches train.lr at the last step, with no decay")
    if t.eval_every > max_steps:
        lines.append(f"train.eval_every={t.eval_every} is longer than the run ({max_steps} steps): the validation "
                     f"loss is computed at the last step only")
    return lines
