"""The scaling view of a comparison: a variant's rows at several model sizes (a *series*,
``llm.eval.grouping``) and a power-law fit L = a * N^b of their final validation loss against non-embedding
parameters N (least squares on log L against log N). Rows with no complete run are left out. Each row's gap to the
baseline and its p-value are against the baseline row of the same size (``llm.eval.report``, ``scaling.png``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llm.eval.compare import Comparison, VariantSummary

__all__ = ["ScalingSeries", "scaling_series"]


@dataclass
class ScalingSeries:
    """One variant at two or more model sizes."""

    label: str
    rows: list[VariantSummary]
    """Its rows with a loss, by non-embedding parameters."""
    coefficient: float
    exponent: float
    """b of the fit L = a * N^b (negative when the loss falls with size)."""


def scaling_series(comparison: Comparison) -> list[ScalingSeries]:
    """The comparison's series whose rows with a loss come in two or more sizes (none when every row is one size)."""
    by_series: dict[str, list[VariantSummary]] = {}
    for row in comparison.rows:
        if not math.isnan(row.val_loss_mean) and row.params_non_embedding:
            by_series.setdefault(row.series, []).append(row)
    found = []
    for label, rows in by_series.items():
        if len({row.params_non_embedding for row in rows}) < 2:
            continue
        rows.sort(key=lambda row: row.params_non_embedding or 0)
        exponent, log_coefficient = np.polyfit(np.log([row.params_non_embedding for row in rows]),
                                               np.log([row.val_loss_mean for row in rows]), 1)
        found.append(ScalingSeries(label, rows, float(np.exp(log_coefficient)), float(exponent)))
    return found
