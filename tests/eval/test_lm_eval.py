"""lm-evaluation-harness adapter on a tiny local multiple-choice task (offline: json dataset + task YAML)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from llm.eval.cli import main
from llm.eval.lm_eval_adapter import lm_eval_available

pytestmark = pytest.mark.skipif(
    not lm_eval_available(), reason="lm-eval is not installed (optional extra: pip install -e '.[lmeval]')")

DOCS = [
    {"question": "The sun rises in the", "choices": [" east", " west"], "answer": 0},
    {"question": "Water is", "choices": [" dry", " wet"], "answer": 1},
    {"question": "One plus one is", "choices": [" two", " three", " four"], "answer": 0},
]


def write_task(root: Path) -> Path:
    """A task YAML reading a local jsonl through the `json` dataset builder: no network."""
    root.mkdir()
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "tiny_mc.yaml").write_text(
        "task: isollm_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'docs.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return root


def test_lm_eval_on_local_task(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = write_task(tmp_path / "tasks")
    assert main(["lm-eval", str(trained_run), "--tasks", "isollm_tiny_mc", "--include-path", str(tasks),
                 "--no-default-tasks", "--batch-size", "2", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["isollm_tiny_mc"]
    # accuracy over 3 documents is a multiple of 1/3
    assert results["acc,none"] in {0.0, 1 / 3, 2 / 3, 1.0}
    assert not math.isnan(results["acc_stderr,none"])



def test_unknown_task_is_a_clear_error(trained_run: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    tasks = write_task(tmp_path / "tasks")
    assert main(["lm-eval", str(trained_run), "--tasks", "no_such_task", "--include-path", str(tasks),
                 "--no-default-tasks"]) == 2
    assert "unknown task(s) no_such_task" in capsys.readouterr().err
