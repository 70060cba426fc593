"""compare's scaling view and which config keys split rows: a variant at several model sizes is a series
whose rows are each tested against the baseline of their size; losses follow a known power law."""

from __future__ import annotations

import csv
import importlib.util
import math
import statistics
from pathlib import Path

import pytest
from scipy import stats
from test_compare import run_config, welch_by_hand, write_run

from llm.cli.eval import main
from llm.eval.compare import compare_runs
from llm.eval.grouping import group_runs
from llm.eval.report import format_table
from llm.eval.runs import load_run
from llm.eval.scaling import scaling_series

REPO = Path(__file__).resolve().parents[2]

# (hidden_size, num_hidden_layers) -> non-embedding parameters
SIZES = {(64, 2): 1_000_000, (128, 4): 4_000_000, (256, 8): 16_000_000}
# variant -> (a, b) of its mean final loss a * N^b, and its seeds' deviations from that mean
LAWS = {"swiglu+softmax": (10.0, -0.05, (-0.004, 0.0, 0.004)), "isogmlp+softmax": (10.5, -0.054, (-0.003, 0.0, 0.003))}


def _losses(variant: str, params: int) -> list[float]:
    a, b, deviations = LAWS[variant]
    return [a * params**b + d for d in deviations]


@pytest.fixture
def sizes_root(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for variant in LAWS:
        for (hidden, layers), params in SIZES.items():
            for seed, loss in enumerate(_losses(variant, params)):
                write_run(root, variant, seed, loss, params=(params + 500_000, params), model__hidden_size=hidden,
                          model__num_hidden_layers=layers, dirname=f"{variant.split('+')[0]}-h{hidden}-s{seed}")
    return root


def label(variant: str, hidden: int, layers: int) -> str:
    return f"{variant} (model.hidden_size={hidden}, model.num_hidden_layers={layers})"


def test_each_size_is_tested_against_the_baseline_of_its_size(sizes_root: Path) -> None:
    comparison = compare_runs([load_run(run) for run in sorted(sizes_root.iterdir())])
    assert comparison.baseline == "swiglu+softmax"
    assert comparison.baselines == tuple(label("swiglu+softmax", *size) for size in SIZES)
    assert [row.variant for row in comparison.rows] == [
        *comparison.baselines, *(label("isogmlp+softmax", *size) for size in SIZES)]
    rows = {row.variant: row for row in comparison.rows}
    for size, params in SIZES.items():
        iso, base = rows[label("isogmlp+softmax", *size)], rows[label("swiglu+softmax", *size)]
        assert iso.p_value == pytest.approx(welch_by_hand(_losses("isogmlp+softmax", params),
                                                          _losses("swiglu+softmax", params)), rel=1e-9)
        assert math.isnan(base.p_value) and iso.series == "isogmlp+softmax"
    assert comparison.warnings == []
    series = {found.label: found for found in scaling_series(comparison)}
    for variant, (a, b, _) in LAWS.items():  # the fit recovers the power law of the means
        assert series[variant].exponent == pytest.approx(b, rel=1e-9)
        assert series[variant].coefficient == pytest.approx(a, rel=1e-9)
    # an FFN name alone names the baseline series too
    assert compare_runs([load_run(run) for run in sorted(sizes_root.iterdir())], "swiglu").baselines == \
        comparison.baselines


def test_scaling_table_and_plot(sizes_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["compare", str(sizes_root / "*"), "--baseline", "swiglu", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    gap = 10.5 * 4e6**-0.054 - 10.0 * 4e6**-0.05
    p = welch_by_hand(_losses("isogmlp+softmax", 4_000_000), _losses("swiglu+softmax", 4_000_000))
    iso, base = _losses("isogmlp+softmax", 4_000_000), _losses("swiglu+softmax", 4_000_000)
    ci = stats.ttest_ind(iso, base, equal_var=False).confidence_interval(0.95)
    paired = stats.ttest_rel(iso, base)
    paired_ci = paired.confidence_interval(0.95)
    cells = (f"| {gap:+.4f} [{ci.low:+.4f}, {ci.high:+.4f}] | [{paired_ci.low:+.4f}, {paired_ci.high:+.4f}] | "
             f"{p:.3g} | {paired.pvalue:.3g} | ")
    assert f"| isogmlp+softmax | 4,000,000 | {10.5 * 4e6**-0.054:.4f} ± 0.0030 | 3 {cells}" in table
    scaling_row = next(line for line in table.splitlines() if line.startswith("| isogmlp+softmax | 4,000,000 |"))
    main_row = next(line for line in table.splitlines() if line.startswith(f"| {label('isogmlp+softmax', 128, 4)} ["))
    assert scaling_row.endswith(main_row.split(cells)[1].rsplit(" | ", 2)[0] + " |")  # the same MDE and seeds needed
    assert "| swiglu+softmax | 1,000,000 | " in table and "| 3 | baseline |" + "  |" * 8 + "\n" in table
    # the fit once per series, not on each of its rows
    assert "| isogmlp+softmax | 3 | 10.5 | -0.0540 | least squares over 3 sizes |\n" in table
    assert "| swiglu+softmax | 3 | 10 | -0.0500 | least squares over 3 sizes |\n" in table
    assert table.count("10.5") == 1
    assert "minus swiglu+softmax's at the same model size" in table
    png = (out / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    with (out / "comparison.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 6


def test_a_size_the_baseline_lacks_has_no_gap(sizes_root: Path) -> None:
    write_run(sizes_root, "isogmlp+softmax", 0, 3.0, params=(80_500_000, 80_000_000), model__hidden_size=512,
              model__num_hidden_layers=16, dirname="isogmlp-h512-s0")
    comparison = compare_runs([load_run(run) for run in sorted(sizes_root.iterdir())])
    rows = {row.variant: row for row in comparison.rows}
    assert math.isnan(rows[label("isogmlp+softmax", 512, 16)].p_value)
    from llm.eval.report import format_table

    assert "| isogmlp+softmax | 80,000,000 | 3.0000 | 1 | n/a |  |  |  |  |" in format_table(comparison)


def test_one_size_has_no_scaling_view(sizes_root: Path) -> None:
    runs = [load_run(run) for run in sorted(sizes_root.glob("*-h64-*"))]
    comparison = compare_runs(runs)
    assert [row.variant for row in comparison.rows] == ["swiglu+softmax", "isogmlp+softmax"]
    assert scaling_series(comparison) == []


def test_document_masking_splits_rows(tmp_path: Path) -> None:
    """Masked and unmasked runs compute different losses: never seeds of one row. A run saved before the option
    existed did not record it: a row of its own, as any field missing from a saved config is (no rule of its own)."""
    runs = [load_run(write_run(tmp_path, "swiglu+softmax", s, 4.9, data__document_masking=masking,
                               dirname=f"mask{masking}-s{s}")) for s in range(2) for masking in (True, False)]
    config = run_config("swiglu+softmax", 2)
    del config["data"]["document_masking"]
    old = write_run(tmp_path, "swiglu+softmax", 2, 4.9, dirname="old-s2", config=config)
    runs.append(load_run(old))
    assert "document_masking" not in (old / "metrics.jsonl").read_text()
    rows = group_runs(runs)
    assert {name: [run.path.name for run in members] for name, members in rows.items()} == {
        "swiglu+softmax (data.document_masking=False)": ["maskFalse-s0", "maskFalse-s1"],
        "swiglu+softmax (data.document_masking=True)": ["maskTrue-s0", "maskTrue-s1"],
        "swiglu+softmax (data.document_masking=not recorded)": ["old-s2"],
    }


def test_a_fit_through_two_sizes_says_it_is_exact(sizes_root: Path) -> None:
    """Two sizes for the fit's two parameters: the line passes through both, which the fit table says."""
    runs = [load_run(run) for run in sorted(sizes_root.iterdir()) if "-h256-" not in run.name]
    table = format_table(compare_runs(runs, "swiglu"))
    assert "| Variant | Sizes | a | b | Fit |" in table
    assert table.count("| exact: 2 sizes for 2 parameters, nothing tests the power law |") == 2


@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")  # the fake runs' identical norms
def test_replication_stats_report_each_size_against_its_baseline(sizes_root: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("stats", REPO / "docs/results/replicate-cpu/stats.py")
    stats = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stats)
    assert stats.main([str(sizes_root / "*")]) == 0
    sections = capsys.readouterr().out.split("\n# ")
    assert len(sections) == len(SIZES)
    for section, ((hidden, layers), params) in zip(sections, sorted(SIZES.items()), strict=True):
        assert f"model.hidden_size={hidden}, model.intermediate_size=" in section
        assert f"model.num_hidden_layers={layers}" in section
        row = next(line for line in section.splitlines() if line.startswith("| isogmlp+softmax | 3 |"))
        delta = float(row.split("|")[4])
        expected = statistics.fmean(_losses("isogmlp+softmax", params)) - statistics.fmean(
            _losses("swiglu+softmax", params))
        assert delta == pytest.approx(expected, abs=1e-4)
