"""The model card names its training data only when the run's metrics show training on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import TINY_MODEL

from llm.config import load_config, save_config
from llm.hf.card import model_card, run_summary


def _checkpoint(root: Path, source: str, train_rows: list[dict]) -> Path:
    """runs/NAME/checkpoints/step_X with the files ``run_summary`` reads, and ``train_rows`` in metrics.jsonl."""
    config = load_config(None, [*TINY_MODEL, f"data.source={source}", "train.max_steps=2"])
    step = max((row["step"] for row in train_rows), default=0)
    checkpoint = root / "checkpoints" / f"step_{step:08d}"
    checkpoint.mkdir(parents=True)
    save_config(config, checkpoint / "config.yaml")
    (checkpoint / "trainer.json").write_text(json.dumps({"state": {"step": step, "tokens": 64 * step}}))
    rows = [{"kind": "meta", "step": 0, "tokens": 0}, *({"kind": "train", **row} for row in train_rows)]
    (root / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return checkpoint


@pytest.mark.parametrize("source", ["HuggingFaceFW/fineweb", "../shared/data/fineweb-sample"])
def test_a_trained_models_card_names_its_data(tmp_path: Path, source: str) -> None:
    run = run_summary(_checkpoint(tmp_path, source, [{"step": 1, "tokens": 64, "loss": 6.0}]))
    assert run.data == source
    card = model_card(load_config(None, [*TINY_MODEL, "train.max_steps=2"]).model, repo_id="me/m", run=run)
    assert f"pretrained on FineWeb (`{source}`)" in card
    assert 'datasets: ["HuggingFaceFW/fineweb"]' in card and "The FineWeb Datasets" in card


def test_a_model_trained_on_other_text_names_that_text(tmp_path: Path) -> None:
    run = run_summary(_checkpoint(tmp_path, "/data/wiki.train.raw", [{"step": 1, "tokens": 64, "loss": 6.0}]))
    card = model_card(load_config(None, [*TINY_MODEL, "train.max_steps=2"]).model, repo_id="me/m", run=run)
    assert "pretrained on text (`/data/wiki.train.raw`)" in card
    assert "FineWeb" not in card and "datasets:" not in card


@pytest.mark.parametrize("with_run", [True, False])
def test_an_untrained_models_card_names_no_training_data(tmp_path: Path, with_run: bool) -> None:
    run = run_summary(_checkpoint(tmp_path, "HuggingFaceFW/fineweb", [])) if with_run else None
    assert run is None or run.data is None
    card = model_card(load_config(None, [*TINY_MODEL, "train.max_steps=2"]).model, repo_id="me/m", run=run)
    assert "pretrained on" not in card and "FineWeb" not in card and "datasets:" not in card
