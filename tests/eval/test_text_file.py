"""``eval.py RUN --text FILE``: every token of a file scored once, against Hugging Face's perplexity recipe run by
hand through ``AutoModelForCausalLM`` (https://huggingface.co/docs/transformers/perplexity), in fp64."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from llm.cli.eval import main
from llm.data import load_tokenizer

SEQ_LEN = 32  # the tiny run's data.seq_len (tests/tiny.py)


@pytest.fixture(scope="module")
def text_file(fineweb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = pq.read_table(sorted(fineweb.glob("*.parquet"))[0], columns=["text"]).slice(0, 3)["text"]
    path = tmp_path_factory.mktemp("text") / "wiki.test.raw"
    path.write_text("\n\n".join(str(text) for text in texts)[:3000] + " Grüße, café 東京 🍣")
    return path


def hf_recipe(model: torch.nn.Module, ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """The recipe's loop (labels -100 outside each window's new tokens), counting the labels its loss scores."""
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        input_ids = ids[begin:end].unsqueeze(0)
        target_ids = input_ids.clone()
        target_ids[:, : -(end - prev_end)] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        scored = int((target_ids[:, 1:] != -100).sum())  # the model shifts the labels by one
        nll_sum, n_tokens, prev_end = nll_sum + loss.item() * scored, n_tokens + scored, end
        if end == len(ids):
            break
    return nll_sum / n_tokens, n_tokens


@pytest.mark.parametrize("stride", [None, 7, SEQ_LEN])
def test_text_perplexity_is_hfs_recipe(trained_run: Path, text_file: Path, stride: int | None,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    stride_args = [] if stride is None else ["--stride", str(stride)]
    assert main([str(trained_run), "--text", str(text_file), *stride_args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)

    model_dir = trained_run / "checkpoints" / (trained_run / "checkpoints" / "latest").read_text().strip() / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    text = text_file.read_text()
    ids = torch.tensor(load_tokenizer(str(model_dir)).encode(text, add_special_tokens=False).ids)
    loss, tokens = hf_recipe(model, ids, SEQ_LEN, stride or SEQ_LEN // 2)

    assert report["stride"] == (stride or SEQ_LEN // 2) and report["seq_len"] == SEQ_LEN
    assert report["tokens"] == tokens == (len(ids) - 1 if stride != SEQ_LEN else len(ids) - -(-len(ids) // SEQ_LEN))
    assert report["loss"] == pytest.approx(loss, rel=1e-5)
    assert report["ppl"] == pytest.approx(math.exp(loss), rel=1e-5)
    if stride is None:  # byte-level BPE: the scored tokens are the file's bytes but the first token's
        first = len(load_tokenizer(str(model_dir)).decode([int(ids[0])]).encode())
        assert report["bytes"] == len(text.encode()) - first
    assert report["bits_per_byte"] == pytest.approx(report["loss"] * report["tokens"] / math.log(2) / report["bytes"])


def test_text_report_and_its_errors(trained_run: Path, text_file: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(trained_run), "--text", str(text_file)]) == 0
    out = capsys.readouterr().out
    lines = dict(line.split(maxsplit=1) for line in out.splitlines())
    assert list(lines) == ["file", "model_path", "step", "seq_len", "stride", "tokens", "bytes", "loss", "ppl",
                           "bits_per_byte"]
    assert lines["file"] == str(text_file) and lines["seq_len"] == "32" and lines["stride"] == "16"
    assert re.fullmatch(r"\d+\.\d{6}", lines["loss"]) and lines["step"] == "4"
    assert main([str(trained_run), "--text", str(tmp_path / "missing.raw")]) == 2
    missing = tmp_path / "missing.raw"
    assert capsys.readouterr().err == (f"error: --text {missing}: not a readable UTF-8 text file "
                                       f"(FileNotFoundError: [Errno 2] No such file or directory: '{missing}')\n")
    assert main([str(trained_run), "--text", str(text_file), "--stride", "33"]) == 2
    assert capsys.readouterr().err == "error: --stride 33: at most the window, data.seq_len=32\n"
    (tmp_path / "latin1.raw").write_bytes("café".encode("latin-1"))
    assert main([str(trained_run), "--text", str(tmp_path / "latin1.raw")]) == 2
    assert "latin1.raw: not a readable UTF-8 text file (UnicodeDecodeError: 'utf-8' codec can't decode" in \
        capsys.readouterr().err
