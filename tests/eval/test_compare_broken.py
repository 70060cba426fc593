"""compare on what broken runs leave behind: a NaN final eval, a metrics file cut off mid-line, an empty
file, a run with only one eval. Each is listed and left out of the statistics; the good runs are still compared."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest
from test_compare import FINAL_LOSSES, welch_by_hand, write_run

from llm.cli.eval import main
from llm.eval.compare import compare_runs
from llm.eval.report import format_table
from llm.eval.runs import load_run


def _cut_off(run: Path) -> int:
    """Cut the last line (the final eval) in the middle, as a kill mid-write leaves it; its line number."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([*lines[:-1], lines[-1][:25]]))
    return len(lines)


def _diverge(run: Path) -> None:
    """The final eval's validation loss NaN, as a diverged run logs it."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows[-1]["val_loss"] = math.nan
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def broken_root(tmp_path: Path) -> tuple[Path, int]:
    root = tmp_path / "runs"
    for variant in ("swiglu+softmax", "isogmlp+softmax"):
        for seed, loss in enumerate(FINAL_LOSSES[variant]):
            write_run(root, variant, seed, loss)
    _diverge(write_run(root, "isogmlp+softmax", 3, 4.9))
    cut_line = _cut_off(write_run(root, "isogmlp+softmax", 4, 4.1))
    write_run(root, "isogmlp+softmax", 5, 4.2, dirname="one_eval")
    rows = (root / "one_eval" / "metrics.jsonl").read_text().splitlines()
    (root / "one_eval" / "metrics.jsonl").write_text("\n".join(r for r in rows if '"step": 10,' not in r
                                                               and '"step": 15,' not in r and '"step": 20,' not in r))
    (root / "empty").mkdir()
    (root / "empty" / "metrics.jsonl").write_text("")
    return root, cut_line


def test_broken_runs_are_listed_and_left_out(broken_root, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, cut_line = broken_root
    assert main(["compare", str(root / "*"), "--out", str(tmp_path / "out"), "--no-plots"]) == 0
    captured = capsys.readouterr()
    assert f"isogmlp_softmax_s4/metrics.jsonl:{cut_line}: skipped a line that is not a metrics row" in captured.err
    assert "empty/metrics.jsonl: no meta row" in captured.err and "(the file is empty); left out" in captured.err
    table = (tmp_path / "out" / "comparison.md").read_text()  # every run left out is named there too
    assert "empty/metrics.jsonl: no meta row" in table and "(the file is empty); left out" in table
    assert "isogmlp_softmax_s3 diverged" in table and "isogmlp_softmax_s4 incomplete" in table
    assert "isogmlp_softmax_s3 diverged" in captured.err
    assert "isogmlp_softmax_s4 incomplete (final eval at step 15 of 20" in captured.err
    assert "one_eval incomplete (final eval at step 5 of 20" in captured.err
    good = FINAL_LOSSES["isogmlp+softmax"]
    mean, std = statistics.fmean(good), statistics.stdev(good)
    assert f"| isogmlp+softmax | 83.1M | 12.6M | {mean:.4f} ± {std:.4f} | 3 | 1 / 2 |" in captured.out
    with (tmp_path / "out" / "comparison.csv").open() as f:
        row = {r["variant"]: r for r in csv.DictReader(f)}["isogmlp+softmax"]
    assert (row["n_seeds"], row["diverged"], row["incomplete"]) == ("3", "1", "2")
    assert float(row["p_value"]) == pytest.approx(welch_by_hand(good, FINAL_LOSSES["swiglu+softmax"]), rel=1e-9)


def test_a_variant_whose_runs_all_diverged_says_so(tmp_path: Path) -> None:
    runs = [load_run(write_run(tmp_path, "swiglu+softmax", s, loss))
            for s, loss in enumerate(FINAL_LOSSES["swiglu+softmax"])]
    runs += [load_run(write_run(tmp_path, "isogmlp+softmax", s, 4.9 + 0.01 * s)) for s in range(2)]
    runs += [load_run(write_run(tmp_path, "iso_ln+softmax", s, 4.9)) for s in range(2)]
    for run in runs[-2:]:
        _diverge(run.path)
    comparison = compare_runs([load_run(run.path) for run in runs])
    rows = {row.variant: row for row in comparison.rows}
    assert math.isnan(rows["iso_ln+softmax"].val_loss_mean) and len(rows["iso_ln+softmax"].diverged) == 2
    assert not math.isnan(rows["isogmlp+softmax"].p_value)  # the others are still compared
    assert "| iso_ln+softmax | 83.0M | 12.6M | all diverged | 0 | 2 / 0 |" in format_table(comparison)
    assert any("row iso_ln+softmax: no complete run" in w for w in comparison.warnings)


def test_a_cut_off_run_logged_without_max_steps_is_incomplete(tmp_path: Path) -> None:
    """A meta row from before it logged max_steps: the config's train.max_steps tells where the run was to end, so
    the cut-off run is listed, not a seed that disagrees on the final token count (which would refuse the row)."""
    runs = []
    for seed, loss in enumerate(FINAL_LOSSES["swiglu+softmax"]):
        run = write_run(tmp_path, "swiglu+softmax", seed, loss)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        del rows[0]["max_steps"]
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        runs.append(run)
    _cut_off(runs[-1])
    (row,) = compare_runs([load_run(run) for run in runs]).rows
    assert (row.n, [r.path.name for r in row.incomplete]) == (2, ["swiglu_softmax_s2"])


def test_a_loss_above_uniform_prediction_is_diverged_whatever_its_size(tmp_path: Path) -> None:
    """A run at vocabulary 1,024 that ends at 100 nats is worse than uniform prediction (ln 1024 = 6.93), so
    diverged; a loss just below ln 1024 is a (bad) complete run. The bound is the run's own vocabulary's,
    read from its config."""
    uniform = math.log(1024)
    above, below = (load_run(write_run(tmp_path, "swiglu+softmax", seed, loss, model__vocab_size=1024))
                    for seed, loss in ((0, 100.0), (1, uniform - 1e-9)))
    assert above.final_val_loss == pytest.approx(100.0) and (above.status, above.diverged) == ("diverged", True)
    assert below.final_val_loss == pytest.approx(uniform - 1e-9) and below.status == "complete"
    big_vocab = load_run(write_run(tmp_path, "swiglu+softmax", 2, 8.0))  # Qwen3's vocabulary: ln 151,936 = 11.9
    assert big_vocab.status == "complete"
