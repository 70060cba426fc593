"""A run's identity in compare: the sequence of (first step, compared config) of the segments that produced its
final weights, with the seed of its first; and rows that cannot be read make a run damaged, never the comparison
fail."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from test_compare import FINAL_LOSSES, run_config, write_run

from llm.cli.eval import main
from llm.eval.compare import compare_runs
from llm.eval.errors import EvalError
from llm.eval.grouping import group_runs
from llm.eval.runs import load_run
from llm.train.logging import truncate_metrics

Segment = tuple[int, int, int, dict[str, Any]]
"""(the step it starts at, the step it stopped at, max_steps in force, its ``train`` config edits; ``seed`` there
is the run's seed)."""


def history_run(root: Path, name: str, seed: int, segments: list[Segment], *, meta_max_steps: bool = True) -> Path:
    """A metrics.jsonl as the trainer leaves it after these starts: each resume first truncates the rows past its
    step (``truncate_metrics``, which keeps every meta row), then appends its meta row and rows. A loss depends only
    on the step, the seed and the lr of the segment that logged it. ``meta_max_steps`` False: an older writer's meta
    rows, without ``max_steps``."""
    run, path = root / name, root / name / "metrics.jsonl"
    run.mkdir(parents=True)
    for start, stop, max_steps, edits in segments:
        truncate_metrics(path, start)
        edits = dict(edits)
        config = run_config("swiglu+softmax", this_seed := edits.pop("seed", seed))
        config["train"].update(max_steps=max_steps, **edits)
        rows = [{"kind": "meta", "step": start, "tokens": start * 100, "variant": "swiglu+softmax", "seed": this_seed,
                 "params_total": 1000, "params_non_embedding": 500, "config": config,
                 **({"max_steps": max_steps} if meta_max_steps else {})}]
        for step in range(start + 1, stop + 1):
            rows.append({"kind": "train", "step": step, "tokens": step * 100, "loss": 6.0 - step / 10})
            if step % 2 == 0 or step == stop:
                rows.append({"kind": "eval", "step": step, "tokens": step * 100, "layers": [],
                             "val_loss": 5.0 - step / 100 + seed / 1000 + config["train"]["lr"]})
        with path.open("a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
    return run


def test_a_change_at_another_step_is_another_row(tmp_path: Path) -> None:
    """lr 0.003 -> 0.03 on resume at step 3 in one seed and at step 5 in another: two lr histories, two rows."""
    runs = [load_run(history_run(tmp_path, f"at{at}", seed, [(0, at, 6, {}), (at, 6, 6, {"lr": 3e-2})]))
            for seed, at in enumerate((3, 5))]
    assert runs[0].setup["train.lr"] == "0.003 -> 0.03@3"
    assert {label: [run.path.name for run in members] for label, members in group_runs(runs).items()} == {
        "swiglu+softmax (train.lr=0.003 -> 0.03@3)": ["at3"], "swiglu+softmax (train.lr=0.003 -> 0.03@5)": ["at5"]}


def test_a_rolled_back_segment_is_not_part_of_the_run(tmp_path: Path) -> None:
    """Resumed at step 5 with lr 0.03, then rolled back to step 3 and resumed with the original 0.003: its weights
    come from lr 0.003 alone, its losses are its unchanged twin's, and it is a seed of the unchanged row. A killed
    extension rolled back and re-extended is a 6 -> 12 run, not a 6 -> 9 -> 12 one."""
    rolled = load_run(history_run(tmp_path, "rolled", 0, [(0, 5, 6, {}), (5, 6, 6, {"lr": 3e-2}), (3, 6, 6, {})]))
    twin = load_run(history_run(tmp_path, "twin", 0, [(0, 6, 6, {})]))
    assert [step for step, _ in rolled.segments] == [0, 3] and rolled.changed == {}
    assert (rolled.evals, rolled.final_val_loss) == (twin.evals, twin.final_val_loss)
    other = load_run(history_run(tmp_path, "other", 1, [(0, 6, 6, {})]))
    (row,) = compare_runs([rolled, other]).rows
    assert (row.variant, [run.path.name for run in row.runs]) == ("swiglu+softmax", ["rolled", "other"])
    re_extended = load_run(history_run(tmp_path, "re", 0, [(0, 6, 6, {}), (6, 8, 9, {}), (6, 12, 12, {})]))
    extended = load_run(history_run(tmp_path, "ext", 1, [(0, 6, 6, {}), (6, 9, 9, {}), (9, 12, 12, {})]))
    assert re_extended.setup["train.max_steps"] == "6 -> 12@6"
    assert extended.setup["train.max_steps"] == "6 -> 9@6 -> 12@9"
    assert len(group_runs([re_extended, extended])) == 2


def test_the_seed_is_the_first_segments(tmp_path: Path) -> None:
    """``seed=2`` on resume from seed 1's checkpoint continues seed 1's run: it is seed 1 again, not a third seed."""
    runs = [load_run(history_run(tmp_path, f"s{seed}", seed, [(0, 6, 6, {})])) for seed in range(2)]
    runs.append(load_run(history_run(tmp_path, "reseeded", 1, [(0, 3, 6, {}), (3, 6, 6, {"seed": 2})])))
    comparison = compare_runs(runs)
    assert [run.seed for run in comparison.rows[0].runs] == [0, 1, 1]
    assert "row swiglu+softmax: repeated seeds [0, 1, 1]; repeats are not independent samples" in comparison.warnings


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("val_loss", None, "val_loss is null"), ("val_loss", "missing", "val_loss is missing"),
    ("val_loss", 1e300, "val_loss is 1e+300"), ("val_loss", -1.0, "val_loss is -1.0"),
    ("tokens", "missing", "without its token count")])
def test_an_eval_row_that_is_no_loss_makes_its_run_damaged(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           key: str, value: Any, shown: str) -> None:
    """A final eval whose val_loss is null, missing, beyond float32's range or negative (or whose token count is
    missing) is a damaged line, named by file and line: its run is incomplete, and the others are compared."""
    dirs = [write_run(tmp_path / "runs", variant, seed, loss) for variant in ("swiglu+softmax", "isogmlp+softmax")
            for seed, loss in enumerate(FINAL_LOSSES[variant])]
    path = dirs[-1] / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[-1].pop(key) if value == "missing" else rows[-1].update({key: value})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["compare", str(tmp_path / "runs" / "*"), "--out", str(tmp_path / "out"), "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert f"warning: {path}:{len(rows)}: skipped " in err and shown in err
    assert "isogmlp_softmax_s2 incomplete (final eval at step 15 of 20" in err
    row = compare_runs([load_run(d) for d in dirs]).rows[1]
    assert (row.n, math.isfinite(row.p_value), [run.path.name for run in row.incomplete]) == \
        (2, True, ["isogmlp_softmax_s2"])


def test_an_older_writers_resume_at_its_configs_end_trained_nothing(tmp_path: Path) -> None:
    """Meta rows without ``max_steps``: a resume at step 6 of its config's 6 trained nothing, so its lr is no
    change."""
    again = load_run(history_run(tmp_path, "again", 0, [(0, 6, 6, {}), (6, 6, 6, {"lr": 1e-3})],
                                 meta_max_steps=False))
    assert (again.status, again.last_step, again.changed) == ("complete", 6, {})


def test_an_older_writers_killed_max_tokens_run_is_incomplete(tmp_path: Path) -> None:
    """Meta rows without ``max_steps`` and a ``max_tokens`` config (6 steps of 100 tokens): a run killed at step 4
    is incomplete, not a seed that ends at another token count (which would refuse the row)."""
    tokens = {"max_tokens": 600, "global_batch_tokens": 100}
    runs = [load_run(history_run(tmp_path, f"t{seed}", seed, [(0, stop, 0, tokens)], meta_max_steps=False))
            for seed, stop in enumerate((6, 6, 4))]
    (row,) = compare_runs(runs).rows
    assert (row.n, [run.path.name for run in row.incomplete], runs[2].last_step) == (2, ["t2"], 6)


@pytest.mark.parametrize("other", [[(0, 12, 12, {})], [(0, 3, 6, {}), (3, 6, 6, {"lr": 3e-2})]])
def test_no_tune_suggestion_where_tuning_does_not_fit(tmp_path: Path, other: list[Segment]) -> None:
    """A baseline naming rows that differ only in the run's length, or in a value changed on resume, gets no
    ``--tune`` suggestion: tuning the length picks the longest run, and a changed value has no one value."""
    runs = [load_run(history_run(tmp_path, "plain", 0, [(0, 6, 6, {})])),
            load_run(history_run(tmp_path, "other", 0, other))]
    with pytest.raises(EvalError, match=r"\); pass one of these labels or keys as --baseline$"):
        compare_runs(runs)


@pytest.mark.parametrize(("field", "value"), [("tokens_per_s", "fast"), ("grad_norm_var_run", [1]),
                                              ("grad_norm", True), ("layers", "none")])
def test_a_train_row_field_that_is_no_number_makes_its_run_damaged(tmp_path: Path, field: str, value: Any) -> None:
    """Any field the trainer writes as a number (or null) that holds something else is a damaged line: the run is
    listed with its file and line, the other runs still compared (it used to raise in the table's columns)."""
    for seed in range(2):
        history_run(tmp_path, f"good{seed}", seed, [(0, 6, 6, {})])
    damaged = history_run(tmp_path, "damaged", 2, [(0, 6, 6, {})])
    path = damaged / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    last_train = max(i for i, row in enumerate(rows) if row["kind"] == "train")
    rows[last_train][field] = value
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = load_run(damaged)
    assert run.problems == [f"{path}:{last_train + 1}: skipped a train row whose {field} "
                            + ("are" if field == "layers" else "is") + f" {json.dumps(value)}, not a "
                            + ("list of layer reports" if field == "layers" else "number") + " (damaged)"]
    comparison = compare_runs([load_run(p) for p in sorted(tmp_path.iterdir())])
    assert [row.n for row in comparison.rows] == [3] and any(str(path) in w for w in comparison.warnings)
