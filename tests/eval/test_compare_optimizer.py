"""``train.optimizer`` is part of a run's identity: compare never pools AdamW and Muon seeds, and says which row is
which (the field is one of the compared ``train`` section's, so no code of llm/eval names it)."""

from __future__ import annotations

from pathlib import Path

from test_compare import write_run

from llm.eval.compare import compare_runs
from llm.eval.grouping import group_runs
from llm.eval.runs import load_run


def test_adamw_and_muon_seeds_are_separate_rows_labelled_by_the_optimizer(tmp_path: Path) -> None:
    runs = [load_run(write_run(tmp_path, "swiglu+softmax", seed, 4.9 + seed / 100, dirname=f"{optimizer}_{lr}_{seed}",
                               train__optimizer=optimizer, train__lr=lr))
            for optimizer in ("adamw", "muon") for lr in (1e-3, 3e-3) for seed in (0, 1)]
    rows = group_runs(runs, ignore=["train.lr"])  # --tune train.lr: each optimizer at its own best lr
    assert {label: sorted(r.path.name for r in members) for label, members in rows.items()} == {
        f"swiglu+softmax (train.optimizer={optimizer})": sorted(f"{optimizer}_{lr}_{seed}" for lr in (1e-3, 3e-3)
                                                               for seed in (0, 1))
        for optimizer in ("adamw", "muon")}
    comparison = compare_runs(runs, baseline="swiglu+softmax (train.optimizer=adamw)", tune=["train.lr"])
    assert [row.variant for row in comparison.rows] == ["swiglu+softmax (train.optimizer=adamw)",
                                                        "swiglu+softmax (train.optimizer=muon)"]
