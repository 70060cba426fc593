"""compare/plots on synthetic run directories whose numbers are known."""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib.colors
import matplotlib.pyplot as plt
import pytest

from llm.cli.eval import main
from llm.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from llm.eval import plots
from llm.eval.compare import compare_runs
from llm.eval.errors import EvalError
from llm.eval.grouping import group_runs, series_key
from llm.eval.plots import write_plots
from llm.eval.report import format_table, write_comparison
from llm.eval.runs import expand_run_dirs, load_run

# Final val losses per variant and seed; Welch's t and its Welch–Satterthwaite df are computed by
# hand below, independently of scipy's ttest_ind.
FINAL_LOSSES = {
    "swiglu+softmax": [4.9270, 4.9250, 4.9280],
    "isogmlp+softmax": [4.9480, 4.9490, 4.9470],
    "iso_ln+softmax": [4.9000],
}
PARAMS = {"swiglu+softmax": (83_000_000, 12_500_000), "isogmlp+softmax": (83_100_000, 12_600_000),
          "iso_ln+softmax": (83_050_000, 12_550_000)}
HAS_ALPHA = {"isogmlp+softmax", "iso_ln+softmax"}
TOKENS_PER_STEP = 1000


def run_config(variant: str, seed: int, **changes: Any) -> dict[str, Any]:
    """A meta row's ``config`` as today's trainer writes it (every field; compare groups by the model, data and
    train sections and ignores the seed)."""
    config = asdict(RunConfig(name="x", seed=seed, data=DataConfig(seed=0, seq_len=128),
                              model=ModelConfig(ffn=variant.split("+")[0].split("[")[0], ffn_init="matched",
                                                hidden_size=64, num_attention_heads=4),
                              train=TrainConfig(lr=3e-3, max_steps=20)))
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        config[section][key] = value
    return config


def write_run(root: Path, variant: str, seed: int, final_loss: float, *, steps: int = 20,
              final_tokens: int | None = None, layers: int = 3, params: tuple[int, int] | None = None,
              dirname: str | None = None, alpha: bool | None = None, config: dict[str, Any] | None = None,
              **config_changes: Any) -> Path:
    """A metrics.jsonl as the trainer writes it (docs/ARCHITECTURE.md): meta, train rows, eval rows.
    ``config`` replaces the meta row's config; ``config_changes`` are ``section__key=value`` edits of it.
    ``alpha``: whether the eval rows log an alpha per layer (default: as the variant's FFN does)."""
    run = root / (dirname or f"{variant.replace('+', '_')}_s{seed}")
    run.mkdir(parents=True)
    total, non_emb = params or PARAMS.get(variant, PARAMS["swiglu+softmax"])
    has_alpha = variant in HAS_ALPHA if alpha is None else alpha
    rows = [{"kind": "meta", "step": 0, "tokens": 0, "name": run.name, "variant": variant, "seed": seed,
             "params_total": total, "params_non_embedding": non_emb, "flops_per_token": 1, "max_steps": steps,
             "config": config or run_config(variant, seed, **config_changes)}]
    for step in range(1, steps + 1):
        rows.append({"kind": "train", "step": step, "tokens": step * TOKENS_PER_STEP, "loss": 6.0 - step / 10,
                     "grad_norm": 1.0 + 0.1 * seed + 0.01 * step, "grad_norm_var_rolling": 0.01 * step,
                     # only the last row's run variance counts as the run's stability
                     "grad_norm_var_run": 0.02 + 0.001 * seed if step == steps else 99.0,
                     "tokens_per_s": 1000.0 * (seed + 1) + step})
        if step % 5 == 0:
            loss = final_loss + (steps - step) * 0.1
            layer_rows = [{"layer": i, "isoscore": 0.1 * i + 0.01 * step, "mean_cos": 0.5, "eff_rank": 3.0,
                           "basis_alignment": 1.0} for i in range(layers + 1)]
            if has_alpha:
                for entry in layer_rows[1:]:
                    entry.update(alpha=0.5 + 0.01 * entry["layer"] + 0.001 * step, beta=0.0)
            rows.append({"kind": "eval", "step": step, "tokens": step * TOKENS_PER_STEP, "val_loss": loss,
                         "val_ppl": math.exp(loss), "layers": layer_rows})
    if final_tokens is not None:
        rows[-1]["tokens"] = final_tokens
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    for variant, losses in FINAL_LOSSES.items():
        for seed, loss in enumerate(losses):
            write_run(tmp_path / "runs", variant, seed, loss)
    return tmp_path / "runs"


def welch_by_hand(a: list[float], b: list[float]) -> float:
    """Two-sided Welch p-value from the t statistic and Welch–Satterthwaite degrees of freedom."""
    from scipy.stats import t as student_t

    def mean_var(x: list[float]) -> tuple[float, float]:
        m = sum(x) / len(x)
        return m, sum((v - m) ** 2 for v in x) / (len(x) - 1)

    (ma, va), (mb, vb) = mean_var(a), mean_var(b)
    sa, sb = va / len(a), vb / len(b)
    t = (ma - mb) / math.sqrt(sa + sb)
    df = (sa + sb) ** 2 / (sa**2 / (len(a) - 1) + sb**2 / (len(b) - 1))
    return 2 * student_t.sf(abs(t), df)


def test_means_stds_and_welch_p_values(runs_root: Path) -> None:
    comparison = compare_runs([load_run(d) for d in expand_run_dirs([str(runs_root / "*")])])
    rows = {row.variant: row for row in comparison.rows}
    assert comparison.rows[0].variant == "swiglu+softmax"  # baseline first
    base, iso = rows["swiglu+softmax"], rows["isogmlp+softmax"]
    assert base.val_loss_mean == pytest.approx(4.9266666666666667, abs=1e-12)
    # sample std (ddof=1) of 4.927, 4.925, 4.928: sqrt(((0.3333e-3)^2 + (1.6667e-3)^2 + (1.3333e-3)^2) / 2)
    assert base.val_loss_std == pytest.approx(0.0015275252316519, rel=1e-9)
    assert iso.val_loss_std == pytest.approx(0.001, rel=1e-9)
    assert iso.p_value == pytest.approx(welch_by_hand(FINAL_LOSSES["isogmlp+softmax"],
                                                      FINAL_LOSSES["swiglu+softmax"]), rel=1e-9)
    assert 0 < iso.p_value < 1e-3
    assert math.isnan(base.p_value)
    single = rows["iso_ln+softmax"]  # one seed: no std, no p-value
    assert single.n == 1 and math.isnan(single.val_loss_std) and math.isnan(single.p_value)
    # stability: mean over seeds of the last train row's grad_norm_var_run (0.020, 0.021, 0.022)
    assert base.training_stability == pytest.approx(0.021, rel=1e-12)
    # tokens/s: per-run median of 1000*(seed+1) + step over steps 1..20 is 1000*(seed+1) + 10.5
    assert base.tokens_per_s == pytest.approx(2010.5, rel=1e-12)
    assert (base.params_total, base.params_non_embedding) == PARAMS["swiglu+softmax"]
    assert comparison.warnings == []


def test_table_and_csv(runs_root: Path, tmp_path: Path) -> None:
    comparison = compare_runs([load_run(d) for d in sorted(runs_root.iterdir())])
    table = format_table(comparison)
    baseline = "| swiglu+softmax | 83.0M | 12.5M | 4.9267 ± 0.0015 | 3 | 0 / 0 | baseline |"
    assert baseline + "  |" * 8 + " 0.021 | 2,010 |" in table
    assert "| iso_ln+softmax | 83.0M | 12.6M | 4.9000 | 1 | 0 / 0 | -0.0267" + " | n/a" * 8 + " |" in table
    assert "fewer than 2 seeds" in table
    assert "| Grad-norm variance after warmup ² |" in table and "in squared norm units" in table
    md, csv_path = write_comparison(comparison, tmp_path / "out")
    assert md.read_text() == table
    with csv_path.open() as f:
        rows = {row["variant"]: row for row in csv.DictReader(f)}
    assert rows.keys() == FINAL_LOSSES.keys()
    iso = rows["isogmlp+softmax"]
    assert (iso["n_seeds"], iso["seeds"], iso["params_total"]) == ("3", "0 1 2", "83100000")
    assert float(iso["val_loss_mean"]) == pytest.approx(4.948, abs=1e-12)
    p_iso = next(row.p_value for row in comparison.rows if row.variant == "isogmlp+softmax")
    assert float(iso["p_value"]) == pytest.approx(p_iso, rel=1e-12)
    # one convention: an undefined number is an empty cell (the std of one seed, the baseline's p; both were "nan")
    assert rows["iso_ln+softmax"]["val_loss_std"] == rows["swiglu+softmax"]["p_value"] == ""
    assert int(iso["final_tokens"]) == 20 * TOKENS_PER_STEP


def test_resumed_run_rows_are_deduplicated(tmp_path: Path) -> None:
    run = write_run(tmp_path, "swiglu+softmax", 0, 5.0)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    # a resume re-logs steps 16-20 with a different final eval, plus a truncated last line
    (run / "metrics.jsonl").write_text("\n".join(
        [*lines, json.dumps({"kind": "eval", "step": 20, "tokens": 20_000, "val_loss": 4.5, "layers": []}),
         '{"kind": "tra']) + "\n")
    record = load_run(run)
    assert record.final_val_loss == 4.5
    assert [row["step"] for row in record.evals] == [5, 10, 15, 20]


def test_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no metrics.jsonl"):
        load_run(tmp_path / "empty")
    run = write_run(tmp_path, "swiglu+softmax", 0, 5.0)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(line for line in lines if '"eval"' not in line) + "\n")
    assert load_run(run).status == "incomplete"  # it never evaluated: listed, never averaged
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(EvalError, match=r"metrics.jsonl: no meta row .* \(the file is empty\)"):
        load_run(run)
    with pytest.raises(FileNotFoundError, match=r"nothing\*: the pattern matches no run directory"):
        expand_run_dirs([str(tmp_path / "nothing*")])
    assert expand_run_dirs([str(tmp_path / "*")]) == [run]  # a glob skips folders without metrics.jsonl


def test_mixed_token_budgets_warn(tmp_path: Path) -> None:
    runs = [load_run(write_run(tmp_path, "swiglu+softmax", 0, 5.0)),
            load_run(write_run(tmp_path, "isogmlp+softmax", 0, 5.0, final_tokens=40_000, train__max_steps=40))]
    comparison = compare_runs(runs)
    assert any("different token counts" in w and "not a fair comparison" in w for w in comparison.warnings)
    assert "Warning: runs end at different token counts" in format_table(comparison)


def test_a_missing_baseline_is_named_with_the_rows(runs_root: Path) -> None:
    """The default baseline absent: a warning and no p-values; one asked for by name: an error listing the rows."""
    runs = [load_run(d) for d in sorted(runs_root.iterdir()) if not d.name.startswith("swiglu")]
    comparison = compare_runs(runs)
    assert all(math.isnan(row.p_value) for row in comparison.rows)
    assert any("baseline swiglu+softmax is not among the rows" in w for w in comparison.warnings)
    with pytest.raises(EvalError, match=r"^--baseline nope names no row; the rows are: 'iso_ln\+softmax', "
                                        r"'isogmlp\+softmax'$"):
        compare_runs(runs, baseline="nope")


def test_an_ffn_name_is_the_baseline_of_its_one_row(runs_root: Path) -> None:
    comparison = compare_runs([load_run(d) for d in sorted(runs_root.iterdir())], baseline="swiglu")
    assert comparison.baseline == "swiglu+softmax" and comparison.rows[0].variant == "swiglu+softmax"
    assert not math.isnan(next(row.p_value for row in comparison.rows if row.variant == "isogmlp+softmax"))


def test_plots_are_written(runs_root: Path, tmp_path: Path) -> None:
    paths = write_plots(group_runs([load_run(d) for d in sorted(runs_root.iterdir())]), tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["alpha.png", "grad_norm.png", "isotropy.png", "val_loss.png"]
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, path


def test_no_alpha_plot_without_alpha(tmp_path: Path) -> None:
    runs = [load_run(write_run(tmp_path, "swiglu+softmax", s, 5.0)) for s in range(2)]
    names = sorted(p.name for p in write_plots(group_runs(runs), tmp_path / "plots"))
    assert names == ["grad_norm.png", "isotropy.png", "val_loss.png"]


def test_ablations_and_other_settings_never_share_a_row(tmp_path: Path) -> None:
    """Rows are whole configurations minus the seed: an ablation (its own variant name) and a parent run
    with another lr or data order are separate rows; same-named rows say which fields differ."""
    runs = [load_run(write_run(tmp_path, "iso_mlp+softmax", s, 4.90 + 0.01 * s, model__iso_activation="tanh"))
            for s in range(2)]
    runs += [load_run(write_run(tmp_path, "iso_mlp[activation=relu]+softmax", s, 5.10 + 0.01 * s,
                                model__iso_activation="relu", dirname=f"relu_s{s}")) for s in range(2)]
    runs += [load_run(write_run(tmp_path, "iso_mlp+softmax", s, 4.95 + 0.01 * s, model__iso_activation="tanh",
                                train__lr=1e-3, dirname=f"lr_s{s}")) for s in range(2)]
    runs.append(load_run(write_run(tmp_path, "iso_mlp+softmax", 0, 4.97, model__iso_activation="tanh",
                                   data__seed=1, dirname="data1_s0")))
    rows = group_runs(runs)
    assert {label: [r.path.name for r in members] for label, members in rows.items()} == {
        "iso_mlp+softmax (data.seed=0, train.lr=0.003)": ["iso_mlp_softmax_s0", "iso_mlp_softmax_s1"],
        "iso_mlp+softmax (data.seed=0, train.lr=0.001)": ["lr_s0", "lr_s1"],
        "iso_mlp+softmax (data.seed=1, train.lr=0.003)": ["data1_s0"],
        "iso_mlp[activation=relu]+softmax": ["relu_s0", "relu_s1"],
    }
    comparison = compare_runs(runs, baseline="iso_mlp[activation=relu]+softmax")
    means = {row.variant: row.val_loss_mean for row in comparison.rows}
    assert means["iso_mlp[activation=relu]+softmax"] == pytest.approx(5.105)
    assert means["iso_mlp+softmax (data.seed=0, train.lr=0.003)"] == pytest.approx(4.905)


def test_seeds_that_differ_only_in_bookkeeping_share_a_row(tmp_path: Path) -> None:
    """Where a cache lives, how often rows and checkpoints are written or how long a stuck rank is waited for
    cannot change a run's numbers; the
    data workers can (ranks x workers sets the data order), so they split a row."""
    runs = [load_run(write_run(tmp_path, "swiglu+softmax", 0, 5.0, data__cache_dir="/node1/cache",
                               train__log_every=1, train__checkpoint_every=100))]
    runs.append(load_run(write_run(tmp_path, "swiglu+softmax", 1, 5.2, data__cache_dir="/node2/cache",
                                   train__log_every=10, train__keep_checkpoints=1, train__collective_timeout_s=60.0,
                                   train__stop_grace_s=30.0)))
    runs.append(load_run(write_run(tmp_path, "swiglu+softmax", 2, 5.4, data__num_workers=2, dirname="w2")))
    rows = group_runs(runs)
    assert {label: [r.seed for r in members] for label, members in rows.items()} == {
        "swiglu+softmax (data.num_workers=0)": [0, 1], "swiglu+softmax (data.num_workers=2)": [2]}
    assert compare_runs(runs, baseline="swiglu+softmax (data.num_workers=0)").rows[0].val_loss_mean == \
        pytest.approx(5.1)


@pytest.mark.parametrize("mismatch", ["params", "tokens"])
def test_a_mismatch_inside_a_row_is_an_error(tmp_path: Path, mismatch: str) -> None:
    runs = [load_run(write_run(tmp_path, "swiglu+softmax", 0, 5.0))]
    changed = {"params": {"params": (1, 1)}, "tokens": {"final_tokens": 10}}[mismatch]
    runs.append(load_run(write_run(tmp_path, "swiglu+softmax", 1, 5.0, **changed)))
    what = {"params": "params_total", "tokens": "final token count"}[mismatch]
    with pytest.raises(EvalError, match=rf"row swiglu\+softmax: .*differ in {what} \(swiglu_softmax_s0="):
        compare_runs(runs)


def two_baseline_rows(root: Path) -> list[Path]:
    """swiglu at two learning rates (so neither row is labelled plain swiglu+softmax), isogmlp at one."""
    dirs = [write_run(root, "swiglu+softmax", s, FINAL_LOSSES["swiglu+softmax"][s]) for s in range(3)]
    dirs += [write_run(root, "swiglu+softmax", s, 4.80 + 0.001 * s, train__lr=1e-3, dirname=f"lr_s{s}")
             for s in range(2)]
    dirs += [write_run(root, "isogmlp+softmax", s, FINAL_LOSSES["isogmlp+softmax"][s]) for s in range(3)]
    return dirs


def test_a_baseline_variant_of_several_rows_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = two_baseline_rows(tmp_path / "runs")
    runs = [load_run(d) for d in dirs]
    labels = (f"'swiglu+softmax (train.lr=0.001)' [{series_key(runs[3])}], "
              f"'swiglu+softmax (train.lr=0.003)' [{series_key(runs[0])}]")
    with pytest.raises(EvalError, match=rf"^baseline swiglu\+softmax names 2 rows \({re.escape(labels)}\); "
                                        r"pass one of these labels or keys as --baseline, or --tune train\.lr for "
                                        r"each variant at its best value$"):
        compare_runs(runs)
    assert main(["compare", *map(str, dirs), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: baseline swiglu+softmax names 2 rows ({labels}); pass one of these labels or keys as "
                   "--baseline, or --tune train.lr for each variant at its best value\n")
    assert not (tmp_path / "out").exists()


def test_a_full_row_label_is_a_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = two_baseline_rows(tmp_path / "runs")
    baseline = "swiglu+softmax (train.lr=0.003)"
    comparison = compare_runs([load_run(d) for d in dirs], baseline=baseline)
    assert comparison.baseline == baseline and comparison.warnings == []
    assert [row.variant for row in comparison.rows] == [baseline, "isogmlp+softmax",
                                                        "swiglu+softmax (train.lr=0.001)"]
    p = {row.variant: row.p_value for row in comparison.rows}
    assert p["isogmlp+softmax"] == pytest.approx(welch_by_hand(FINAL_LOSSES["isogmlp+softmax"],
                                                               FINAL_LOSSES["swiglu+softmax"]), rel=1e-9)
    assert p["swiglu+softmax (train.lr=0.001)"] == pytest.approx(
        welch_by_hand([4.800, 4.801], FINAL_LOSSES["swiglu+softmax"]), rel=1e-9)
    assert main(["compare", *map(str, dirs), "--out", str(tmp_path / "out"), "--no-plots",
                 "--baseline", baseline]) == 0
    out = capsys.readouterr().out
    assert f"| p vs {baseline} ¹ |" in out
    key = re.search(rf"^\| {re.escape(baseline)} \[(\w{{6}})\] \| 83.0M \| 12.5M \| 4.9267 ± 0.0015 \| 3 \| 0 / 0 \| "
                    r"baseline \|", out, re.MULTILINE)[1]
    assert "| isogmlp+softmax | 83.1M |" in out  # a label that is its variant name needs no key
    assert "- [key]: a short name of the row's configuration (less its size), which --baseline accepts." in out
    # the key printed in the table names the row as its whole label does
    by_key = compare_runs([load_run(d) for d in dirs], baseline=key)
    assert (by_key.baseline, [row.variant for row in by_key.rows]) == \
        (baseline, [row.variant for row in comparison.rows])


def test_plots_use_the_table_labels_and_colours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the lr=3e-3 isogmlp runs logged an alpha: grouped on their own they would be plain
    isogmlp+softmax, but the alpha plot labels them as the table does, in the table's colour."""
    runs = [load_run(write_run(tmp_path, "isogmlp+softmax", s, 4.95)) for s in range(2)]
    runs += [load_run(write_run(tmp_path, "isogmlp+softmax", s, 4.90, train__lr=1e-3, alpha=False,
                                dirname=f"lr_s{s}")) for s in range(2)]
    runs.append(load_run(write_run(tmp_path, "swiglu+softmax", 0, 5.0)))
    assert list(group_runs([r for r in runs if r.evals[-1]["layers"][1].get("alpha") is not None])) == \
        ["isogmlp+softmax"]  # what regrouping the subset would call the row
    comparison = compare_runs(runs)
    label = "isogmlp+softmax (train.lr=0.003)"
    assert label in comparison.groups
    figures: dict[str, plt.Figure] = {}

    def keep(fig: plt.Figure, path: Path) -> Path:  # instead of saving and closing the figure
        figures[path.name] = fig
        return path

    monkeypatch.setattr(plots, "_save", keep)
    try:
        write_plots(comparison.groups, tmp_path / "plots")
        final_alpha, *panels = figures["alpha.png"].axes
        assert [t.get_text() for t in final_alpha.get_legend().get_texts()] == [label, "band: seeds' min to max"]
        assert [ax.get_title().replace("\n", " ") for ax in panels] == [f"{label}: alpha over training"]  # wrapped
        val_loss = {line.get_label(): line.get_color() for line in figures["val_loss.png"].axes[0].get_lines()}
        assert list(val_loss) == [f"{row.variant} (n={row.n})" for row in comparison.rows]
        grad_norm = {line.get_label(): line.get_color() for line in figures["grad_norm.png"].axes[0].get_lines()}
        assert list(grad_norm) == [row.variant for row in comparison.rows]
        colour = matplotlib.colors.to_rgba(final_alpha.get_lines()[0].get_color())
        assert matplotlib.colors.to_rgba(grad_norm[label]) == colour
        assert matplotlib.colors.to_rgba(val_loss[f"{label} (n=2)"]) == colour
        assert len({matplotlib.colors.to_rgba(c) for c in grad_norm.values()}) == len(comparison.rows)
    finally:
        plt.close("all")


def test_seeds_of_the_run_scope_pool_and_pair_apart_from_the_init_scope(tmp_path: Path) -> None:
    """``data.seed: run`` runs of several seeds are one row (their data orders differ only through the seed), never
    pooled with ``data.seed: 0`` runs; a run-scope row pairs with the run-scope baseline (a pair's two runs share
    their seed, hence their data order), and the table and CSV say which scope each row's seeds used."""
    for s in range(3):
        write_run(tmp_path, "swiglu+softmax", s, 5.0 + 0.01 * s, data__seed="run")
        write_run(tmp_path, "isogmlp+softmax", s, 4.9 + 0.01 * s + 0.001 * s * s, data__seed="run")
        write_run(tmp_path, "swiglu+softmax", s, 5.2 + 0.01 * s, dirname=f"init_s{s}")
    runs = [load_run(path) for path in sorted(tmp_path.iterdir())]
    comparison = compare_runs(runs, baseline="swiglu+softmax (data.seed=run)")
    rows = {row.variant: row for row in comparison.rows}
    assert {label: (row.n, row.seed_scope) for label, row in rows.items()} == {
        "swiglu+softmax (data.seed=run)": (3, "run"), "isogmlp+softmax": (3, "run"),
        "swiglu+softmax (data.seed=0)": (3, "init")}
    gap = rows["isogmlp+softmax"].gap
    assert gap.p_paired < 0.05 and gap.gap == pytest.approx(-0.098333, abs=1e-6)  # the paired test applies
    table = format_table(comparison)
    assert "Seed scope: init (one data order for every run" in table and "; run (data.seed: run" in table
    write_comparison(comparison, tmp_path / "out")
    with (tmp_path / "out" / "comparison.csv").open() as f:
        assert {row["variant"]: row["seed_scope"] for row in csv.DictReader(f)} == {
            "swiglu+softmax (data.seed=run)": "run", "isogmlp+softmax": "run", "swiglu+softmax (data.seed=0)": "init"}
