"""eval.py on a checkpoint the trainer wrote: exact reproduction of the logged numbers, bits per byte, CLI."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import llm.cli.eval as cli
from llm.cli.eval import main
from llm.eval.evaluate import (
    bits_per_byte,
    evaluate_checkpoint,
    generate_samples,
    load_model,
    resolve_checkpoint,
    token_byte_lengths,
)

REPO = Path(__file__).resolve().parents[2]
MULTILINGUAL = "Grüße, naïve café — 東京で寿司 🍣! Ελληνικά, русский.\n\tTabs and  spaces  "


def eval_rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if row["kind"] == "eval"}


def test_reproduces_logged_val_loss_and_layers_exactly(trained_run: Path) -> None:
    logged = eval_rows(trained_run)
    report = evaluate_checkpoint(str(trained_run), samples=0)  # run dir -> latest checkpoint (step 4)
    assert report.step == 4 and report.variant == "isogmlp+softmax"
    assert report.val_loss == logged[4]["val_loss"]  # the trainer's own number, bit for bit
    assert report.val_ppl == logged[4]["val_ppl"]
    assert report.layers == logged[4]["layers"]
    assert "alpha" in report.layers[1] and "alpha" not in report.layers[0]
    # an older checkpoint directory, and a model/ directory, reproduce their own step
    older = evaluate_checkpoint(str(trained_run / "checkpoints" / "step_00000002" / "model"), samples=0)
    assert older.step == 2 and older.val_loss == logged[2]["val_loss"]


def test_bits_per_byte_is_loss_times_tokens_over_bytes(trained_run: Path) -> None:
    report = evaluate_checkpoint(str(trained_run), samples=0)
    assert report.bits_per_byte == pytest.approx(
        report.val_loss * report.val_tokens / (math.log(2) * report.val_bytes), rel=1e-15)
    # independent reference: fp64 per-token losses summed over the same windows, bytes from decoding
    from llm.config import load_config
    from llm.data import build_val_windows, load_tokenizer

    resolved = resolve_checkpoint(str(trained_run))
    config = load_config([str(resolved.config_file)])
    tokenizer = load_tokenizer(resolved.model_path)
    windows = build_val_windows(config.data, tokenizer)
    model = load_model(resolved)
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits.double()
    nats = -logits.log_softmax(-1).gather(-1, windows[:, 1:, None]).sum().item()
    text_bytes = sum(len(tokenizer.decode([t]).encode("utf-8")) for t in windows[:, 1:].flatten().tolist())
    assert report.val_tokens == windows[:, 1:].numel()
    assert report.val_bytes <= text_bytes  # per-token decoding of split characters over-counts (U+FFFD)
    assert report.bits_per_byte == pytest.approx(nats / math.log(2) / report.val_bytes, rel=1e-6)
    assert 0 < report.bits_per_byte < report.val_loss / math.log(2)  # tokens average more than one byte


@pytest.mark.parametrize("which", ["trained_bpe", "qwen3"])
def test_token_byte_lengths_add_up_to_utf8_length(which: str, bpe: Path) -> None:
    from llm.data import eos_id, load_tokenizer

    if which == "qwen3":
        try:
            tokenizer = load_tokenizer(None)
        except RuntimeError as err:
            pytest.skip(f"no offline Qwen3 tokenizer: {err}")
    else:
        tokenizer = load_tokenizer(str(bpe))
    lengths = token_byte_lengths(tokenizer, tokenizer.get_vocab_size() + 7)  # padded vocabulary
    ids = tokenizer.encode(MULTILINGUAL, add_special_tokens=False).ids
    assert int(lengths[ids].sum()) == len(MULTILINGUAL.encode("utf-8"))
    assert lengths[eos_id(tokenizer)] == 0 and lengths[-1] == 0
    windows = torch.tensor([[eos_id(tokenizer), *ids]])
    bpb, n_bytes = bits_per_byte(2.0, windows, lengths)
    assert n_bytes == len(MULTILINGUAL.encode("utf-8"))
    assert bpb == pytest.approx(2.0 * len(ids) / math.log(2) / n_bytes, rel=1e-15)


def test_samples_are_deterministic(trained_run: Path) -> None:
    from llm.data import eos_id, load_tokenizer

    resolved = resolve_checkpoint(str(trained_run))
    model, tokenizer = load_model(resolved), load_tokenizer(resolved.model_path)
    prompts = ["The capital of France is"]

    def sample(temperature: float, seed: int) -> list[dict[str, str]]:
        return generate_samples(model, tokenizer, prompts, 6, temperature, seed, eos_id(tokenizer))

    assert sample(0.0, 0) == sample(0.0, 1)  # greedy ignores the seed
    assert sample(1.0, 5) == sample(1.0, 5)
    assert sample(1.0, 5) != sample(0.0, 0)  # temperature 1 samples rather than decoding greedily
    assert sample(1.0, 5)[0]["prompt"] == prompts[0]


class PromptBlind(torch.nn.Module):
    """Draws every new token uniformly whatever the prompt: a weak model's samples, where only the random draw
    tells two prompts' continuations apart."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def generate(self, ids: torch.Tensor, max_new_tokens: int, **_: object) -> torch.Tensor:
        return torch.cat([ids, torch.randint(0, 256, (1, max_new_tokens))], dim=1)


def test_each_prompt_has_its_own_draw(bpe: Path) -> None:
    """``make demo`` samples two prompts at temperature 0.8: one seed for every prompt gave a weak model's two
    prompts the same continuation. Each prompt's draw is its own, and the same whatever the other prompts."""
    from llm.data import load_tokenizer

    tokenizer, prompts = load_tokenizer(str(bpe)), ["The capital of France is", "Once upon a time,"]
    both = generate_samples(PromptBlind(), tokenizer, prompts, 12, 0.8, seed=0)
    assert both[0]["completion"] != both[1]["completion"]
    assert generate_samples(PromptBlind(), tokenizer, prompts[1:], 12, 0.8, seed=0) == both[1:]
    assert generate_samples(PromptBlind(), tokenizer, prompts, 12, 0.8, seed=1) != both


def test_resolve_checkpoint(trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    latest = trained_run / "checkpoints" / "step_00000004"
    assert resolve_checkpoint(str(trained_run)).checkpoint_dir == latest
    assert resolve_checkpoint(str(latest)).model_path == str(latest / "model")
    assert resolve_checkpoint(str(latest / "model")).config_file == latest / "config.yaml"
    assert resolve_checkpoint("Qwen/Qwen3-0.6B").checkpoint_dir is None  # a hub id, not looked up yet
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match=r"runs/typo: no such checkpoint"):
        resolve_checkpoint("runs/typo")  # "runs" exists here: a mistyped path, not a hub id
    with pytest.raises(FileNotFoundError, match=r"runs: not a run, checkpoint or model directory"):
        resolve_checkpoint("runs")


def test_cli_json_with_data_override(trained_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(trained_run), "--json", "--samples", "1", "--max-new-tokens", "4",
                 "data.val_tokens=1056"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["val_windows"] == 1056 // 33 and report["val_tokens"] == 32 * 32
    assert len(report["samples"]) == 1 and report["layers"][2]["layer"] == 2


def test_a_raw_text_file_is_evaluated_with_data_format_text(trained_run: Path, fineweb: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """WikiText-2's file name, ``wiki.test.raw``: read as plain text, no renaming."""
    import pyarrow.parquet as pq

    texts = pq.read_table(sorted(fineweb.glob("*.parquet"))[0], columns=["text"]).slice(0, 20)["text"]
    raw = tmp_path / "wiki.test.raw"
    raw.write_text("\n\n".join(str(text) for text in texts))
    args = [str(trained_run), "--json", "--samples", "0", f"data.source={raw}", "data.val_bucket=1",
            "data.val_tokens=330"]
    assert main(args) == 2 and "data.format=text|parquet" in capsys.readouterr().err
    assert main([*args, "data.format=text"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["data_source"] == str(raw) and report["val_windows"] == 10 and math.isfinite(report["val_loss"])


def test_cli_table(trained_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(trained_run), "--samples", "0"]) == 0
    out = capsys.readouterr().out
    logged = eval_rows(trained_run)[4]
    assert f"val loss    {logged['val_loss']:.6f}" in out
    assert "isoscore" in out and "alpha" in out and "bits/byte" in out


def test_bad_path_is_one_line_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_run"
    proc = subprocess.run([sys.executable, str(REPO / "eval.py"), str(missing)], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    expected = f"error: {missing}: no such checkpoint, model or run directory"
    assert proc.stderr.strip().splitlines() == [expected]


@pytest.mark.parametrize(("argv", "message"), [
    (["run", "--samples", "-1"], "argument --samples: expected a value >= 0, got -1"),
    (["run", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a value >= 1, got 0"),
    (["run", "--temperature", "-0.5"], "argument --temperature: expected a value >= 0.0, got -0.5"),
    (["lm-eval", "run", "--tasks", "t", "--batch-size", "0"], "argument --batch-size: expected a value >= 1"),
])
def test_bad_numeric_argument_is_one_line_exit_2(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Only unusable inputs become one-line errors; an internal ValueError is not swallowed."""
    def broken(*args, **kwargs):
        raise ValueError("shape mismatch inside the model")

    monkeypatch.setattr(cli, "_evaluate", broken)
    with pytest.raises(ValueError, match="shape mismatch"):
        main([str(tmp_path)])


def test_run_dir_without_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main([str(tmp_path / "run")]) == 2
    assert "run directory without a complete checkpoint" in capsys.readouterr().err


def test_a_checkpoint_renamed_to_another_step_is_refused(trained_run: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """step_00000002 renamed step_00000006: before, it was the run's newest by name, evaluated in place of step 4,
    under a path that says step 6. Refused in one line, as a resume refuses it; a copy under a name of its own is
    evaluated at the step it records."""
    run = tmp_path / "tiny"
    shutil.copytree(trained_run, run)
    renamed = run / "checkpoints" / "step_00000006"
    (run / "checkpoints" / "step_00000002").rename(renamed)
    capsys.readouterr()
    for target in (run, renamed, renamed / "model"):
        assert main([str(target), "--samples", "0"]) == 2
        assert capsys.readouterr().err == (
            f"error: {renamed} holds step 2 (its trainer.json): a directory renamed by hand; rename it step_00000002, "
            f"or move it out of {run / 'checkpoints'}\n")
    best = renamed.rename(tmp_path / "best")
    assert resolve_checkpoint(str(best)).step == 2


def test_compare_cli_on_trained_run(trained_run: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "cmp"
    assert main(["compare", str(trained_run), "--out", str(out_dir), "--baseline", "isogmlp+softmax"]) == 0
    assert "| isogmlp+softmax |" in capsys.readouterr().out
    assert {p.name for p in out_dir.iterdir()} >= {"comparison.md", "comparison.csv", "val_loss.png",
                                                   "grad_norm.png", "isotropy.png", "alpha.png"}
    assert main(["compare", str(tmp_path)]) == 2
    assert f"error: {tmp_path}: no metrics.jsonl" in capsys.readouterr().err


def test_bare_model_directory_with_data_overrides(trained_run: Path, fineweb: Path, tmp_path: Path) -> None:
    """A hub-style directory (no run config beside it) evaluated on the run's data, given as overrides."""
    import shutil

    model_dir = tmp_path / "hub_model"
    shutil.copytree(trained_run / "checkpoints" / "step_00000004" / "model", model_dir)
    data = [f"data.source={fineweb}", "data.seq_len=32", "data.val_bucket=50", "data.val_tokens=2048",
            f"data.cache_dir={tmp_path / 'cache'}", "train.micro_batch_size=3"]
    report = evaluate_checkpoint(str(model_dir), overrides=data, samples=0)
    assert report.step is None
    assert report.val_loss == eval_rows(trained_run)[4]["val_loss"]


@pytest.mark.parametrize(("field", "value"), [("intermediate_size", 128), ("hidden_size", 32_768),
                                              ("hidden_size", 2**40)])
def test_a_model_directory_whose_config_disagrees_with_its_weights_is_one_line(
        trained_run: Path, tmp_path: Path, field: str, value: int, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused from the files' headers, before a model is built: 2**40 would overflow, 32,768 allocate GBs."""
    import shutil

    model_dir = tmp_path / "hub_model"
    shutil.copytree(trained_run / "checkpoints" / "step_00000004" / "model", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, field: value}))
    assert main([str(model_dir), "--samples", "0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {model_dir}: config.json's {field}={value} does not fit ") or \
        line.startswith(f"error: {model_dir}: config.json's {field}={value} is too large"), line


def test_a_tokenizer_with_ids_past_the_embedding_is_one_line(trained_run: Path, bpe: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """data.tokenizer changed to one whose EOS is id 700, past the 512 rows the run trained: one line, exit 2, not
    an index error inside the model (a device assert on CUDA)."""
    tokenizer = json.loads(bpe.read_text())
    (eos,) = tokenizer["added_tokens"]
    tokenizer["model"]["vocab"][eos["content"]] = eos["id"] = 700
    (tmp_path / "eos700.json").write_text(json.dumps(tokenizer))
    assert main([str(trained_run), "--samples", "0", f"data.tokenizer={tmp_path / 'eos700.json'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: data.tokenizer: {tmp_path / 'eos700.json'}'s ids reach 700 (<|endoftext|>, appended after every "
        "document, is id 700), past the model's 512 embedding rows: evaluate with the tokenizer the model was "
        "trained with"]
