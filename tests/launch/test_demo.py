"""``make demo``'s console: one line per stage or logged step of the two runs, with the time left."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("demo", REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log(run_dir: Path, *rows: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def train_row(step: int, tokens_per_s: float = 4096.0) -> dict:
    return {"kind": "train", "step": step, "tokens": 4096 * step, "loss": 8.0 - step / 100,
            "tokens_per_s": tokens_per_s}


def test_progress_has_the_step_of_all_and_the_time_left(demo, tmp_path: Path) -> None:
    run = tmp_path / "demo-swiglu"
    assert demo.progress(run) == "demo-swiglu: starting (tokenizer, model, validation set)"
    log(run, {"kind": "meta", "step": 0, "tokens": 0, "max_steps": 120})
    assert demo.progress(run) == "demo-swiglu: step 0/120"
    log(run, train_row(10), train_row(40, tokens_per_s=2048.0))  # 80 steps of 4,096 tokens at 2,048 tokens/s
    assert demo.progress(run) == "demo-swiglu: step 40/120 loss 7.600 ETA 2m40s"
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # a row being written is not read yet
    assert demo.progress(run) == "demo-swiglu: step 40/120 loss 7.600 ETA 2m40s"


class FakeTraining:
    """Both runs' processes: running for ``polls`` polls, logging ``events[poll] = (run_dir, step)`` as it goes."""

    def __init__(self, polls: int, events: dict[int, tuple[Path, int]]) -> None:
        self.polls, self.events, self.count = polls, events, 0
        for run_dir in {run_dir for run_dir, _ in events.values()}:
            log(run_dir, {"kind": "meta", "step": 0, "tokens": 0, "max_steps": 20})

    def poll(self) -> int | None:
        self.count += 1
        if self.count in self.events:
            run_dir, step = self.events[self.count]
            log(run_dir, train_row(step))
        return None if self.count <= self.polls else 0


def test_watch_prints_a_line_only_when_a_run_moved(demo, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    training = FakeTraining(12, {3: (a, 10), 5: (b, 10), 9: (a, 20)})
    demo.watch([(training, a), (training, b)], every_s=0)
    assert capsys.readouterr().out.splitlines() == [
        "demo: a: step 0/20 | b: step 0/20",
        "demo: a: step 10/20 loss 7.900 ETA 0m10s | b: step 0/20",
        "demo: a: step 10/20 loss 7.900 ETA 0m10s | b: step 10/20 loss 7.900 ETA 0m10s",
        "demo: a: step 20/20 loss 7.800 ETA 0m00s | b: step 10/20 loss 7.900 ETA 0m10s",
    ]


class Finished:
    """A training process that has exited with ``returncode``."""

    def __init__(self, cmd: list[str], returncode: int = 0, **_: object) -> None:
        self.args, self.returncode = cmd, returncode

    def poll(self) -> int:
        return self.returncode


def test_the_demo_trains_three_seeds_a_variant_and_compares_them_with_a_plan(demo, monkeypatch, tmp_path) -> None:
    """Three seeds per variant give the gap an interval, a verdict and a plan; one seed gives none of them."""
    started, called = [], []
    monkeypatch.setattr(demo, "REPO", tmp_path)
    monkeypatch.setattr(demo, "choose_source", lambda: (tmp_path / "text.jsonl", "a corpus", []))
    (tmp_path / "data_cache" / "demo").mkdir(parents=True)
    monkeypatch.setattr(demo, "DEMO_DATA", tmp_path / "data_cache" / "demo")
    (tmp_path / "data_cache" / "demo" / "bpe4096-text.json").write_text("{}")  # the tokenizer exists
    monkeypatch.setattr(demo.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or Finished(cmd))
    monkeypatch.setattr(demo.subprocess, "call", lambda cmd, **kw: called.append(cmd) or 0)
    monkeypatch.setattr(demo, "watch", lambda runs: None)
    assert demo.main([]) == 0
    names = [next(a for a in cmd if a.startswith("name=")) for cmd in started]
    assert names == [f"name=demo-{ffn}-s{seed}" for seed in (0, 1, 2) for ffn in ("swiglu", "isogmlp")]
    assert all(f"seed={name[-1]}" in cmd for name, cmd in zip(names, started, strict=True))
    *evaluations, compare = called
    assert [cmd[2] for cmd in evaluations] == [str(tmp_path / "runs" / f"demo-{f}-s0") for f in ("swiglu", "isogmlp")]
    assert compare[2:9] == ["compare", *(str(tmp_path / "runs" / n.removeprefix("name=")) for n in names)]
    assert compare[9:11] == ["--plan", "0.1"]
