"""Gradient-norm statistics: the "training stability" column of isogmlp Table 1.

The paper measures stability as the variance of the gradient norm. We log, every step, the
global pre-clip norm together with its variance and coefficient of variation (CV = std / mean,
scale free, so variants whose norms differ in size compare fairly) over

- a rolling window of the last ``window`` finite norms (what is happening now), and
- the whole run after warmup (the number a comparison table reports; warmup steps are excluded
  because the norm's transient while the learning rate ramps up says little about stability).

Conventions, chosen once for every run:

- Variances are *population* variances (divide by n, ``ddof=0``): they describe the norms this
  run produced, not an estimate for a wider population, and are defined from the first sample
  on (0 for one sample). At the default window of 100 steps the sample variance (n - 1) would
  be 1% larger.
- Statistics that are not defined yet (run statistics during warmup, a CV whose mean is 0) are
  ``nan``; Python's ``json`` writes and reads it as ``NaN``.
- Non-finite norms belong to skipped updates: they are counted, never added.
- Run statistics use Welford's update in float64 (exact to rounding over millions of steps); the
  rolling window is recomputed from its values with a two-pass sum each step, so it never drifts.

So that a spike can be attributed, ``GroupGradNorms`` tracks the same statistics for the pre-clip
norm of each parameter group (``GRAD_NORM_GROUPS``: embedding, attention, FFN matrices, FFN mixing
parameters, norms), logged as ``grad_norm_<group>``, ``grad_norm_<group>_var_rolling``, ... The
group norms are the global norm split up: their squares sum to its square.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

# Parameter groups with their own gradient-norm statistics (``grad_norm_groups``).
GRAD_NORM_GROUPS = ("embedding", "attention", "ffn", "ffn_mixing", "norm")


def _variance_and_cv(mean: float, squared_deviations: float, n: int) -> tuple[float, float]:
    """Population variance and CV of ``n`` values of this mean and sum of squared deviations; NaN for none."""
    if n == 0:
        return math.nan, math.nan
    variance = max(squared_deviations / n, 0.0)  # rounding can leave -1e-18 for a constant series
    return variance, math.sqrt(variance) / mean if mean != 0 else math.nan


class GradNormTracker:
    """Rolling (the last ``window`` finite norms) and run-level (the steps after ``warmup_steps``) variance / CV of
    the global gradient norm, in fields named from ``prefix`` (``grad_norm``, ``grad_norm_var_rolling``, ...)."""

    def __init__(self, window: int, warmup_steps: int, prefix: str = "grad_norm") -> None:
        if window <= 0:
            raise ValueError(f"window: expected a positive integer, got {window}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected >= 0, got {warmup_steps}")
        self.window = window
        self.warmup_steps = warmup_steps
        self.prefix = prefix
        self._recent: deque[float] = deque(maxlen=window)
        self._count = 0  # Welford state of the post-warmup norms
        self._mean = 0.0
        self._m2 = 0.0
        # Number of non-finite norms seen (skipped updates).
        self.nonfinite = 0

    def update(self, step: int, norm: float) -> dict[str, float]:
        """Record the norm of optimizer step ``step`` (1-based: steps done including this one); return the
        metrics row fields: the norm under ``prefix``, then ``stats()``."""
        norm = float(norm)
        if not math.isfinite(norm):
            self.nonfinite += 1
        else:
            self._recent.append(norm)
            if step > self.warmup_steps:
                self._count += 1
                delta = norm - self._mean
                self._mean += delta / self._count
                self._m2 += delta * (norm - self._mean)
        return {self.prefix: norm, **self.stats()}

    def stats(self) -> dict[str, float]:
        """The current statistics without recording a new norm (``_nonfinite``: the count of skipped, non-finite
        norms so far)."""
        n = len(self._recent)
        mean = math.fsum(self._recent) / n if n else 0.0
        var_rolling, cv_rolling = _variance_and_cv(mean, math.fsum((x - mean) ** 2 for x in self._recent), n)
        var_run, cv_run = _variance_and_cv(self._mean, self._m2, self._count)
        p = self.prefix
        return {f"{p}_var_rolling": var_rolling, f"{p}_cv_rolling": cv_rolling, f"{p}_var_run": var_run,
                f"{p}_cv_run": cv_run, f"{p}_nonfinite": float(self.nonfinite)}

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; floats round-trip exactly through ``json`` (shortest repr)."""
        return {"window": self.window, "warmup_steps": self.warmup_steps, "recent": list(self._recent),
                "count": self._count, "mean": self._mean, "m2": self._m2, "nonfinite": self.nonfinite}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the statistics of a saved tracker exactly.

        A resumed run keeps its configured ``window``: when it differs from the saved one, the newest ``window``
        saved norms seed the rolling statistics. A resumed run may change the schedule, ``warmup_steps`` included
        (llm/train/optim.py); the saved run statistics then hold another set of steps than this warmup defines,
        so they restart empty, counting the norms after this warmup from the resumed step on (the trainer says so).
        """
        self._recent = deque((float(x) for x in state["recent"]), maxlen=self.window)
        self.nonfinite = int(state["nonfinite"])
        if state["warmup_steps"] == self.warmup_steps:
            self._count = int(state["count"])
            self._mean = float(state["mean"])
            self._m2 = float(state["m2"])


def grad_norm_groups(model: nn.Module, mixing_ids: Iterable[int]) -> dict[str, list[nn.Parameter]]:
    """The trainable parameters of a decoder by ``GRAD_NORM_GROUPS``, empty groups left out: ``ffn_mixing`` those of
    the optimizer's multiplier groups (``mixing_ids``: ``llm.train.optim.multiplier_of``), ``norm`` those of every
    ``*Norm`` module (RMSNorm, QK-norm, iso_ln's LayerNorm), ``embedding`` the embeddings and an untied LM head, then
    the rest of each ``mlp`` (``ffn``) and of ``self_attn`` (``attention``)."""
    mixing_ids = set(mixing_ids)
    norm_ids = {id(p) for m in model.modules() if type(m).__name__.endswith("Norm") for p in m.parameters()}
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    groups: dict[str, list[nn.Parameter]] = {name: [] for name in GRAD_NORM_GROUPS}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in mixing_ids:
            group = "ffn_mixing"
        elif id(p) in norm_ids:
            group = "norm"
        elif id(p) in embedding_ids or name.startswith("lm_head."):
            group = "embedding"
        elif ".mlp." in name:
            group = "ffn"
        elif ".self_attn." in name:
            group = "attention"
        else:
            raise ValueError(f"{name}: belongs to none of the gradient-norm groups {GRAD_NORM_GROUPS}")
        groups[group].append(p)
    return {name: params for name, params in groups.items() if params}


class GroupGradNorms:
    """``GradNormTracker`` statistics of the pre-clip gradient norm of each parameter group: ``norms()`` measures
    them after the backward passes, before clipping, ``record`` takes their host copy and ``update(step)`` records
    it as step ``step``."""

    def __init__(self, groups: dict[str, list[nn.Parameter]], window: int, warmup_steps: int) -> None:
        self.groups = groups
        self.trackers = {name: GradNormTracker(window, warmup_steps, prefix=f"grad_norm_{name}") for name in groups}
        self._measured: dict[str, float] = {}

    def norms(self, grad_of: Callable[[nn.Parameter], torch.Tensor | None] = lambda p: p.grad) -> torch.Tensor | None:
        """Each group's pre-clip norm, in ``groups`` order, as one fp32 tensor on the gradients' device (NaN for a
        group none of whose parameters holds a gradient; None when no group has one), without a synchronisation:
        the trainer copies it to the host together with the loss and the global norm, then calls ``record``.
        ``grad_of(p)``: the full gradient of ``p`` (DeepSpeed's ``safe_get_full_grad`` under ZeRO, which keeps the
        reduced gradients inside its optimizer)."""
        norms: dict[str, torch.Tensor] = {}
        for name, params in self.groups.items():
            if grads := [g for g in map(grad_of, params) if g is not None]:
                norm = torch.nn.utils.get_total_norm(grads)
                # a DTensor under FSDP2: the norm over all shards
                norms[name] = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float()
        if not norms:
            return None
        missing = next(iter(norms.values())).new_tensor(math.nan)
        return torch.stack([norms.get(name, missing) for name in self.groups])

    def record(self, values: Sequence[float] | None) -> None:
        """The host values of ``norms()`` (None: no group held a gradient), for the next ``update``."""
        self._measured = dict(zip(self.groups, values, strict=True)) if values is not None else {}

    def update(self, step: int) -> dict[str, float]:
        row: dict[str, float] = {}
        for name, tracker in self.trackers.items():
            row.update(tracker.update(step, self._measured.get(name, math.nan)))
        return row

    def state_dict(self) -> dict[str, Any]:
        return {name: tracker.state_dict() for name, tracker in self.trackers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the statistics of the groups the saved state has (a group new to this run starts fresh)."""
        for name, tracker in self.trackers.items():
            if name in state:
                tracker.load_state_dict(state[name])
