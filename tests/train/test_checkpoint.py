"""Checkpoint atomicity, the ``latest`` pointer, keep-K, corrupt-checkpoint fallback and failed writes."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from tiny import checkpoint_weights, metrics_rows
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import llm.train.checkpoint as checkpoint
from llm.config import load_config, save_config
from llm.model import IsoLLMForCausalLM
from llm.train.checkpoint_files import (
    CheckpointError,
    CheckpointWarning,
    latest_checkpoint,
    verify_checkpoint,
    write_manifest,
)
from llm.train.setup import build_model
from llm.train.trainer import fit


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

    (ckpts / "latest").write_text("step_00000004\n")  # pointed back: eval.py still reads the newest, and says so
    with pytest.warns(CheckpointWarning, match=r"latest names step_00000004, older than step_00000006: using the "
                                               r"newest checkpoint that verifies"):
        assert latest_checkpoint(ckpts) == ckpts / "step_00000006"
    (ckpts / "latest").write_text("step_00000006\n")

    optimizer_file = ckpts / "step_00000006" / "state" / "optimizer.bin"
    optimizer_file.write_bytes(optimizer_file.read_bytes()[:100])  # a truncated write
    with pytest.warns(CheckpointWarning, match=r"skipping checkpoint .*step_00000006.*optimizer\.bin"):
        assert latest_checkpoint(ckpts) == ckpts / "step_00000004"

    (ckpts / "latest").write_text("step_00000099\n")  # a pointer to nothing: the newest that verifies, said
    with pytest.warns(CheckpointWarning, match=r"latest names step_00000099, which is not there"):
        assert latest_checkpoint(ckpts) == ckpts / "step_00000004"

    with pytest.warns(CheckpointWarning, match="step_00000006"):
        resumed = fit(tiny_config("train.max_steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=2",
                                  "resume=true"))
    assert resumed.step == 6
    assert metrics_rows(config.run_dir, "meta")[-1]["resumed_from"].endswith("step_00000004")
    verify_checkpoint(ckpts / "step_00000006")  # rewritten whole
    assert (ckpts / "latest").read_text().strip() == "step_00000006"


def test_a_checkpoint_that_holds_a_scheduler_state_resumes(tiny_config) -> None:
    """Checkpoints written while the schedule was a LambdaLR hold its state in state/scheduler.bin: a resume leaves
    it unread (the schedule is a function of the step and the config in force)."""
    config = tiny_config("train.max_steps=2")
    fit(config)
    ckpt = config.run_dir / "checkpoints" / "step_00000002"
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    torch.save(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0).state_dict(),
               ckpt / "state" / "scheduler.bin")
    (ckpt / "manifest.json").unlink()
    write_manifest(ckpt)  # listed in its manifest, as then
    assert fit(tiny_config("train.max_steps=3", "resume=true")).step == 3
    assert metrics_rows(config.run_dir, "meta")[-1]["resumed_from"] == str(ckpt)


@pytest.mark.parametrize("pointer_garbled", [False, True], ids=["pointer", "pointer-garbled"])
def test_failed_write_keeps_previous_checkpoint(pointer_garbled: bool, tiny_config,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails keeps the previous checkpoint and names it; with the pointer made unreadable as well
    (resume scans the directories then), the newest directory: before, "the previous checkpoint is intact: none",
    though step_2 was there."""
    real = checkpoint.save_config

    def save_config(config, path):
        if "step_00000004" in str(path):
            if pointer_garbled:
                (config.run_dir / "checkpoints" / "latest").write_bytes(b"\xff garbage")
            raise OSError(errno.ENOSPC, "No space left on device")
        real(config, path)

    monkeypatch.setattr(checkpoint, "save_config", save_config)
    config = tiny_config("train.max_steps=6", "train.checkpoint_every=2")
    message = r"step_00000004\.tmp.*No space left.*intact: .*checkpoints/step_00000002$"
    with pytest.raises(CheckpointError, match=message):
        fit(config)
    if pointer_garbled:
        return
    ckpts = config.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]  # no partial directory
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    verify_checkpoint(ckpts / "step_00000002")


def test_model_directory_loads_with_transformers(tiny_config, bpe: Path) -> None:
    result = fit(tiny_config("train.max_steps=2"))
    model_dir = result.last_checkpoint / "model"
    model = IsoLLMForCausalLM.from_pretrained(model_dir)
    saved = checkpoint_weights(result.last_checkpoint)
    assert set(model.state_dict()) - set(saved) == {"lm_head.weight"}  # tied: saved once
    for name, tensor in saved.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    # the weights are on disk once: accelerate's state/ holds the optimizer and RNG only (the schedule is a
    # function of the step: no scheduler state)
    assert sorted(p.name for p in (result.last_checkpoint / "state").iterdir()) == [
        "data_rank0.pt", "optimizer.bin", "random_states_0.pkl"]
    text = "The quick brown fox jumps over the lazy dog."
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert hf_tokenizer(text)["input_ids"] == Tokenizer.from_file(str(bpe)).encode(text).ids
    assert hf_tokenizer.eos_token == "<|endoftext|>"


@pytest.mark.parametrize("max_shard_size", ["50GB", "20KB"])
def test_exported_weights_load_back_exactly(tiny_overrides: list[str], tmp_path: Path,
                                            max_shard_size: str) -> None:
    """Resume reads the weights from model/ (one file, or shards for a big model) into the live model."""
    config = load_config(None, tiny_overrides)
    torch.manual_seed(0)
    trained = build_model(config.model)
    trained.save_pretrained(tmp_path, max_shard_size=max_shard_size)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (max_shard_size == "20KB")
    torch.manual_seed(1)
    restored = build_model(config.model)
    checkpoint._load_exported_weights(restored, tmp_path)
    for (name, expected), actual in zip(trained.state_dict().items(), restored.state_dict().values(),
                                        strict=True):
        assert torch.equal(actual, expected), name
    assert restored.lm_head.weight.data_ptr() == restored.model.embed_tokens.weight.data_ptr()

    untied = build_model(load_config(None, [*tiny_overrides, "model.tie_word_embeddings=false"]).model)
    with pytest.raises(CheckpointError, match=r"weights do not fit the model \(missing \['lm_head.weight'\]"):
        checkpoint._load_exported_weights(untied, tmp_path)


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


def test_truncate_metrics_keeps_unreadable_lines_aside(tmp_path: Path, capsys) -> None:
    """A cut middle line (an eval row torn by a kill, the next start's meta row appended to it) and a cut last line
    go to metrics.jsonl.damaged with one warning line; before, both were deleted without a word."""
    from llm.train.logging import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    torn_middle, torn_last = '{"kind": "eval", "step": 9, "val_lo{"kind": "meta", "step": 8}', '{"kind": "train", "st'
    rows = [{"kind": "meta", "step": 0}, {"kind": "train", "step": 1}]
    path.write_text(f"{json.dumps(rows[0])}\n{torn_middle}\n{json.dumps(rows[1])}\n{torn_last}")
    truncate_metrics(path, 2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    assert (tmp_path / "metrics.jsonl.damaged").read_text() == f"{torn_middle}\n{torn_last}\n"
    assert capsys.readouterr().err == (f"warning: {path}: 2 unreadable line(s) (line 2, 4) moved to "
                                       f"{path}.damaged, the other rows kept\n")


@pytest.mark.parametrize(("variant", "expected"), [
    ((), ("matched", 0.5)),  # swiglu reads neither: today's defaults
    (("model.ffn=iso_mlp", "model.iso_activation=relu", "model.ffn_init=paper", "model.iso_r0=1.0"), ("paper", 1.0)),
], ids=["swiglu", "iso_mlp_relu"])
def test_a_run_config_written_before_ffn_init_existed_reads_as_it_trained(
        tiny_config, tmp_path: Path, variant: tuple[str, ...], expected: tuple[str, float]) -> None:
    """An old run's config.yaml has no ffn_init (it trained with the papers' raw scales) and holds every option
    at the defaults of its time (iso_r0 1.0, iso_r_cap 8.0), read by its variant or not."""
    path = tmp_path / "config.yaml"
    save_config(tiny_config(*variant), path)  # as a run writes it, then aged
    old = path.read_text().replace("  ffn_init: matched\n", "").replace("  ffn_init: paper\n", "")
    old = old.replace("  iso_r0: 0.5\n", "  iso_r0: 1.0\n").replace("  iso_r_cap: 1.0\n", "  iso_r_cap: 8.0\n")
    assert "ffn_init" not in old and "iso_r_cap: 8.0" in old and "iso_r0: 1.0" in old
    path.write_text(old)
    with pytest.raises(ValueError, match="iso_r"):  # as a user's file it names options its variant does not read
        load_config(str(path))
    loaded = load_config(str(path), saved_run=True)
    assert (loaded.model.ffn_init, loaded.model.iso_r0, loaded.model.iso_r_cap) == (*expected, 1.0)


def test_a_file_missing_from_a_checkpoint_is_named(tmp_path) -> None:
    """A file the manifest lists but the directory lacks (a deleted tokenizer) is named as missing."""
    from llm.train.checkpoint_files import write_manifest

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    write_manifest(tmp_path)
    (tmp_path / "model" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"^\S+: model/tokenizer.json is missing \(its manifest.json lists it\)$"):
        verify_checkpoint(tmp_path)
