"""Source resolution and validation of bad local inputs: one-line errors naming the file, or skips with a
count, never a hang (every case runs under a wall-clock guard)."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny import write_docs
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data.errors import DataError
from llm.data.pieces import iter_local_texts, list_pieces, read_piece
from llm.data.sources import Source, resolve_source
from llm.data.stream import build_train_loader
from llm.data.validation import build_val_windows

GUARD_S = 30


def guarded(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with a wall-clock limit: a hang fails the test instead of stalling the suite."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=GUARD_S)


def docs_of(source: str) -> list[str]:
    return list(iter_local_texts([source]))


def test_hub_ids_are_not_treated_as_files() -> None:
    source = resolve_source("HuggingFaceFW/fineweb", "sample-10BT")
    assert not source.is_local and source.path == "HuggingFaceFW/fineweb" and source.name == "sample-10BT"


def test_missing_file_and_empty_glob(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no such file: .*missing\.parquet"):
        guarded(lambda: resolve_source(str(tmp_path / "missing.parquet")))
    with pytest.raises(FileNotFoundError, match=r"no files match .*\*\.jsonl"):
        guarded(lambda: resolve_source(str(tmp_path / "*.jsonl")))
    with pytest.raises(FileNotFoundError, match=r"no .* files in directory"):
        guarded(lambda: resolve_source(str(tmp_path)))


def test_parquet_without_text_column_names_file_and_columns(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"content": ["a", "b"], "id": ["1", "2"]}), path)
    with pytest.raises(ValueError, match=r"bad\.parquet has no column 'text' \(columns: content, id\)"):
        guarded(lambda: resolve_source(str(path)))


def test_corrupt_parquet_names_file(tmp_path: Path) -> None:
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"junk\.parquet is not a readable parquet file"):
        guarded(lambda: resolve_source(str(tmp_path)))


def test_empty_files_are_skipped_with_a_count(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["one doc"]}), tmp_path / "b.parquet")
    with pytest.warns(UserWarning, match=r"skipped 1 empty file\(s\) \(first: .*a\.parquet\)"):
        source = guarded(lambda: resolve_source(str(tmp_path)))
    assert [Path(f).name for f in source.data_files] == ["b.parquet"]
    assert source.id_column is None  # no id column: validation hashes the text
    with pytest.warns(UserWarning, match="skipped 1 empty file"):
        assert docs_of(str(tmp_path)) == ["one doc"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.jsonl").write_text("")
    (empty / "y.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"every file of .*empty is empty"):
        guarded(lambda: resolve_source(str(empty)))


def test_startup_resolves_the_source_once(tmp_path: Path, bpe: Tokenizer, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """The train loader, the validation set and its cache key share one resolution: each parquet footer is
    read once to list the source, then once more by the reader of a file's rows, and the skipped-file warning
    is given once."""
    source = write_docs(tmp_path / "src", 40, 2, chars=600)
    pq.write_table(pa.table({"text": pa.array([], pa.string()), "id": pa.array([], pa.string())}),
                   source / "train-empty.parquet")
    footers: list[str] = []
    read_metadata = pq.read_metadata
    monkeypatch.setattr(pq, "read_metadata", lambda path, *a, **k: footers.append(Path(path).name)
                        or read_metadata(path, *a, **k))
    cfg = DataConfig(source=str(source), seq_len=16, shuffle_block=1, val_bucket=5, val_tokens=34,
                     tokenize_batch=8, cache_dir=str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="skipped 1 empty file") as caught:
        build_train_loader(cfg, bpe, 2, 0, 1)
        assert sorted(footers) == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet",
                                   "train-empty.parquet"]
        assert build_val_windows(cfg, bpe).shape == (2, 17)
    assert len(caught) == 1
    read_rows = footers[3:]
    assert read_rows and len(set(read_rows)) == len(read_rows) and "train-empty.parquet" not in read_rows


def test_jsonl_source_and_missing_field(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"doc {i}", "id": str(i)}) + "\n" for i in range(5)))
    assert guarded(lambda: docs_of(str(good))) == [f"doc {i}" for i in range(5)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl has no field 'text' in 1 of its 1 records \(first: line 1: "
                                         r"fields body\)"):
        guarded(lambda: resolve_source(str(bad)))


def test_jsonl_records_without_the_text_field_after_the_first_are_counted_in_one_line(tmp_path: Path) -> None:
    """Before, only the first record was checked: prepare dropped 150 of 300 documents without a word."""
    path = tmp_path / "half.jsonl"
    records = [{"text": f"doc {i}"} if i % 2 == 0 else {"body": f"doc {i}"} for i in range(298)] + [[1], "x"]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(DataError) as info:
        resolve_source(str(path))
    assert str(info.value) == (f"data.source: {path} has no field 'text' in 151 of its 300 records (first: line 2: "
                               "fields body); set data.text_column, or remove them")
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps([1]) + "\n")
    with pytest.raises(DataError, match=r"in 1 of its 2 records \(first: line 2: a JSON list, not an object\)"):
        resolve_source(str(path))


def test_a_jsonl_line_that_is_not_utf8_or_not_json_is_named_by_its_number(tmp_path: Path) -> None:
    """Before: "not JSON Lines" whatever the fault, at line 1 whatever its line; a later line was a traceback."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "a"}\n\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError) as info:
        resolve_source(str(path))
    assert str(info.value) == (f"data.source: {path} line 3 is not UTF-8 (byte 0xe9 at column 14); convert it, e.g. "
                               "iconv -f latin1 -t utf-8")
    path.write_bytes(b'{"text": "a"}\n{"text": \n')
    with pytest.raises(DataError, match=rf"^data.source: {path} line 2 is not JSON \(Expecting value\); expected "
                                        r"JSON Lines \(one JSON object per line\)$"):
        resolve_source(str(path))


def test_txt_paragraphs_and_non_utf8_bytes(tmp_path: Path, bpe: Tokenizer) -> None:
    """A Latin-1 file is refused naming its first bad byte; before, its é trained as U+FFFD after one warning."""
    path = tmp_path / "latin1.txt"
    text = "first paragraph\nstill first\n\nsecond caf\u00e9\n\nthird"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(DataError, match=rf"^data.source: {path} is not UTF-8 text \(byte 0xe9 at offset 39\); "
                                        r"convert it, e.g. iconv -f latin1 -t utf-8$"):
        docs_of(str(path))
    path.write_text(text)
    assert guarded(lambda: docs_of(str(path))) == ["first paragraph\nstill first", "second caf\u00e9", "third"]
    cfg = DataConfig(source=str(path), seq_len=4, shuffle_block=1, val_bucket=10**9, tokenize_batch=2)
    assert guarded(lambda: next(iter(build_train_loader(cfg, bpe, 1, 0, 1)))).shape == (1, 5)


def test_data_format_reads_a_file_of_any_suffix(tmp_path: Path, bpe: Tokenizer) -> None:
    """WikiText-2 ships ``wiki.test.raw``: with ``data.format=text`` it is read as the same ``.txt`` is."""
    raw = tmp_path / "wiki.test.raw"
    raw.write_text(" = Title = \n\n Some text here .\n\n More text .\n")
    with pytest.raises(ValueError, match=r"unsupported file type .*wiki\.test\.raw .*data\.format=text\|parquet"):
        resolve_source(str(raw))
    source = resolve_source(str(raw), data_format="text")
    assert source.path == "text" and source.data_files == (str(raw),)
    (piece,) = list_pieces(source)
    assert [text for _, batch, _ in read_piece(source, piece, 0, piece.size, 8) for text in batch["text"]] == [
        "= Title =", "Some text here .", "More text ."]  # paragraphs, as every txt source is read
    cfg = DataConfig(source=str(raw), format="text", seq_len=4, val_bucket=1, val_tokens=8,
                     cache_dir=str(tmp_path / "cache"))
    assert guarded(lambda: build_val_windows(cfg, bpe)).shape == (1, 5)
    with pytest.raises(ValueError, match="format: unknown value 'txt'; expected one of: text, parquet, jsonl, json"):
        DataConfig(source=str(raw), format="txt").validate()


def test_mixed_file_types_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n')
    with pytest.raises(ValueError, match="mixes file types"):
        resolve_source(str(tmp_path))


def test_cli_reports_bad_source_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llm.cli.data import main

    missing = tmp_path / "missing.parquet"
    assert guarded(lambda: main(["prepare", "--out", str(tmp_path / "out"), "--source", str(missing)])) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"isollm-data prepare: error: data.source: no such file: {missing}"


def test_a_jsonl_record_without_the_text_field_met_while_reading_is_refused(tmp_path: Path) -> None:
    """A hub file is not read up front: such a record, met while reading, was dropped without a word."""
    path = tmp_path / "late.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"body": "b"}) + "\n")
    source = Source(path="json", name=None, split="train", text_column="text", id_column=None,
                    data_files=(str(path),))
    piece = list_pieces(source)[0]
    with pytest.raises(DataError, match=rf"^data.source: {path} holds a record without field 'text' at byte 14; "):
        list(read_piece(source, piece, 0, piece.size, 8))
