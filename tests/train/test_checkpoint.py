"""Checkpoint atomicity, the ``latest`` pointer, keep-K, corrupt-checkpoint fallback and failed writes."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import llm.train.checkpoint as checkpoint
from llm.model import IsoLLMForCausalLM
from llm.train.checkpoint import CheckpointError, CheckpointWarning, latest_checkpoint, verify_checkpoint
from llm.train.trainer import fit


def _meta_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "meta"]


def test_keep_k_pointer_and_truncated_checkpoint_fallback(tiny_config) -> None:
    config = tiny_config("train.max_steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=2")
    fit(config)
    ckpts = config.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000004", "step_00000006"]
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    for name in ("step_00000004", "step_00000006"):
        verify_checkpoint(ckpts / name)
        assert json.loads((ckpts / name / "trainer.json").read_text())["state"]["step"] == int(name[5:])
        assert {"model", "state", "trainer.json", "config.yaml", "manifest.json"} <= {
            p.name for p in (ckpts / name).iterdir()}
        assert (ckpts / name / "state" / "data_rank0.pt").is_file()

    optimizer_file = ckpts / "step_00000006" / "state" / "optimizer.bin"
    optimizer_file.write_bytes(optimizer_file.read_bytes()[:100])  # a truncated write
    with pytest.warns(CheckpointWarning, match=r"skipping checkpoint .*step_00000006.*optimizer\.bin"):
        assert latest_checkpoint(ckpts) == ckpts / "step_00000004"

    (ckpts / "latest").write_text("step_00000099\n")  # a pointer to nothing: fall back to scanning
    with pytest.warns(CheckpointWarning):
        assert latest_checkpoint(ckpts) == ckpts / "step_00000004"

    with pytest.warns(CheckpointWarning, match="step_00000006"):
        resumed = fit(tiny_config("train.max_steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=2",
                                  "resume=true"))
    assert resumed.step == 6
    assert _meta_rows(config.run_dir)[-1]["resumed_from"].endswith("step_00000004")
    verify_checkpoint(ckpts / "step_00000006")  # rewritten whole
    assert (ckpts / "latest").read_text().strip() == "step_00000006"


def test_failed_write_keeps_previous_checkpoint(tiny_config, monkeypatch: pytest.MonkeyPatch) -> None:
    real = checkpoint.save_config

    def save_config(config, path):
        if "step_00000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(config, path)

    monkeypatch.setattr(checkpoint, "save_config", save_config)
    config = tiny_config("train.max_steps=6", "train.checkpoint_every=2")
    with pytest.raises(CheckpointError, match=r"step_00000004\.tmp.*No space left.*intact: .*step_00000002"):
        fit(config)
    ckpts = config.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]  # no partial directory
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    verify_checkpoint(ckpts / "step_00000002")


def test_model_directory_loads_with_transformers(tiny_config, bpe: Path) -> None:
    result = fit(tiny_config("train.max_steps=2"))
    model_dir = result.last_checkpoint / "model"
    model = IsoLLMForCausalLM.from_pretrained(model_dir)
    saved = load_file(result.last_checkpoint / "state" / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    text = "The quick brown fox jumps over the lazy dog."
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert hf_tokenizer(text)["input_ids"] == Tokenizer.from_file(str(bpe)).encode(text).ids
    assert hf_tokenizer.eos_token == "<|endoftext|>"


def test_verify_rejects_missing_manifest(tmp_path: Path) -> None:
    (tmp_path / "step_00000001").mkdir()
    with pytest.raises(CheckpointError, match=r"manifest\.json"):
        verify_checkpoint(tmp_path / "step_00000001")
    assert latest_checkpoint(tmp_path / "nothing_here") is None


def test_truncate_metrics_keeps_meta_and_rows_up_to_step(tmp_path: Path) -> None:
    from llm.train.logging import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "meta", "step": 0}, {"kind": "train", "step": 1}, {"kind": "train", "step": 2},
            {"kind": "eval", "step": 2}, {"kind": "train", "step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tra')  # torn last line
    truncate_metrics(path, 2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4]
