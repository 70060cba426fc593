"""PNG plots of a comparison's training curves (matplotlib, Agg backend: no display needed).

One curve per row of the comparison table (``compare.group_runs``: runs with the same configuration
but the seed), averaged over its seeds at each logged step / token count; the shaded band is ± one
sample std where at least two seeds logged that point.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display on clusters and CI
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from .compare import RunRecord, group_runs

Row = dict[str, Any]


def _seed_band(runs: Sequence[RunRecord], rows: Callable[[RunRecord], list[Row]], x_key: str,
               y: Callable[[Row], float | None]) -> tuple[list[float], list[float], list[float]]:
    """x, mean and std over seeds of ``y(row)`` at each x (std NaN where fewer than 2 seeds)."""
    points: dict[float, list[float]] = {}
    for run in runs:
        for row in rows(run):
            value = y(row)
            if value is not None and not math.isnan(value):
                points.setdefault(float(row[x_key]), []).append(float(value))
    xs = sorted(points)
    means = [statistics.fmean(points[x]) for x in xs]
    stds = [statistics.stdev(points[x]) if len(points[x]) > 1 else math.nan for x in xs]
    return xs, means, stds


def _plot_band(ax: Axes, xs: list[float], means: list[float], stds: list[float], label: str,
               **style: Any) -> None:
    (line,) = ax.plot(xs, means, label=label, **style)
    lower = [m - s for m, s in zip(means, stds, strict=True)]
    upper = [m + s for m, s in zip(means, stds, strict=True)]
    ax.fill_between(xs, lower, upper, color=line.get_color(), alpha=0.2, linewidth=0)


def _layer_value(layer: int, key: str) -> Callable[[Row], float | None]:
    def value(row: Row) -> float | None:
        for entry in row.get("layers") or []:
            if entry.get("layer") == layer:
                return entry.get(key)
        return None
    return value


def _layers(runs: Sequence[RunRecord], key: str) -> list[int]:
    return sorted({entry["layer"] for run in runs for row in run.evals for entry in row.get("layers") or []
                   if entry.get(key) is not None})


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_val_loss(runs: Sequence[RunRecord], path: Path) -> Path:
    """Validation loss against training tokens, one line (mean ± std band over seeds) per variant."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, members in group_runs(runs).items():
        _plot_band(ax, *_seed_band(members, lambda r: r.evals, "tokens", lambda row: row.get("val_loss")),
                   label=f"{variant} (n={len(members)})", marker=".")
    ax.set(xlabel="training tokens", ylabel="validation loss (nats/token)", title="Validation loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_grad_norm(runs: Sequence[RunRecord], path: Path) -> Path:
    """Pre-clip gradient norm and its rolling variance against step (mean ± std over seeds)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    for variant, members in group_runs(runs).items():
        for ax, key in ((top, "grad_norm"), (bottom, "grad_norm_var_rolling")):
            _plot_band(ax, *_seed_band(members, lambda r: r.train, "step", lambda row, k=key: row.get(k)),
                       label=variant)
    top.set(ylabel="grad norm (pre-clip)", title="Gradient norm")
    bottom.set(xlabel="step", ylabel="rolling variance", yscale="log")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend()
    return _save(fig, path)


def _layer_panel(ax: Axes, members: Sequence[RunRecord], key: str, title: str) -> None:
    """``key`` of each layer of one variant's runs (colour = depth) against training tokens."""
    layers = _layers(members, key)
    colours = plt.cm.viridis([i / max(len(layers) - 1, 1) for i in range(len(layers))])
    for layer, colour in zip(layers, colours, strict=True):
        _plot_band(ax, *_seed_band(members, lambda r: r.evals, "tokens", _layer_value(layer, key)),
                   label=f"layer {layer}", color=colour)
    ax.set(xlabel="training tokens", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)


def _per_layer_over_training(runs: Sequence[RunRecord], key: str, path: Path, title: str) -> Path:
    """One panel per variant: ``key`` of each layer (colour = depth) against training tokens."""
    groups = {v: m for v, m in group_runs(runs).items() if _layers(m, key)}
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False, sharey=True)
    for ax, (variant, members) in zip(axes[0], groups.items(), strict=True):
        _layer_panel(ax, members, key, variant)
    axes[0][0].set_ylabel(key)
    fig.suptitle(title)
    return _save(fig, path)


def plot_isotropy(runs: Sequence[RunRecord], path: Path) -> Path:
    """IsoScore of each layer's hidden states over training (layer 0 = embedding output)."""
    return _per_layer_over_training(runs, "isoscore", path, "IsoScore per layer over training")


def plot_alpha(runs: Sequence[RunRecord], path: Path) -> Path | None:
    """Learned alpha per layer: final value (left) and over training (one panel per variant).

    Only variants whose FFN has an alpha (isogmlp, iso_ln); None when no run has one.
    """
    with_alpha = [run for run in runs if _layers([run], "alpha")]
    if not with_alpha:
        return None
    groups = group_runs(with_alpha)
    fig, axes = plt.subplots(1, len(groups) + 1, figsize=(5 * (len(groups) + 1), 4), squeeze=False)
    final_ax = axes[0][0]
    for variant, members in groups.items():
        _plot_band(final_ax, *_seed_band(members, lambda r: r.evals[-1]["layers"], "layer",
                                         lambda entry: entry.get("alpha")), label=variant, marker="o")
    final_ax.set(xlabel="layer", ylabel="alpha", title="Final alpha per layer")
    final_ax.grid(alpha=0.3)
    final_ax.legend()
    for ax, (variant, members) in zip(axes[0][1:], groups.items(), strict=True):
        _layer_panel(ax, members, "alpha", f"{variant}: alpha over training")
        ax.set_ylabel("alpha")
    return _save(fig, path)


def write_plots(runs: Sequence[RunRecord], out_dir: str | Path) -> list[Path]:
    """Write every plot that the runs have data for; return the written paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_val_loss(runs, out / "val_loss.png"), plot_grad_norm(runs, out / "grad_norm.png")]
    if any(_layers([run], "isoscore") for run in runs):
        written.append(plot_isotropy(runs, out / "isotropy.png"))
    alpha = plot_alpha(runs, out / "alpha.png")
    if alpha is not None:
        written.append(alpha)
    return written
