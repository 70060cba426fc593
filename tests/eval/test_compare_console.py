"""What `eval.py compare` prints: the table with only the columns that have a value in some row, and where the full
table is (comparison.md keeps every column)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_compare import write_run

from llm.cli.eval import main

ONE_SEED = ["Variant", "Params (total)", "Params (non-emb.)", "Val loss (mean ± std)", "n", "Diverged / incomplete ⁴",
            "Gap (95% CI) ¹", "Grad-norm variance after warmup ²", "Tokens/s ³"]
"""One seed per row: every gap column but the gap itself is n/a (no interval, test, MDE or seed count)."""


def _header(text: str) -> list[str]:
    return next(line for line in text.splitlines() if line.startswith("| Variant")).strip("| ").split(" | ")


def test_the_console_table_drops_the_columns_no_row_fills_and_names_the_full_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [write_run(tmp_path / "runs", variant, 0, loss) for variant, loss in
            (("swiglu+softmax", 4.93), ("isogmlp+softmax", 4.95))]
    # a run directory may follow the options (both rows below)
    assert main(["compare", str(runs[0]), "--out", str(tmp_path / "out"), "--no-plots", str(runs[1])]) == 0
    printed = capsys.readouterr().out
    assert _header(printed) == ONE_SEED
    assert f"every column: {tmp_path / 'out' / 'comparison.md'}, and comparison.csv beside it" in printed
    full = _header((tmp_path / "out" / "comparison.md").read_text())
    assert len(full) == 17 and set(ONE_SEED) < set(full)  # the file keeps the n/a columns

