"""AdamW (or Muon on the hidden matrices) parameter groups, the focus clipping hook and the warmup + cosine
learning-rate schedule.

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

``train.optimizer: muon`` (``MuonWithAdamW``) moves the hidden matrices (each module's ``MUP_SCALED`` that is no
mixing parameter: the attention's qkv_proj and o_proj, the FFN's in_proj and down_proj) from the ``decay`` group to
``muon`` (``muon_mup`` under muP), updated by torch's Muon: the Nesterov momentum orthogonalised by 5 Newton-Schulz
steps (about U V^T of its SVD), an update that rotates with the matrix's input and output spaces, where AdamW's
per-coordinate normalisation privileges the standard basis (isotropic-deep-learning.txt, appendix B.1). The rest
(the embedding and a tied or untied LM head, norms, biases, the mixing scalars and gates, the focus centres and
apertures) keeps AdamW and the groups above, as the references split them (Keller Jordan's Muon and modded-nanogpt,
Moonshot's "Muon is Scalable for LLM Training": embeddings, head and gains on AdamW).

Its lr is AdamW's, by Moonshot's rule (torch's ``adjust_lr_fn="match_rms_adamw"``, their eq. 4): the orthogonalised
update of an A x B matrix is scaled by ``0.2 sqrt(max(A, B))``, which gives it about the RMS of an AdamW update, so
``train.lr`` and ``train.weight_decay`` mean the same under both optimizers and one lr grid (``--tune train.lr``)
serves both. The weight decay is decoupled as AdamW's (``p -= lr * weight_decay * p`` before the update), on the
matrices only, as above. Under ``parametrization=mup`` the AdamW groups keep their muP scaling and the Muon groups
get ``lr / sqrt(width_multiplier)``: the RMS rule makes the update's spectral norm grow as ``sqrt(width)``, and the
spectral condition for feature learning (Yang, Simon and Bernstein 2023: a hidden matrix's update of spectral norm
Theta(sqrt(fan_out / fan_in)), i.e. width-independent) asks for it to stay put, so a base lr tuned at the base width
is meant to transfer across width for both optimizers (at the base width muP's groups are the standard ones). That
transfer follows from the rule; it is not yet measured here.
"""

from __future__ import annotations

import math
from contextlib import suppress

import torch
from torch import nn
from torch.optim._muon import muon  # torch's functional Muon (tests/train/test_muon.py fails if it changes)

from llm.config import RunConfig
from llm.model.config import ConfigError
from llm.model.modeling_isollm import mup_scaled_parameters

__all__ = ["MuonWithAdamW", "build_optimizer", "check_engine", "lr_multiplier", "multiplier_of", "muon_matrices",
           "param_groups", "schedule_warnings", "set_schedule"]

# ``ModelConfig`` multiplier field -> optimizer group name, in group order.
MULTIPLIER_GROUPS = {"mixing_lr_mult": "mixing", "focus_mu_lr_mult": "focus_mu", "focus_sigma_lr_mult": "focus_sigma"}
MUON_GROUPS = ("muon", "muon_mup")
MUON_ENGINES = ("single", "ddp")
"""The engines (llm/train/engine.py) that hand the optimizer each matrix whole, as Muon needs it."""


def multiplier_of(model: nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> its multiplier field, for every parameter a module lists in ``LR_MULTIPLIERS``."""
    fields: dict[int, str] = {}
    for module in model.modules():
        for name, field in getattr(module, "LR_MULTIPLIERS", {}).items():
            with suppress(AttributeError):  # an ablated parameter (iso_ln with a fixed alpha has no alpha_raw)
                fields[id(module.get_parameter(name))] = field
    return fields


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The matrices ``train.optimizer=muon`` moves to Muon: the hidden matrices (``mup_scaled_parameters``) that are
    no mixing parameter (isogmlp's gate stays on AdamW); ``param_groups`` puts exactly these in ``MUON_GROUPS``."""
    multipliers = multiplier_of(model)
    return [p for p in mup_scaled_parameters(model) if id(p) not in multipliers]


def param_groups(model: nn.Module, config: RunConfig) -> list[dict]:
    """AdamW groups (their lr and weight decay: ``group_settings``), in a fixed order so optimizer state lines up
    on resume.

    ``decay``: matrices (ndim >= 2) that are neither embeddings nor mixing parameters; ``mup_hidden``: under
    ``parametrization=mup``, the hidden matrices (``mup_scaled_parameters``); ``no_decay``: the other non-mixing
    parameters; then one group per multiplier (``MULTIPLIER_GROUPS``), each followed by its muP-scaled members
    (``<group>_mup``: isogmlp's width -> 1 gate). Under ``train.optimizer=muon`` the hidden matrices go to ``muon``
    (``muon_mup`` under muP) instead (module docstring). Empty groups are dropped, so a standard run's groups are
    what they were before muP and Muon; tied parameters appear once (``parameters`` deduplicates).
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    multipliers = multiplier_of(model)
    hidden, mup = {id(p) for p in mup_scaled_parameters(model)}, config.model.parametrization == "mup"
    muon = {id(p) for p in muon_matrices(model)} if config.train.optimizer == "muon" else set()
    scaled = hidden if mup else set()
    settings = group_settings(config)
    buckets: dict[str, list[nn.Parameter]] = {name: [] for name in settings}  # in the groups' order
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in multipliers:
            group = MULTIPLIER_GROUPS[multipliers[id(p)]]
            buckets[f"{group}_mup" if id(p) in scaled else group].append(p)
        elif id(p) in muon:
            buckets["muon_mup" if mup else "muon"].append(p)
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
    settings |= {"muon": (lr, decay), "muon_mup": (lr / math.sqrt(width), decay)}  # module docstring
    return settings


class MuonWithAdamW(torch.optim.Optimizer):
    """torch's Muon on the ``MUON_GROUPS`` and ``adamw`` on the other groups, as one optimizer: one ``param_groups``
    (AdamW's first, so the lr the metrics log is still the ``decay`` or ``no_decay`` group's), one ``state`` and
    torch's ``state_dict`` of both (the momentum buffers with AdamW's moments), so Accelerate, the schedule, the
    checkpoints and the step hooks handle it as they handle AdamW.

    A fused projection is orthogonalised per part (``fused_parts`` of its module): ``qkv_proj`` as q, k and v, an
    FFN's ``in_proj`` as each of its pathways (gate, up, iso). The parts are separate maps concatenated for speed;
    orthogonalising the concatenation would couple their singular values (a large gradient in q would shrink k's
    and v's update) and scale the RMS rule by the concatenation's height, so the update would depend on how the
    code fuses. The references orthogonalise merged weights per part too (modded-nanogpt views its merged qkvo
    weight as a batch of 4 matrices). The least code that does it: each step hands torch's own functional ``muon``
    the row blocks of the parameter, its gradient and its momentum buffer as separate matrices (views, updated in
    place), so each part is exactly what ``torch.optim.Muon`` does to a matrix of that shape, and the state keeps
    torch's layout (one buffer per parameter)."""

    def __init__(self, adamw: torch.optim.AdamW, muon_groups: list[dict], fused_parts: dict[int, list[int]]) -> None:
        # torch's Muon fills each group with its defaults (momentum 0.95, Nesterov, 5 quintic Newton-Schulz steps)
        # and refuses a parameter that is not 2-D
        muon_defaults = torch.optim.Muon(muon_groups, adjust_lr_fn="match_rms_adamw").defaults
        super().__init__([*adamw.param_groups, *muon_groups], {})
        self.adamw, self.fused_parts, self.muon_settings = adamw, fused_parts, tuple(muon_defaults)
        self.split_groups()
        # load_state_dict (a resume, Accelerate's prepare) replaces the group dicts and the state
        self.register_load_state_dict_post_hook(MuonWithAdamW.split_groups)

    def split_groups(self) -> None:
        """Hand AdamW its groups and the shared state, and keep the Muon groups, once per set of group dicts (the
        schedule's lr reaches both, as they are the same dicts), not at every step."""
        self.adamw.param_groups = [g for g in self.param_groups if g["name"] not in MUON_GROUPS]
        self.adamw.state = self.state
        self.muon_groups = [g for g in self.param_groups if g["name"] in MUON_GROUPS]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        self.adamw.step()
        for group in self.muon_groups:
            settings = {key: group[key] for key in self.muon_settings}
            for p in (p for p in group["params"] if p.grad is not None):
                rows = self.fused_parts.get(id(p), len(p))
                buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                muon(list(p.split(rows)), list(p.grad.split(rows)), list(buffer.split(rows)), has_complex=False,
                     **settings)


def fused_parts(model: nn.Module) -> dict[int, list[int]]:
    """``id(parameter)`` -> its row blocks, for every fused projection a module of ``model`` lists (``fused_parts``:
    the attention's qkv_proj, an FFN's in_proj)."""
    return {id(module.get_parameter(name)): rows for module in model.modules() if hasattr(module, "fused_parts")
            for name, rows in module.fused_parts().items()}


def check_engine(config: RunConfig, engine: str) -> None:
    """Refuse, before the first step, a muon run under an engine (llm/train/engine.py) that shards its matrices."""
    if config.train.optimizer == "muon" and engine not in MUON_ENGINES:
        raise ConfigError("train.optimizer", f"muon cannot train under {engine}: it orthogonalises each whole 2-D "
                                             f"matrix, and {engine} hands the optimizer shards of them (FSDP2 rows, "
                                             f"ZeRO and FSDP1 flat 1-D partitions); train it on DDP or one process, "
                                             f"or use train.optimizer=adamw")


def build_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    """AdamW over ``param_groups`` (clipping the focus parameters after each step), fused: one kernel for
    all parameters, on CPU as on CUDA (4x faster than the default multi-tensor path on these CPUs;
    bench/bench_train_step.py); under ``train.optimizer=muon`` with Muon on the ``MUON_GROUPS``
    (``MuonWithAdamW``). Under DeepSpeed, which updates its own fp32 copies of the weights and overwrites
    the model's, the hook's clip is lost; llm/train/deepspeed_step.py clips both after the engine's step."""
    t = config.train
    groups = param_groups(model, config)
    optimizer = torch.optim.AdamW([g for g in groups if g["name"] not in MUON_GROUPS], lr=t.lr,
                                  betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
    if t.optimizer == "muon":
        optimizer = MuonWithAdamW(optimizer, [g for g in groups if g["name"] in MUON_GROUPS], fused_parts(model))
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
