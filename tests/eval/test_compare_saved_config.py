"""compare reads each run's saved config as it was written: a field the run's code did not have yet is "not recorded",
never today's default; the model section is read as an old checkpoint is; a config today's code cannot read is one
line naming the file."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from test_compare import write_run

from llm.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from llm.eval.compare import compare_runs
from llm.eval.errors import EvalError
from llm.eval.grouping import group_runs
from llm.eval.runs import load_run


def test_a_run_without_its_config_is_refused(tmp_path: Path) -> None:
    run = write_run(tmp_path, "swiglu+softmax", 0, 5.0)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    del rows[0]["config"]["train"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(EvalError, match=r"metrics.jsonl: the meta row has no 'config' with the model, data, train"):
        load_run(run)


def saved_config(seed: int, **model: Any) -> dict[str, Any]:
    """A meta row's ``config`` as today's trainer writes it: every field of every section."""
    return asdict(RunConfig(seed=seed, model=ModelConfig(hidden_size=64, num_attention_heads=4, **model),
                            data=DataConfig(seq_len=128), train=TrainConfig(lr=3e-3, max_steps=20)))


def as_written_before_ffn_init(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as older code wrote its model: no ``ffn_init`` (the raw scales) and the option defaults of that
    time (R_0 and R_inf in units of the raw formulas)."""
    model = {key: value for key, value in config["model"].items() if key != "ffn_init"}
    model.update(iso_r0=1.0, iso_r_cap=8.0)
    return {**config, "model": model}


def test_old_models_group_by_what_they_compute(tmp_path: Path) -> None:
    """A model section written before fields existed is read as the model reads an old checkpoint: a swiglu run's
    unread old option defaults are today's (one row with new runs); an iso_mlp run from before ffn_init trained
    with the raw scales, so it is iso_mlp[init=paper], not a seed of a new (matched) iso_mlp run, but a seed of a
    new run that asks for the raw scales."""
    runs = [load_run(write_run(tmp_path, "swiglu+softmax", 0, 5.0, config=saved_config(0)))]
    runs += [load_run(write_run(tmp_path, "swiglu+softmax", s, 5.0 + 0.2 * s,
                                config=as_written_before_ffn_init(saved_config(s)))) for s in (1, 2)]
    runs += [load_run(write_run(tmp_path, "iso_mlp+softmax", s, 4.9 + 0.01 * s, dirname=f"old_iso_s{s}",
                                config=as_written_before_ffn_init(saved_config(s, ffn="iso_mlp"))))
             for s in (0, 1)]
    runs.append(load_run(write_run(tmp_path, "iso_mlp[init=paper]+softmax", 2, 4.93, dirname="paper_iso_s2",
                                   config=saved_config(2, ffn="iso_mlp", ffn_init="paper"))))
    runs += [load_run(write_run(tmp_path, "iso_mlp+softmax", s, 4.8 + 0.01 * s, dirname=f"new_iso_s{s}",
                                config=saved_config(s, ffn="iso_mlp"))) for s in (0, 1)]
    old_iso = runs[3]
    assert old_iso.meta["variant"] == "iso_mlp+softmax"  # as the old code named it
    assert (old_iso.config.model.ffn_init, old_iso.config.model.iso_r0) == ("paper", 0.5)  # tanh reads no R_0
    rows = group_runs(runs)
    assert {label: [r.path.name for r in members] for label, members in rows.items()} == {
        "iso_mlp+softmax": ["new_iso_s0", "new_iso_s1"],
        "iso_mlp[init=paper]+softmax": ["old_iso_s0", "old_iso_s1", "paper_iso_s2"],
        "swiglu+softmax": ["swiglu_softmax_s0", "swiglu_softmax_s1", "swiglu_softmax_s2"],
    }
    means = {row.variant: row.val_loss_mean for row in compare_runs(runs).rows}
    assert means["swiglu+softmax"] == pytest.approx(5.2)


def test_a_field_a_run_did_not_record_is_not_todays_default(tmp_path: Path) -> None:
    """Runs saved before train.tf32 existed ran at whatever their code did, which today's default need not be:
    "not recorded" is their own value, whatever the field (no rule per field), so they pool with each other and
    never with the runs that recorded tf32=True."""
    def before_tf32(seed: int) -> dict[str, Any]:
        config = saved_config(seed)
        del config["train"]["tf32"], config["data"]["max_doc_chars"]
        return config

    runs = [load_run(write_run(tmp_path, "swiglu+softmax", s, 5.0 + 0.01 * s, dirname=f"old_s{s}",
                               config=before_tf32(s))) for s in range(2)]
    runs += [load_run(write_run(tmp_path, "swiglu+softmax", s, 4.0 + 0.01 * s, dirname=f"{tf32}_s{s}",
                                config=saved_config(s) | {"train": {**saved_config(s)["train"], "tf32": tf32}}))
             for s in range(2) for tf32 in (True, False)]
    assert runs[0].config.train.tf32 is False  # what today's code resumes it at: as it trained (no TF32 before it)
    rows = group_runs(runs)
    assert {label: [r.path.name for r in members] for label, members in rows.items()} == {
        "swiglu+softmax (data.max_doc_chars=not recorded, train.tf32=not recorded)": ["old_s0", "old_s1"],
        f"swiglu+softmax (data.max_doc_chars={DataConfig.max_doc_chars}, train.tf32=False)": ["False_s0", "False_s1"],
        f"swiglu+softmax (data.max_doc_chars={DataConfig.max_doc_chars}, train.tf32=True)": ["True_s0", "True_s1"],
    }


def test_a_saved_section_today_cannot_read_is_one_line(tmp_path: Path) -> None:
    for name, (section, key, value) in {"unknown": ("model", "ffn_width", 3),
                                        "mistyped": ("train", "warmup_steps", "long")}.items():
        config = saved_config(0)
        config[section][key] = value
        run = write_run(tmp_path, "swiglu+softmax", 0, 5.0, config=config, dirname=name)
        with pytest.raises(EvalError) as err:
            load_run(run)
        message = str(err.value)
        assert message.startswith(f"{run / 'metrics.jsonl'}: today's code cannot read back the meta row's "
                                  f"config: {section}.{key}: "), message
        assert "\n" not in message
