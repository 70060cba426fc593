"""Gradient-norm statistics: the "training stability" column of seeds/isogmlp.txt Table 1.

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
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any


def _variance_and_cv(mean: float, variance: float) -> tuple[float, float]:
    variance = max(variance, 0.0)  # rounding can leave -1e-18 for a constant series
    cv = math.sqrt(variance) / mean if mean != 0 else math.nan
    return variance, cv


class GradNormTracker:
    """Rolling and run-level variance / CV of the global gradient norm.

    Args:
        window: number of most recent finite norms in the rolling statistics.
        warmup_steps: norms of steps ``1 .. warmup_steps`` are left out of the run statistics.
    """

    def __init__(self, window: int, warmup_steps: int) -> None:
        if window <= 0:
            raise ValueError(f"window: expected a positive integer, got {window}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected >= 0, got {warmup_steps}")
        self.window = window
        self.warmup_steps = warmup_steps
        self._recent: deque[float] = deque(maxlen=window)
        self._count = 0  # Welford state of the post-warmup norms
        self._mean = 0.0
        self._m2 = 0.0
        self.nonfinite = 0
        """Number of non-finite norms seen (skipped updates)."""

    def update(self, step: int, norm: float) -> dict[str, float]:
        """Record the norm of optimizer step ``step`` (1-based: steps done including this one).

        Returns the metrics row fields ``grad_norm``, ``grad_norm_var_rolling``,
        ``grad_norm_cv_rolling``, ``grad_norm_var_run``, ``grad_norm_cv_run`` and
        ``grad_norm_nonfinite`` (the count of skipped, non-finite norms so far).
        """
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
        return {"grad_norm": norm, **self.stats()}

    def stats(self) -> dict[str, float]:
        """The current statistics without recording a new norm."""
        if self._recent:
            n = len(self._recent)
            mean = math.fsum(self._recent) / n
            var_rolling, cv_rolling = _variance_and_cv(
                mean, math.fsum((x - mean) ** 2 for x in self._recent) / n)
        else:
            var_rolling = cv_rolling = math.nan
        if self._count:
            var_run, cv_run = _variance_and_cv(self._mean, self._m2 / self._count)
        else:
            var_run = cv_run = math.nan
        return {
            "grad_norm_var_rolling": var_rolling,
            "grad_norm_cv_rolling": cv_rolling,
            "grad_norm_var_run": var_run,
            "grad_norm_cv_run": cv_run,
            "grad_norm_nonfinite": float(self.nonfinite),
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; floats round-trip exactly through ``json`` (shortest repr)."""
        return {
            "window": self.window,
            "warmup_steps": self.warmup_steps,
            "recent": list(self._recent),
            "count": self._count,
            "mean": self._mean,
            "m2": self._m2,
            "nonfinite": self.nonfinite,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the statistics of a saved tracker exactly.

        A resumed run keeps its configured ``window``: when it differs from the saved one, the
        newest ``window`` saved norms seed the rolling statistics. A different ``warmup_steps``
        would silently change which norms the run statistics contain, so it is an error.
        """
        if state["warmup_steps"] != self.warmup_steps:
            raise ValueError(f"warmup_steps: the checkpoint's grad-norm tracker used "
                             f"{state['warmup_steps']}, this run uses {self.warmup_steps}")
        self._recent = deque((float(x) for x in state["recent"]), maxlen=self.window)
        self._count = int(state["count"])
        self._mean = float(state["mean"])
        self._m2 = float(state["m2"])
        self.nonfinite = int(state["nonfinite"])
