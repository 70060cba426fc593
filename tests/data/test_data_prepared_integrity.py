"""Damaged prepared tokens: a token file cut short or grown, or a garbage index.json, is refused before the first
step in one line naming the file; bytes changed in place (same size) are found by ``isollm-data verify``, which
checks every file against the checksum its index records. Indexes written before checksums still load."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tiny import TINY_TRAIN
from tokenizers import Tokenizer

from llm.cli.data import main as data_main
from llm.cli.train import main as train_main
from llm.config import DataConfig
from llm.data.errors import DataError
from llm.data.prepared_index import CHECKSUM, INDEX_FILE
from llm.data.shards import prepare
from llm.data.stream import build_train_loader
from llm.data.tokenizer import former_tokenizer_identity, tokenizer_identity


@pytest.fixture
def prepared(tmp_path: Path, data_cfg: DataConfig, bpe: Tokenizer) -> Path:
    out = tmp_path / "prepared"
    prepare(data_cfg, bpe, out)
    return out


def loader(data_cfg: DataConfig, bpe: Tokenizer, prepared: Path):
    return build_train_loader(replace(data_cfg, prepared=str(prepared)), bpe, 4, 0, 1)


def verify(prepared: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], list[str]]:
    code = data_main(["verify", str(prepared)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def train_on(prepared: Path, data_cfg: DataConfig, bpe: Tokenizer, tmp_path: Path, name: str) -> int:
    """train.py's exit code for 2 steps of a tiny model on ``prepared``."""
    tokenizer = tmp_path / "tokenizer.json"
    bpe.save(str(tokenizer))
    return train_main([*TINY_TRAIN, f"data.source={data_cfg.source}", f"data.tokenizer={tokenizer}",
                       f"data.prepared={prepared}", f"data.cache_dir={data_cfg.cache_dir}", "data.val_bucket=20",
                       "data.val_tokens=330", f"out_dir={tmp_path / 'runs'}", f"name={name}", "train.max_steps=2"])


def test_fresh_prepare_verifies(prepared: Path, capsys: pytest.CaptureFixture[str]) -> None:
    index = json.loads((prepared / INDEX_FILE).read_text())
    tokens = sum(f["num_tokens"] for f in index["files"])
    assert all(len(f[CHECKSUM]) == 16 for f in index["files"])
    assert verify(prepared, capsys) == (0, [f"OK {prepared}: 3 token file(s), {tokens:,} tokens: sizes and checksums "
                                            "match"], [])


@pytest.mark.parametrize("damage", ["half", "not_a_multiple_of_4", "missing"])
def test_a_token_file_of_another_size_is_refused_before_the_first_step(
        damage: str, prepared: Path, data_cfg: DataConfig, bpe: Tokenizer, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Cut to half, the loader read the first half and failed with a traceback where the missing part began
    (hundreds of steps in); a size that is not a multiple of 4 failed at start with numpy's traceback."""
    shard = prepared / "tokens_00001.bin"
    data = shard.read_bytes()
    tokens = len(data) // 4
    if damage == "missing":
        shard.unlink()
        held = "is missing"
    else:
        shard.write_bytes(data[: len(data) // 8 * 4] if damage == "half" else data + b"\0\0")
        held = f"holds {shard.stat().st_size:,} bytes"
    problem = f"{shard} {held}; {INDEX_FILE} records {tokens:,} tokens ({len(data):,} bytes)"
    with pytest.raises(DataError) as raised:
        loader(data_cfg, bpe, prepared)
    assert str(raised.value) == (f"data.prepared: {problem}; prepare again (`isollm-data verify {prepared}` checks "
                                 "every file)")
    assert verify(prepared, capsys) == (1, [], [f"isollm-data verify: damaged: {problem}"])
    assert train_on(prepared, data_cfg, bpe, tmp_path, "damaged") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {raised.value}"
    assert not (tmp_path / "runs" / "damaged" / "checkpoints").exists()


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage\x81", b'{"format": 2, "files": [', b"[1, 2]",
                                     b'{"format": 2, "files": [{"tokens": 3}]}'])
def test_a_garbage_index_is_one_line(content: bytes, prepared: Path, data_cfg: DataConfig, bpe: Tokenizer,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Not UTF-8, not JSON, not an object, or missing fields: one line naming index.json, not a
    UnicodeDecodeError / JSONDecodeError / KeyError traceback."""
    index = prepared / INDEX_FILE
    index.write_bytes(content)
    with pytest.raises(DataError, match=rf"^data\.prepared: {index} (is not JSON|has format None|lacks fields)"):
        loader(data_cfg, bpe, prepared)
    code, out, err = verify(prepared, capsys)
    assert (code, out, len(err)) == (2, [], 1)
    assert err[0].startswith(f"isollm-data verify: error: data.prepared: {index}")


def test_zeroed_bytes_are_found_by_verify(prepared: Path, data_cfg: DataConfig, bpe: Tokenizer,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """4,000 zeroed bytes keep the size: training starts (only sizes are checked at start); verify reads every
    file through its checksum and names the damaged one."""
    shard = prepared / "tokens_00000.bin"
    data = bytearray(shard.read_bytes())
    assert len(data) > 8_000
    data[4_000:8_000] = bytes(4_000)
    shard.write_bytes(bytes(data))
    next(iter(loader(data_cfg, bpe, prepared)))
    code, out, err = verify(prepared, capsys)
    recorded = json.loads((prepared / INDEX_FILE).read_text())["files"][0][CHECKSUM]
    assert (code, out, len(err)) == (1, [], 1)
    assert err[0].startswith(f"isollm-data verify: damaged: {shard} has checksum ")
    assert err[0].endswith(f"; {INDEX_FILE} records {recorded} (bytes changed in place)")


def test_an_index_without_checksums_still_loads(prepared: Path, data_cfg: DataConfig, bpe: Tokenizer,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Directories prepared before checksums were recorded train as before; verify checks their sizes and says
    that the checksums are not recorded."""
    path = prepared / INDEX_FILE
    index = json.loads(path.read_text())
    for entry in index["files"]:
        del entry[CHECKSUM]
    path.write_text(json.dumps(index))
    next(iter(loader(data_cfg, bpe, prepared)))
    code, out, err = verify(prepared, capsys)
    assert (code, err) == (0, []) and out[0].endswith(
        "checksum not recorded for 3 (prepared before checksums were; prepare again to record them), sizes checked")


def test_a_token_id_past_the_tokenizer_is_refused_in_one_line(prepared: Path, data_cfg: DataConfig, bpe: Tokenizer,
                                                               tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A flipped high bit (sizes kept) trained until its window came up, then an IndexError from the embedding (a
    device assert on CUDA). Each window read is checked against the tokenizer's top id, which model.vocab_size
    exceeds: the loader stops at that window in one line naming the file and the id, and a run exits 2."""
    shard = prepared / "tokens_00001.bin"
    tokens = np.fromfile(shard, dtype=np.uint32)
    tokens[len(tokens) // 2] |= 1 << 30
    tokens.tofile(shard)
    bad = f"{shard} holds token id {int(tokens[len(tokens) // 2]):,}, past the tokenizer's ids (0 to 511)"
    message = f"data.prepared: {bad}: the file is damaged (`isollm-data verify {prepared}`); prepare again"
    batches = iter(loader(data_cfg, bpe, prepared))
    with pytest.raises(DataError) as raised:
        for _ in range(1_000):
            assert int(next(batches).max()) <= 511
    assert str(raised.value) == message
    tokens |= 1 << 30  # every window: the first batch of a run
    tokens.tofile(shard)
    for other in ("tokens_00000.bin", "tokens_00002.bin"):
        (prepared / other).write_bytes((np.fromfile(prepared / other, dtype=np.uint32) | 1 << 30).tobytes())
    assert train_on(prepared, data_cfg, bpe, tmp_path, "flipped") == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: data.prepared: ") and "past the tokenizer's ids (0 to 511)" in line


def test_a_piece_past_its_token_file_is_refused_and_found_by_verify(prepared: Path, data_cfg: DataConfig,
                                                                    bpe: Tokenizer,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """index.json's pieces with sizes and checksums otherwise consistent: verify passed them, and the run died in
    np.stack when the loader reached the short read."""
    path = prepared / INDEX_FILE
    index = json.loads(path.read_text())
    last = max(i for i, p in enumerate(index["pieces"]) if p["file"] == 1)
    piece, held = index["pieces"][last], index["files"][1]["num_tokens"]
    piece["num_tokens"] += 100
    path.write_text(json.dumps(index))
    problem = (f"{path} records piece {last} as tokens {piece['start']:,} to {piece['start'] + piece['num_tokens']:,} "
               f"of {prepared / 'tokens_00001.bin'}, which holds {held:,}")
    with pytest.raises(DataError) as raised:
        loader(data_cfg, bpe, prepared)
    assert str(raised.value) == (f"data.prepared: {problem}; prepare again (`isollm-data verify {prepared}` checks "
                                 "every file)")
    assert verify(prepared, capsys) == (1, [], [f"isollm-data verify: damaged: {problem}"])


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_index_json_has_the_mode_of_its_token_files(umask: int, tmp_path: Path, data_cfg: DataConfig,
                                                    bpe: Tokenizer) -> None:
    """index.json was written 0600 (mkstemp's mode) beside token files of 0644: a shared directory unreadable."""
    previous = os.umask(umask)
    try:
        prepare(data_cfg, bpe, tmp_path / "shared")
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "shared").iterdir()}
    assert modes == dict.fromkeys([INDEX_FILE, "tokens_00000.bin", "tokens_00001.bin", "tokens_00002.bin"],
                                  0o666 & ~umask)


def test_prepare_writes_no_empty_token_file(tmp_path: Path, data_cfg: DataConfig, bpe: Tokenizer,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """max_tokens leaves the later files unread: they get no token file (they got empty ones), and one left by an
    earlier prepare of the directory is removed. The index still lists them, with 0 tokens; the run and verify
    read it."""
    out = tmp_path / "prepared"
    prepare(data_cfg, bpe, out)
    index = prepare(data_cfg, bpe, out, max_tokens=100)
    assert [f["num_tokens"] > 0 for f in index["files"]] == [True, False, False]
    assert sorted(p.name for p in out.iterdir()) == [INDEX_FILE, "tokens_00000.bin"]
    assert next(iter(loader(data_cfg, bpe, out))).shape == (4, data_cfg.seq_len + 1)
    assert verify(out, capsys)[0] == 0


def test_tokens_prepared_under_another_document_rule_are_refused(prepared: Path, data_cfg: DataConfig,
                                                                   bpe: Tokenizer) -> None:
    """An index from before txt paragraphs were cut at max_doc_chars (no ``tokenization`` recorded) held out other
    documents than today's validation set, so its training tokens could hold validation text: refused."""
    loader(data_cfg, bpe, prepared)  # today's index loads
    index = json.loads((prepared / INDEX_FILE).read_text())
    del index["tokenization"]
    (prepared / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(DataError, match=r"another document tokenization \('not recorded'.*prepare again"):
        loader(data_cfg, bpe, prepared)


@pytest.mark.parametrize(("recorded", "loads"), [("former", True), ("other", False)])
def test_an_index_records_the_tokenizer_by_todays_or_the_former_rule(recorded: str, loads: bool, prepared: Path,
                                                                      data_cfg: DataConfig, bpe: Tokenizer) -> None:
    """An index prepared before 2026-12-01 records the tokenizer by the former fingerprint (the whole serialised
    tokenizer): the same tokenizer still reads it; any other fingerprint is another tokenizer."""
    index = json.loads((prepared / INDEX_FILE).read_text())
    assert index["tokenizer"] == tokenizer_identity(bpe)
    index["tokenizer"] = former_tokenizer_identity(bpe) if recorded == "former" else "0123456789abcdef"
    (prepared / INDEX_FILE).write_text(json.dumps(index))
    if loads:
        next(iter(loader(data_cfg, bpe, prepared)))
    else:
        with pytest.raises(DataError, match=r"tokenized with another tokenizer than data\.tokenizer"):
            loader(data_cfg, bpe, prepared)
