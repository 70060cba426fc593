"""PNG plots of a comparison's training curves (matplotlib, Agg backend: no display needed).

One curve per row of the comparison table, averaged over its seeds at each logged step / token count;
the shaded band spans the seeds (their smallest to largest value) where at least two seeds logged that
point: a ± std band would reach below zero for a spiky, positive quantity such as a gradient norm or its
variance. Every plot takes the table's rows (``Comparison.groups``, or one ``grouping.group_runs``
result) rather than grouping runs itself: a plot of a subset (the rows with an alpha) regrouped on its
own would label rows by the fields that differ inside the subset, not as the table does.
A row has one colour in every plot; the rows of one variant at several model sizes (a series,
``llm.eval.grouping.series_labels``) share its hue, lighter for smaller sizes, and ``scaling.png`` draws the series
in that hue. Legends sit right of the axes and name the band; long titles wrap (constrained layout keeps every
label whole).
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display on clusters and CI
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import EngFormatter, FormatStrFormatter, MaxNLocator

from .grouping import series_labels
from .runs import RunRecord
from .scaling import ScalingSeries
from .tune import TunePoint

Row = dict[str, Any]
Rows = Mapping[str, Sequence[RunRecord]]
"""Rows of the comparison: label -> the row's runs (its seeds), in table order."""


def _plot_seeds(ax: Axes, runs: Sequence[RunRecord], rows: Callable[[RunRecord], list[Row]], x_key: str,
                y: Callable[[Row], float | None], label: str, **style: Any) -> None:
    """The mean over seeds of ``y(row)`` at each x, and a band from the smallest to the largest value where at
    least 2 seeds logged it."""
    points: dict[float, list[float]] = {}
    for run in runs:
        for row in rows(run):
            value = y(row)
            if value is not None and not math.isnan(value):
                points.setdefault(float(row[x_key]), []).append(float(value))
    xs = sorted(points)
    (line,) = ax.plot(xs, [statistics.fmean(points[x]) for x in xs], label=label, **style)
    spread = [points[x] if len(points[x]) > 1 else [math.nan] for x in xs]
    ax.fill_between(xs, [min(s) for s in spread], [max(s) for s in spread], color=line.get_color(), alpha=0.2,
                    linewidth=0)


def _layer_value(layer: int, key: str) -> Callable[[Row], float | None]:
    """An eval row's ``key`` of ``layer`` (None when the row has no such layer)."""
    return lambda row: next((entry.get(key) for entry in row.get("layers") or [] if entry.get("layer") == layer), None)


def _layers(runs: Sequence[RunRecord], key: str) -> list[int]:
    return sorted({entry["layer"] for run in runs for row in run.evals for entry in row.get("layers") or []
                   if entry.get(key) is not None})


def row_colours(rows: Rows, tune: Sequence[str] = ()) -> dict[str, Any]:
    """A colour per row label and per series label: a hue per series from its first row's position in the whole
    table (so that a plot of some rows keeps each row's colour), its rows in shades of it from light (smallest
    model) to the hue itself (largest), which is also the series' colour."""
    series = series_labels(rows, tune)
    hues = list(dict.fromkeys(series.values()))
    palette = plt.get_cmap("tab10" if len(hues) <= 10 else "tab20")
    colours: dict[str, Any] = {name: matplotlib.colors.to_rgb(palette(i % palette.N)) for i, name in enumerate(hues)}
    for label in rows:
        sizes = sorted((other for other in rows if series[other] == series[label]),
                       key=lambda other: rows[other][0].meta.get("params_non_embedding") or 0)
        light = 0.6 * (len(sizes) - 1 - sizes.index(label)) / max(len(sizes) - 1, 1)  # towards white
        colours[label] = tuple(c + (1 - c) * light for c in colours[series[label]])
    return colours


def _legend(ax: Axes, **style: Any) -> None:
    """The legend right of ``ax``, with the band's meaning when a band was drawn."""
    handles, _ = ax.get_legend_handles_labels()
    if any(isinstance(drawn, matplotlib.collections.PolyCollection) and drawn.get_paths() for drawn in ax.collections):
        handles.append(matplotlib.patches.Patch(color="grey", alpha=0.2, label="band: seeds' min to max"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small", **style)


def _save(fig: plt.Figure, path: Path) -> Path:
    """Write ``fig`` with a light grid on every panel, and close it."""
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_val_loss(rows: Rows, path: Path, colours: Mapping[str, Any]) -> Path:
    """Validation loss against training tokens, one line per row (mean over seeds, band over their range)."""
    fig, ax = plt.subplots(figsize=(10, 4.5), layout="constrained")
    for label, members in rows.items():
        _plot_seeds(ax, members, lambda r: r.evals, "tokens", lambda row: row.get("val_loss"),
                    label=f"{label} (n={len(members)})", marker=".", color=colours[label])
    ax.set(xlabel="training tokens", ylabel="validation loss (nats/token)", title="Validation loss")
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 20k, not 20000: narrow panels stay legible
    _legend(ax)
    return _save(fig, path)


def plot_grad_norm(rows: Rows, path: Path, colours: Mapping[str, Any]) -> Path:
    """Pre-clip gradient norm and its rolling variance against step (mean over seeds, band over the seeds' range)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, layout="constrained")
    for label, members in rows.items():
        for ax, key in ((top, "grad_norm"), (bottom, "grad_norm_var_rolling")):
            _plot_seeds(ax, members, lambda r: r.train, "step", lambda row, k=key: row.get(k), label=label,
                        color=colours[label])
    top.set(ylabel="grad norm (pre-clip)", title="Gradient norm")
    bottom.set(xlabel="step", ylabel="rolling variance", yscale="log")
    _legend(top)
    return _save(fig, path)


def _layer_panel(ax: Axes, members: Sequence[RunRecord], key: str, title: str) -> None:
    """``key`` of each layer of one row's runs (colour = depth) against training tokens."""
    layers = _layers(members, key)
    colours = plt.cm.viridis([i / max(len(layers) - 1, 1) for i in range(len(layers))])
    for layer, colour in zip(layers, colours, strict=True):
        _plot_seeds(ax, members, lambda r: r.evals, "tokens", _layer_value(layer, key), label=f"layer {layer}",
                    color=colour)
    ax.set(xlabel="training tokens", title=textwrap.fill(title, 44))  # a row label can be longer than the panel
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    _legend(ax, ncol=2 if len(layers) > 8 else 1)


def plot_isotropy(rows: Rows, path: Path) -> Path:
    """IsoScore of each layer's hidden states over training (layer 0 = embedding output), one panel per row that
    logged it (colour = depth)."""
    logged = {label: members for label, members in rows.items() if _layers(members, "isoscore")}
    fig, axes = plt.subplots(1, len(logged), figsize=(6 * len(logged), 4), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, (label, members) in zip(axes[0], logged.items(), strict=True):
        _layer_panel(ax, members, "isoscore", label)
    axes[0][0].set_ylabel("isoscore")
    fig.suptitle("IsoScore per layer over training")
    return _save(fig, path)


def plot_alpha(rows: Rows, path: Path, colours: Mapping[str, Any]) -> Path | None:
    """Learned alpha per layer, final (left) and over training (a panel per row), of the rows whose runs logged one
    (isogmlp, iso_ln); None when none did."""
    with_alpha = {label: members for label, members in rows.items() if _layers(members, "alpha")}
    if not with_alpha:
        return None
    fig, axes = plt.subplots(1, len(with_alpha) + 1, figsize=(6 * (len(with_alpha) + 1), 4), squeeze=False,
                             layout="constrained")
    final_ax = axes[0][0]
    for label, members in with_alpha.items():
        _plot_seeds(final_ax, members, lambda r: r.evals[-1]["layers"], "layer", lambda entry: entry.get("alpha"),
                    label=label, marker="o", color=colours[label])
    final_ax.set(xlabel="layer", ylabel="alpha", title="Final alpha per layer")
    final_ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
    _legend(final_ax)
    for ax, (label, members) in zip(axes[0][1:], with_alpha.items(), strict=True):
        _layer_panel(ax, members, "alpha", f"{label}: alpha over training")
        ax.set_ylabel("alpha")
    return _save(fig, path)


def plot_sensitivity(sensitivity: Mapping[str, Sequence[TunePoint]], key: str, path: Path,
                     colours: Mapping[str, Any]) -> Path:
    """Final validation loss against the tuned ``key`` (``compare --tune``), one line per row with seed error bars
    (± std); a log x axis for positive values spanning 4x or more (a learning-rate grid). A value whose runs all
    diverged is a cross at the top of the axis, not a gap."""
    fig, ax = plt.subplots(figsize=(10, 4.5), layout="constrained")
    for label, points in sensitivity.items():
        finite = [(point.values[0], point.summary) for point in points if point.losses]
        ax.errorbar([value for value, _ in finite], [summary.mean for _, summary in finite],
                    yerr=[0.0 if math.isnan(s.std) else s.std for _, s in finite], marker="o", capsize=3,
                    label=label, color=colours[label])
        # the values whose runs all diverged, at the top of the axes whatever the losses' scale
        if diverged := [point.values[0] for point in points if not point.losses and point.diverged]:
            ax.scatter(diverged, [0.97] * len(diverged), marker="x", s=60, color=colours[label],
                       transform=ax.get_xaxis_transform(), clip_on=False)
    values = [point.values[0] for points in sensitivity.values() for point in points]
    if all(isinstance(v, int | float) and v > 0 for v in values) and max(values) >= 4 * min(values):
        ax.set_xscale("log")
    ax.set(xlabel=key, ylabel="final validation loss (nats/token)",
           title=textwrap.fill(f"Sensitivity to {key} (x: every run at that value diverged)", 60))
    _legend(ax)
    return _save(fig, path)


def plot_scaling(series: Sequence[ScalingSeries], path: Path, colours: Mapping[str, Any]) -> Path:
    """Final validation loss against non-embedding parameters on log-log axes, one colour per variant (its rows'
    hue in the other plots, its largest row's colour): its rows with seed error bars (± std) and its power-law fit as
    a dashed line."""
    fig, ax = plt.subplots(figsize=(10, 4.5), layout="constrained")
    for found in series:
        params = [float(row.params_non_embedding or 0) for row in found.rows]
        ax.errorbar(params, [row.val_loss_mean for row in found.rows], marker="o", capsize=3, linestyle="none",
                    yerr=[0.0 if math.isnan(row.val_loss_std) else row.val_loss_std for row in found.rows],
                    color=colours[found.label], label=f"{found.label} (b = {found.exponent:.3f})")
        ax.plot(params, [found.coefficient * n ** found.exponent for n in params], linestyle="--",
                color=colours[found.label])
    ax.set(xscale="log", yscale="log", xlabel="non-embedding parameters", ylabel="final validation loss (nats/token)",
           title="Scaling: loss = a · N^b per variant")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # 4.5, not 4.5 x 10^0
        axis(FormatStrFormatter("%.2f"))
    ax.grid(alpha=0.3, which="minor")  # log-log: the minor ticks too
    _legend(ax)
    return _save(fig, path)


def write_plots(rows: Rows, out_dir: str | Path, sensitivity: Mapping[str, Sequence[TunePoint]] | None = None,
                tune: Sequence[str] = (), scaling: Sequence[ScalingSeries] = ()) -> list[Path]:
    """Write every plot that the rows' runs have data for; return the written paths. ``rows`` are the
    table's (``Comparison.groups``), so every plot labels and colours a row as the table does; with one tuned key,
    ``sensitivity`` gives ``<key>_sensitivity.png`` (``lr_sensitivity.png`` for ``train.lr``); ``scaling``
    (``llm.eval.scaling.scaling_series``) gives ``scaling.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colours = row_colours(rows, tune)
    written = [plot_val_loss(rows, out / "val_loss.png", colours), plot_grad_norm(rows, out / "grad_norm.png", colours)]
    if sensitivity and len(tune) == 1:
        written.append(plot_sensitivity(sensitivity, tune[0], out / f"{tune[0].split('.')[-1]}_sensitivity.png",
                                        colours))
    if scaling:
        written.append(plot_scaling(scaling, out / "scaling.png", colours))
    if any(_layers(members, "isoscore") for members in rows.values()):
        written.append(plot_isotropy(rows, out / "isotropy.png"))
    return written + [path for path in [plot_alpha(rows, out / "alpha.png", colours)] if path is not None]
