"""``isollm-hub push``: the staged folder and model card, offline; only HfApi's upload calls are replaced."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import HfApi
from tiny import TINY_MODEL, metrics_rows

from llm.cli.hub import main
from llm.data import eos_id, load_tokenizer
from llm.hf.card import ATTENTION_EQUATIONS, FFN_EQUATIONS, LINEAR_EQUATIONS, run_summary
from llm.model import ModelConfig, param_counts
from llm.model.attention import ATTN_SCORING_REGISTRY
from llm.model.ffn import FFN_REGISTRY
from llm.model.linear import LINEAR_REGISTRY

REPO_ID = "someone/isollm-tiny"


@pytest.fixture(scope="module")
def run_dir(fineweb: Path, bpe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/tiny: a swiglu+softmax model (the --qwen3 export needs one) after 2 steps, evaluated at the end."""
    from accelerate.state import AcceleratorState, GradientState

    from llm.config import load_config
    from llm.train.trainer import fit

    root = tmp_path_factory.mktemp("push_run")
    config = load_config(None, [
        f"data.source={fineweb}", f"data.tokenizer={bpe}", f"data.cache_dir={root / 'data_cache'}",
        f"out_dir={root / 'runs'}", "name=tiny", *TINY_MODEL, "data.val_bucket=50", "data.val_tokens=1024",
        "train.max_steps=2", "train.warmup_steps=1", "train.micro_batch_size=2", "train.global_batch_tokens=64",
        "train.eval_every=2", "train.checkpoint_every=2", "train.isotropy_samples=32", "train.grad_norm_window=2"])
    try:
        return fit(config).run_dir
    finally:  # accelerate's process-wide singletons would leak into later in-process runs
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """HfApi's create_repo / create_branch / upload_folder, recorded; the uploaded folder copied aside."""
    calls: dict = {"uploaded": tmp_path / "uploaded"}

    def record(name):
        def method(self, *args, **kwargs):
            calls[name] = kwargs
            if name == "upload_folder":
                shutil.copytree(kwargs["folder_path"], calls["uploaded"])
                return "https://huggingface.co/someone/isollm-tiny/commit/0"
        return method

    for name in ("create_repo", "create_branch", "upload_folder"):
        monkeypatch.setattr(HfApi, name, record(name))
    monkeypatch.setattr("llm.hub_access.hub_unreachable", lambda: None)  # the recorded hub answers
    return calls


def front_matter(card: str) -> dict[str, object]:
    head = card.split("---\n")[1]
    return {key: json.loads(value) for key, value in (line.split(": ", 1) for line in head.splitlines())}


def test_push_uploads_the_checkpoint_model_directory_and_its_card(run_dir: Path, hub: dict,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from llm.eval.evaluate import evaluate_checkpoint

    assert main(["push", str(run_dir), REPO_ID, "--private", "--revision", "v1"]) == 0
    assert hub["create_repo"] == {"repo_type": "model", "private": True, "exist_ok": True}
    assert hub["create_branch"]["branch"] == "v1"
    assert hub["upload_folder"]["repo_id"] == REPO_ID and hub["upload_folder"]["revision"] == "v1"
    assert f"pushed {REPO_ID}: https://huggingface.co/" in capsys.readouterr().out

    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    uploaded = hub["uploaded"]
    model_files = sorted(p.name for p in (checkpoint / "model").iterdir())
    assert sorted(p.name for p in uploaded.iterdir()) == sorted([*model_files, "README.md"])
    for name in model_files:
        assert (uploaded / name).read_bytes() == (checkpoint / "model" / name).read_bytes(), name
    eos = eos_id(load_tokenizer(str(uploaded)))  # a checkpoint's model/ is a complete hub directory
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((uploaded / name).read_text())
        assert (saved["eos_token_id"], saved["pad_token_id"]) == (eos, eos), name

    card = (uploaded / "README.md").read_text()
    assert front_matter(card) == {
        "library_name": "transformers", "license": "apache-2.0", "language": ["en"],
        "pipeline_tag": "text-generation", "datasets": ["HuggingFaceFW/fineweb"],
        "tags": ["isollm", "custom_code", "swiglu", "softmax"]}
    config = ModelConfig(**{k: v for k, v in json.loads((uploaded / "config.json").read_text()).items()
                            if k in ModelConfig.field_names()})
    total, non_embedding = param_counts(config)
    assert f"| {total:,} | {non_embedding:,} | 2 | 32 | 64 |" in card
    assert "# isollm swiglu+softmax (tiny)" in card and FFN_EQUATIONS["swiglu"] in card
    assert ATTENTION_EQUATIONS["softmax"] in card and LINEAR_EQUATIONS["linear"] in card
    state = json.loads((checkpoint / "trainer.json").read_text())["state"]
    assert f"- tokens seen: {state['tokens']:,} ({state['step']:,} optimizer steps)" in card
    final_eval = metrics_rows(run_dir, "eval")[-1]
    assert f"- final validation loss: {final_eval['val_loss']:.4f} nats/token" in card
    # eval.py measures the same loss on the same windows: the card's bits per byte are its figure
    report = evaluate_checkpoint(str(run_dir), samples=0, device="cpu")
    assert f"- bits per byte: {report.bits_per_byte:.4f} (" in card
    assert (checkpoint / "config.yaml").read_text().rstrip() in card
    assert f'AutoModelForCausalLM.from_pretrained("{REPO_ID}", trust_remote_code=True)' in card
    assert "Qwen3 Technical Report" in card and "FineWeb" in card


def test_save_for_hub_writes_the_card_push_writes(run_dir: Path, hub: dict, tmp_path: Path) -> None:
    from llm.data import load_tokenizer
    from llm.hf import save_for_hub
    from llm.hf.card import val_bits_per_byte
    from llm.model import IsoLLMForCausalLM

    assert main(["push", str(run_dir), REPO_ID]) == 0
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    run = run_summary(checkpoint)
    run.bits_per_byte = val_bits_per_byte(checkpoint, run.val_loss)
    model = IsoLLMForCausalLM.from_pretrained(checkpoint / "model")
    saved = save_for_hub(model, tmp_path / "saved", load_tokenizer(str(checkpoint / "model")), run=run,
                         repo_id=REPO_ID)
    assert (saved / "README.md").read_text() == (hub["uploaded"] / "README.md").read_text()


def test_push_qwen3_uploads_the_stock_export_and_says_so(run_dir: Path, hub: dict) -> None:
    assert main(["push", str(run_dir / "checkpoints"), REPO_ID, "--qwen3"]) == 2  # not a run: one line, exit 2
    assert main(["push", str(run_dir), REPO_ID, "--qwen3"]) == 0
    uploaded = hub["uploaded"]
    assert json.loads((uploaded / "config.json").read_text())["model_type"] == "qwen3"
    assert not any(p.suffix == ".py" for p in uploaded.iterdir())
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"} <= {
        p.name for p in uploaded.iterdir()}
    card = (uploaded / "README.md").read_text()
    assert front_matter(card)["tags"] == ["isollm", "qwen3", "swiglu", "softmax"]
    assert f'AutoModelForCausalLM.from_pretrained("{REPO_ID}")  # stock Qwen3ForCausalLM' in card


def test_stage_keeps_the_upload_and_refuses_a_used_directory(run_dir: Path, hub: dict, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    stage = tmp_path / "stage"
    assert main(["push", str(run_dir), REPO_ID, "--stage", str(stage)]) == 0
    assert sorted(p.name for p in stage.iterdir()) == sorted(p.name for p in hub["uploaded"].iterdir())
    assert main(["push", str(run_dir), REPO_ID, "--stage", str(stage)]) == 2
    assert capsys.readouterr().err == f"error: --stage {stage}: not empty (everything in it would be uploaded)\n"


@pytest.mark.parametrize("qwen3", [False, True])
def test_a_model_directory_whose_config_disagrees_with_its_weights_is_refused_before_upload(
        run_dir: Path, hub: dict, tmp_path: Path, qwen3: bool, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(run_dir / "checkpoints" / "step_00000002" / "model", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    assert main(["push", str(model_dir), REPO_ID, *(["--qwen3"] if qwen3 else [])]) == 2
    assert capsys.readouterr().err.startswith(f"error: {model_dir}: config.json's intermediate_size=128 does not "
                                              "fit its weights (model.layers.0.mlp.")
    assert "upload_folder" not in hub


def test_a_refused_upload_is_one_line_and_exit_1(run_dir: Path, hub: dict, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(self, *args, **kwargs):
        raise ConnectionError("Max retries exceeded with url: /api/repos/create\nmore lines")

    monkeypatch.setattr(HfApi, "create_repo", refuse)
    assert main(["push", str(run_dir), REPO_ID]) == 1
    assert capsys.readouterr().err == (f"error: push to {REPO_ID} failed: Max retries exceeded with url: "
                                       "/api/repos/create\n")


def test_the_card_has_an_equation_for_every_variant_choice() -> None:
    assert FFN_EQUATIONS.keys() == FFN_REGISTRY.keys()
    assert ATTENTION_EQUATIONS.keys() == ATTN_SCORING_REGISTRY.keys()
    assert LINEAR_EQUATIONS.keys() == LINEAR_REGISTRY.keys()


def test_run_summary_reads_the_last_eval_up_to_the_checkpoint_as_compare_does(tmp_path: Path) -> None:
    """A step re-logged after a resume supersedes the earlier row, an eval after the checkpoint's step is not
    its loss, and a last line cut short by a killed run is skipped; without an eval row the loss is None."""
    run_dir = tmp_path / "runs" / "tiny"
    checkpoint = run_dir / "checkpoints" / "step_4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer.json").write_text(json.dumps({"state": {"step": 4, "tokens": 256}}))
    (checkpoint / "config.yaml").write_text(config := "name: tiny\ndata:\n  source: fineweb\n")
    meta = {"kind": "meta", "step": 0, "tokens": 0, "variant": "swiglu+softmax",
            "config": {"model": {}, "data": {}, "train": {}}}
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in [
        meta,
        {"kind": "eval", "step": 2, "tokens": 128, "val_loss": 5.0},
        {"kind": "eval", "step": 4, "tokens": 256, "val_loss": 4.0},
        {"kind": "eval", "step": 4, "tokens": 256, "val_loss": 3.5},  # the resumed run's
        {"kind": "eval", "step": 6, "tokens": 384, "val_loss": 3.0},
    ]) + '{"kind": "eval", "st')
    run = run_summary(checkpoint)
    assert (run.name, run.step, run.tokens, run.config, run.val_loss) == ("tiny", 4, 256, config, 3.5)
    assert run.data == "fineweb"  # trained (256 tokens in the checkpoint): its data is named
    metrics.write_text(json.dumps(meta) + "\n")
    assert run_summary(checkpoint).val_loss is None
    metrics.unlink()
    assert run_summary(checkpoint).val_loss is None
    assert run_summary(checkpoint).data == "fineweb"  # without metrics.jsonl too: the checkpoint says it trained


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:  # bound, never listening: connections are refused at once
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("command", ["push", "eval", "data"])
def test_an_unreachable_hub_is_one_line_within_seconds(command: str, run_dir: Path, tmp_path: Path) -> None:
    """With no hub and no HF_HUB_OFFLINE, huggingface_hub would retry for 25-30 s; a probe answers at once, and the one
    line names the repository, HF_HUB_OFFLINE or what was not uploaded.

    The behaviour is checked, not a time (a wall-clock bound failed on a machine shared with two other jobs: the command
    took 36 s, its offline reference run 15.8): no request was retried, which huggingface_hub logs as "Retrying in Ns"
    before each backoff. A hang of another kind fails by the subprocess's timeout, 120 s, generous because it only has
    to tell a hang from a slow start."""
    import os
    import subprocess
    import sys

    argv = {"push": ["-m", "llm.cli.hub", "push", str(run_dir), REPO_ID],
            "eval": ["eval.py", "someone/not-cached-model", "--samples", "0"],
            "data": ["-m", "llm.cli.data", "plan", "someone/not-cached-dataset", "--world-size", "1"]}[command]
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_VERBOSITY": "warning"}  # the level of the hub's retry lines
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run([sys.executable, *argv], cwd=Path(__file__).parents[2], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert "Retrying in" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error: " in line]  # isollm-data: "isollm-data plan: error:"
    assert done.returncode != 0 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    expected = {"push": f"error: push to {REPO_ID}: could not reach the hub (127.0.0.1:",
                "eval": "error: someone/not-cached-model: cannot load the model (",
                "data": "error: data.source: cannot resolve 'someone/not-cached-dataset'"}[command]
    assert expected in errors[0]
    assert ("nothing was uploaded" in errors[0]) if command == "push" else ("HF_HUB_OFFLINE" in errors[0])
