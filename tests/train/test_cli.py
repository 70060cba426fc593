"""``train.py``: one-line errors with exit code 2 before any work, and SIGTERM -> checkpoint + exit 0."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from tiny import metrics_rows, start_train_py

from llm.cli.train import main
from llm.config import RunConfig, load_config, save_config


@pytest.mark.parametrize(("override", "field", "message"), [
    ("model.ffn=nope", "model.ffn", "unknown value 'nope'"),
    ("train.lr=-1", "train.lr", "expected a finite positive number"),
    ("train.nope=1", "train.nope", "unknown key"),
    ("model.iso_ln_alpha=1.5", "model.iso_ln_alpha", "has no effect: it is an option of ffn=iso_ln"),
    ("resume=[", "resume", "'[' is not a YAML value"),
    ("model.rope_parameters=[1,2]", "model.rope_parameters", "a list where a mapping is expected"),
    # seeds by range, every seed field: tracebacks before (-1, -5 after config.yaml was written; 1e20 at the first eval)
    ("seed=-5", "seed", "expected an integer in [0, 2**32), got -5"),
    ("data.seed=-1", "data.seed", "expected an integer in [0, 2**32), got -1"),
    ("data.seed=99999999999999999999", "data.seed", "expected an integer in [0, 2**32), got 99999999999999999999"),
    ("seed=4294967296", "seed", "expected an integer in [0, 2**32)"),
])
def test_bad_config_is_one_line_exit_2(override: str, field: str, message: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    assert main([f"out_dir={tmp_path}", "train.max_steps=1", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {field}: ") and message in err
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_a_list_for_a_mapping_in_a_config_file_is_one_line(tmp_path: Path, capsys) -> None:
    """As on the command line: the key named, not OmegaConf's TypeError traceback."""
    (path := tmp_path / "bad.yaml").write_text("model:\n  rope_parameters: [1, 2]\n")
    assert main(["--config", str(path), f"out_dir={tmp_path / 'runs'}", "train.max_steps=1"]) == 2
    assert capsys.readouterr().err == ("error: model.rope_parameters: a list where a mapping is expected, or the "
                                       "reverse\n")


def test_overrides_may_follow_an_option(tmp_path: Path, capsys) -> None:
    """``train.py model.ffn=swiglu --config FILE model.ffn=nope``: every override is read, wherever it stands
    (argparse's plain parse stops filling a positional list at the first option and refuses the rest)."""
    (path := tmp_path / "run.yaml").write_text("train:\n  max_steps: 1\n")
    assert main([f"out_dir={tmp_path / 'runs'}", "--config", str(path), "model.ffn=nope"]) == 2
    assert capsys.readouterr().err.startswith("error: model.ffn: unknown value 'nope'")


def test_missing_config_file(tmp_path: Path, capsys) -> None:
    assert main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err.startswith("error: config: no such config file")


def test_batch_that_does_not_divide_fails_before_work(tiny_config, capsys) -> None:
    config = tiny_config()
    args = [f"data.source={config.data.source}", f"data.tokenizer={config.data.tokenizer}",
            f"out_dir={config.out_dir}", "train.max_steps=2", "train.global_batch_tokens=1000",
            "train.micro_batch_size=4", "data.seq_len=32", "trackers=[]"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train.global_batch_tokens: 1000 is not a positive multiple")
    assert not Path(config.out_dir).exists()


def test_resume_by_name_of_no_run_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``name=nosuch resume=true`` without --config names where it looked for the run rather than starting a default
    one; a new run whose overrides name its data starts with resume=true, as a requeued job's first launch does."""
    started: list[RunConfig] = []
    monkeypatch.setattr("llm.train.trainer.fit", started.append)
    args = [f"out_dir={tmp_path}", "name=nosuch", "resume=true", "train.max_steps=3"]
    assert main(args) == 2 and not started
    assert capsys.readouterr().err == (f"error: name: no run 'nosuch' to resume: {tmp_path / 'nosuch' / 'config.yaml'}"
                                       " does not exist (a new run with resume=true: give its --config, "
                                       "data.source or data.prepared)\n")
    assert main([*args, f"data.source={tmp_path / 'corpus.txt'}"]) == 0
    assert started[0].data.source == str(tmp_path / "corpus.txt") and started[0].resume is True


@pytest.mark.parametrize("resume", ["yes", "on", "ON", "restart"])
def test_every_true_resume_value_resumes_by_name(resume: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``resume=yes`` and ``resume=on`` are true to the config, so they continue the named run as true does."""
    (tmp_path / "x").mkdir()
    save_config(load_config(None, [f"out_dir={tmp_path}", "name=x", "model.ffn=isogmlp", "train.max_steps=2"]),
                tmp_path / "x" / "config.yaml")
    started: list[RunConfig] = []
    monkeypatch.setattr("llm.train.trainer.fit", started.append)
    assert main([f"out_dir={tmp_path}", "name=x", f"resume={resume}", "train.max_steps=3"]) == 0
    assert started[0].model.ffn == "isogmlp" and started[0].train.max_steps == 3
    assert started[0].resume == ("restart" if resume == "restart" else True)


@pytest.mark.slow
def test_subprocess_exit_code_for_bad_value(tmp_path: Path) -> None:
    proc = start_train_py(tmp_path, "model.ffn=nope")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.strip().splitlines() == [err.strip()] and err.startswith("error: model.ffn: ")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_0(run_overrides: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "sig"
    proc = start_train_py(tmp_path, *run_overrides, "name=sig", "train.max_steps=100000",
                          "train.checkpoint_every=100000")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        if sum('"kind": "train"' in line for line in lines) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    last = metrics_rows(run_dir)[-1]
    pointer = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert pointer == f"step_{last['step']:08d}"
    saved = json.loads((run_dir / "checkpoints" / pointer / "trainer.json").read_text())["state"]
    assert saved["step"] == last["step"] >= 3


def test_resume_by_name_reads_the_runs_config_and_applies_the_overrides_on_top(run_overrides: list[str],
                                                                                tmp_path: Path, monkeypatch) -> None:
    """``train.py name=X resume=true`` without --config continues runs/X from its config.yaml, the overrides on top,
    in the directory where it found it: here a run directory moved after its first steps."""
    assert main([*run_overrides, "train.max_steps=2"]) == 0
    (tmp_path / "moved").mkdir()
    (tmp_path / "runs").rename(tmp_path / "moved" / "runs")
    monkeypatch.chdir(tmp_path / "moved")
    assert main(["name=tiny", "resume=true", "train.max_steps=3"]) == 0
    rows = metrics_rows(tmp_path / "moved" / "runs" / "tiny")
    assert [(r["kind"], r["step"]) for r in rows if r["kind"] != "eval"] == [
        ("meta", 0), ("train", 1), ("train", 2), ("meta", 2), ("train", 3)]
    first, resumed = (r for r in rows if r["kind"] == "meta")
    assert resumed["max_steps"] == 3 and resumed["config"]["out_dir"] == "runs"
    assert {k: v for k, v in resumed["config"].items() if k not in ("out_dir", "resume", "train")} == {
        k: v for k, v in first["config"].items() if k not in ("out_dir", "resume", "train")}
    assert not (tmp_path / "runs").exists()
