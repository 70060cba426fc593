"""Damaged prepared tokens: a token file cut short or grown, or a garbage index.json, is refused before the first
step in one line naming the file; bytes changed in place (same size) are found by ``isollm-data verify``, which
checks every file against the checksum its index records. Indexes written before checksums still load."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

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
    tokenizer = tmp_path / "tokenizer.json"
    bpe.save(str(tokenizer))
    assert train_main([*TINY_TRAIN, f"data.source={data_cfg.source}", f"data.tokenizer={tokenizer}",
                       f"data.prepared={prepared}", f"data.cache_dir={data_cfg.cache_dir}", "data.val_bucket=20",
                       "data.val_tokens=330", f"out_dir={tmp_path / 'runs'}", "name=damaged",
                       "train.max_steps=2"]) == 2
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
