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
from llm.data.tokenizer import encode_documents, eos_id

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


def test_text_is_the_files_bytes_as_training_reads_them(trained_run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A CRLF file: its ``\\r`` are scored and counted, as training keeps them (universal newlines dropped them)."""
    path = tmp_path / "crlf.raw"
    path.write_bytes(b"The first line of a file.\r\nA second line, with more words.\r\n\r\nA paragraph after it.\r\n")
    assert main([str(trained_run), "--text", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tokenizer = load_tokenizer(str(trained_run / "checkpoints" / "step_00000004" / "model"))
    ids = tokenizer.encode(path.read_bytes().decode(), add_special_tokens=False).ids
    assert report["tokens"] == len(ids) - 1
    assert report["bytes"] == len(path.read_bytes()) - len(tokenizer.decode(ids[:1]).encode())


def test_a_special_token_string_in_the_text_is_text(trained_run: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A literal "<|endoftext|>" is scored as the characters training encodes it as (``encode_documents``), and its
    bytes counted; before, it became the EOS id and its 13 bytes were left out of bits per byte."""
    path = tmp_path / "special.raw"
    path.write_bytes(b"A page that quotes the <|endoftext|> marker in its text.")
    assert main([str(trained_run), "--text", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tokenizer = load_tokenizer(str(trained_run / "checkpoints" / "step_00000004" / "model"))
    ids = encode_documents(tokenizer, [path.read_text()], eos_id(tokenizer))[0][:-1].tolist()  # less its EOS
    assert eos_id(tokenizer) not in ids and report["tokens"] == len(ids) - 1
    assert report["bytes"] == len(path.read_bytes()) - len(tokenizer.decode(ids[:1]).encode())


AVAILABLE = ", ".join(["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))])
UNUSABLE = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"  # a CPU build: any cuda
ONE_TOKEN_WINDOW = "data.seq_len=1: a window of one token scores none (--text needs 2 or more)"


@pytest.mark.parametrize(("argv", "message"), [
    (["RUN", "--text", "TEXT", "--stride", "33"], "--stride 33: at most the window, data.seq_len=32"),
    (["RUN", "--text", "EMPTY"], "--text EMPTY: empty, nothing to score"),
    (["RUN", "--text", "TEXT", "data.seq_len=1"], ONE_TOKEN_WINDOW),
    (["RUN", "--text", "TEXT", "--stride", "1", "data.seq_len=1"], ONE_TOKEN_WINDOW),
    (["RUN", "--stride", "8"], "--stride: only with --text FILE (the windows over a text file)"),
    (["RUN", "--device", "foo"], f"--device foo: not a device this torch can use (available: {AVAILABLE})"),
    (["RUN", "--device", "meta"], f"--device meta: not a device this torch can use (available: {AVAILABLE})"),
    (["RUN", "--text", "TEXT", "--device", UNUSABLE],
     f"--device {UNUSABLE}: not a device this torch can use (available: {AVAILABLE})"),
    (["lm-eval", "RUN", "--tasks", "hellaswag", "--device", "foo"],
     f"--device foo: not a device this torch can use (available: {AVAILABLE})"),
])
def test_bad_text_input_and_device_are_refused_before_the_model_loads(
        argv: list[str], message: str, trained_run: Path, text_file: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def load_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("llm.eval.evaluate.load_model", load_model)
    (tmp_path / "empty.raw").write_bytes(b"")
    paths = {"RUN": str(trained_run), "TEXT": str(text_file), "EMPTY": str(tmp_path / "empty.raw")}
    assert main([paths.get(arg, arg) for arg in argv]) == 2
    assert capsys.readouterr().err == f"error: {message.replace('EMPTY', paths['EMPTY'])}\n"
