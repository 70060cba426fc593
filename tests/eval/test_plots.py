"""compare's plots stay readable with long row labels: no two text boxes overlap, every label is whole, legends
sit outside the axes and name the band; a variant's rows at several sizes share its hue."""

from __future__ import annotations

import colorsys
import itertools
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.transforms import Bbox
from test_compare import write_run

import llm.eval.plots as plots
from llm.eval.compare import compare_runs
from llm.eval.runs import load_run
from llm.eval.scaling import scaling_series

SIZES = {(64, 2): 1_000_000, (128, 4): 4_000_000}


def _drawn(ax, axis: str, label: Text) -> bool:
    """Whether a tick label is drawn: non-empty, visible, at a tick inside the view limits."""
    low, high = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    where = label.get_position()[0 if axis == "x" else 1]
    return label.get_visible() and bool(label.get_text()) and low * (1 - 1e-9) <= where <= high * (1 + 1e-9)


def text_boxes(fig: Figure) -> list[tuple[str, Bbox]]:
    """(what, window extent) of every title, axis label, drawn tick label and legend of ``fig``."""
    fig.set_dpi(120)  # as saved: the tick locators choose by the axes size in pixels
    canvas = FigureCanvasAgg(fig)  # a closed figure keeps no canvas of pyplot's
    canvas.draw()
    renderer = canvas.get_renderer()
    texts: list[tuple[str, Text | object]] = [("suptitle", t) for t in fig.findobj(Text)
                                               if fig.get_suptitle() and t.get_text() == fig.get_suptitle()]
    for i, ax in enumerate(fig.axes):
        texts += [(f"axes {i} title", ax.title), (f"axes {i} xlabel", ax.xaxis.label),
                  (f"axes {i} ylabel", ax.yaxis.label)]
        for axis, labels in (("x", ax.get_xticklabels(which="both")), ("y", ax.get_yticklabels(which="both"))):
            texts += [(f"axes {i} {axis} tick {t.get_text()}", t) for t in labels if _drawn(ax, axis, t)]
        if ax.get_legend() is not None:
            texts.append((f"axes {i} legend", ax.get_legend()))
    return [(what, t.get_window_extent(renderer)) for what, t in texts
            if not isinstance(t, Text) or (t.get_visible() and t.get_text())]


def overlaps(a: Bbox, b: Bbox, gap: float = 3.0) -> bool:
    """Whether ``a`` and ``b`` are closer than ``gap`` pixels (text run together reads as one)."""
    both = Bbox.intersection(a.padded(gap / 2), b.padded(gap / 2))
    return both is not None and both.width > 0.5 and both.height > 0.5


@pytest.fixture
def scaling_view(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Figure]:
    """compare's plots of 2 variants x 2 sizes x 2 seeds (4 rows labelled with both size fields), each figure kept."""
    for variant in ("swiglu+softmax", "isogmlp+softmax"):
        for ((hidden, layers), params), seed in itertools.product(SIZES.items(), range(2)):
            write_run(tmp_path / "runs", variant, seed, 4.0 - 0.1 * layers + 0.01 * seed, layers=layers,
                      params=(params + 500_000, params), model__hidden_size=hidden, model__num_hidden_layers=layers,
                      dirname=f"{variant.split('+')[0]}-h{hidden}-s{seed}")
    comparison = compare_runs([load_run(run) for run in sorted((tmp_path / "runs").iterdir())])
    assert len(comparison.groups) == 4 and all(len(label) > 60 for label in comparison.groups)
    figures: dict[str, Figure] = {}
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.setdefault(path.name, fig) and save(fig, path))
    plots.write_plots(comparison.groups, tmp_path / "plots", scaling=scaling_series(comparison))
    assert sorted(figures) == ["alpha.png", "grad_norm.png", "isotropy.png", "scaling.png", "val_loss.png"]
    return figures


def test_no_text_overlaps_and_every_label_is_whole(scaling_view: dict[str, Figure]) -> None:
    for name, fig in scaling_view.items():
        boxes = text_boxes(fig)
        clashes = [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if overlaps(box_a, box_b)]
        assert not clashes, f"{name}: {clashes}"
        cut = [what for what, box in boxes if not fig.bbox.padded(1).contains(box.x0, box.y0)
               or not fig.bbox.padded(1).contains(box.x1, box.y1)]
        assert not cut, f"{name}: cut off by the figure's edge: {cut}"
        for ax in fig.axes:  # legends beside the curves, not over them
            legend = ax.get_legend()
            assert legend is None or not overlaps(legend.get_window_extent(), ax.bbox, gap=0), name


def test_legends_name_the_band_and_layers_tick_at_integers(scaling_view: dict[str, Figure]) -> None:
    for name in ("val_loss.png", "grad_norm.png", "alpha.png"):
        legend = scaling_view[name].axes[0].get_legend()
        assert "band: seeds' min to max" in [t.get_text() for t in legend.get_texts()], name
    assert "band" not in str([t.get_text() for t in scaling_view["scaling.png"].axes[0].get_legend().get_texts()])
    final_alpha = scaling_view["alpha.png"].axes[0]
    assert all(tick == int(tick) for tick in final_alpha.get_xticks())


def test_a_variant_has_one_hue_across_sizes(scaling_view: dict[str, Figure]) -> None:
    lines = {line.get_label(): line.get_color() for line in scaling_view["val_loss.png"].axes[0].get_lines()}
    fits = {bars.get_label(): bars.lines[0].get_color() for bars in scaling_view["scaling.png"].axes[0].containers}
    for variant in ("swiglu+softmax", "isogmlp+softmax"):
        small, large = (lines[next(label for label in lines if label.startswith(f"{variant} (model.hidden_size={h},"))]
                        for h in (64, 128))
        series = next(colour for label, colour in fits.items() if label.startswith(variant))
        assert tuple(large) == pytest.approx(tuple(series)[:3])  # the largest size in the series' own colour
        hsv_small, hsv_large = colorsys.rgb_to_hsv(*small[:3]), colorsys.rgb_to_hsv(*large[:3])
        assert hsv_small[0] == pytest.approx(hsv_large[0], abs=1e-6) and hsv_small[1] < hsv_large[1]  # lighter
    hues = {round(colorsys.rgb_to_hsv(*colour[:3])[0], 4) for colour in lines.values()}
    assert len(hues) == 2
