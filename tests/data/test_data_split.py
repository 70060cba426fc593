"""One global epoch: the split of a source's pieces among nodes, simulated in one process for 1 to 64 nodes
on a corpus of uniquely numbered documents in files of unequal size (parquet by row groups, jsonl and txt
by byte ranges); prepared tokens dealt by global window index, resumed 2 -> 3 -> 1 processes."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import replace
from itertools import islice, pairwise
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny import fail_reads, record_sleeps
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data.pieces import PieceReader, list_pieces
from llm.data.shards import START, continue_positions, node_positions, prepare
from llm.data.sources import resolve_source
from llm.data.split import epoch_order, node_segments, node_shares
from llm.data.stream import build_train_loader

FILE_DOCS = [37, 250, 3, 410, 120]
"""Documents per file: unequal, one file smaller than most node counts."""
NODES = [1, 2, 7, 16, 64]


def text_of(i: int) -> str:
    return f"doc-{i:05d} " + "word " * (1 + (i * 7919) % 60)  # unequal lengths


def write_corpus(directory: Path, kind: str) -> Path:
    directory.mkdir()
    first = 0
    for k, count in enumerate(FILE_DOCS):
        ids = range(first, first + count)
        first += count
        path = directory / f"part-{k}.{kind}"
        if kind == "parquet":  # row groups of 32 rows: a file of several pieces, the last one short
            pq.write_table(pa.table({"text": [text_of(i) for i in ids], "id": [f"id-{i}" for i in ids]}), path,
                           row_group_size=32)
        elif kind == "jsonl":
            path.write_text("".join(json.dumps({"text": text_of(i), "id": f"id-{i}"}) + "\n" for i in ids))
        else:  # paragraphs of one or two lines, separated by one or more blank lines
            path.write_text("".join(text_of(i).replace("word ", "word\n", 1) + "\n" + "\n" * (1 + i % 3)
                                    for i in ids))
    return directory


def epoch_ids(cfg: DataConfig, nodes: int, epoch: int) -> list[list[int]]:
    """The document numbers each node reads in one epoch, through the loader's split and range reader."""
    source = resolve_source(cfg.source, id_column=cfg.id_column)
    reader = PieceReader(source, cfg)
    order = epoch_order(len(reader.pieces), cfg.seed, epoch, cfg.shuffle_shards)
    shares = []
    for node in range(nodes):
        ids = []
        for piece, lo, hi in node_segments(reader.pieces, order, node, nodes):
            for _, rows, _ in reader.batches(piece, lo, hi):
                for text in rows["text"]:
                    ids.append(int(text.split()[0].removeprefix("doc-")))
                    assert text.split() == text_of(ids[-1]).split(), text  # the whole record, nothing more
        shares.append(ids)
    return shares


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "txt"])
def test_one_global_epoch_for_any_number_of_nodes(kind: str, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / kind, kind)
    cfg = DataConfig(source=str(corpus), tokenize_batch=5)
    total = sum(FILE_DOCS)
    pieces = list_pieces(resolve_source(str(corpus)))
    longest = max(len(text_of(i)) for i in range(total)) + 40  # a record's bytes, json syntax included
    one_node = [epoch_ids(cfg, 1, epoch)[0] for epoch in (0, 1)]
    for nodes in NODES:
        for epoch in (0, 1):
            shares = epoch_ids(cfg, nodes, epoch)
            # every document exactly once per epoch, whatever the number of nodes and files
            assert Counter(i for share in shares for i in share) == Counter(range(total)), (nodes, epoch)
            # contiguous shares: node after node, they read the epoch's order as one node reads it
            assert [i for share in shares for i in share] == one_node[epoch], (nodes, epoch)
            sizes = [len(share) for share in shares]
            if kind == "parquet":  # the split is by rows: shares differ by at most one document
                assert max(sizes) - min(sizes) <= 1, (nodes, sizes)
            else:  # by bytes: by at most the documents of two records' bytes
                assert max(sizes) - min(sizes) <= 2 * longest // min(len(text_of(i)) for i in range(total)) + 1
        # equal shares (rows or bytes) to one unit, and no node reads the whole source: at most its share
        # plus the two row groups it shares with its neighbours (parquet), or one record past its end
        order = epoch_order(len(pieces), cfg.seed, 0, cfg.shuffle_shards)
        units, whole = sum(p.size for p in pieces), sum(p.num_bytes for p in pieces)
        for share in node_shares(pieces, order, nodes):
            assert abs(share.units - units / nodes) < 1
            assert share.read_bytes <= whole / nodes + 2 * max(p.num_bytes for p in pieces) + 1
    assert epoch_ids(cfg, 3, 0) != epoch_ids(cfg, 3, 1)  # each epoch visits the pieces in a new order


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "txt"])
def test_failed_read_resumes_inside_a_range_exactly(kind: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails mid-range re-opens at the position after the last good batch (a row, or a record's
    first byte): every node reads what it reads without the failure, no record lost or read twice."""
    corpus = write_corpus(tmp_path / kind, kind)
    cfg = DataConfig(source=str(corpus), tokenize_batch=5, retry_backoff_s=0.0)
    clean = epoch_ids(cfg, 3, 0)
    reads = fail_reads(monkeypatch, {2, 9, 30, 31}, ConnectionError("reset"))
    record_sleeps(monkeypatch)
    with pytest.warns(UserWarning) as caught:
        assert epoch_ids(cfg, 3, 0) == clean
    retries = [re.search(r"retry \d of \d", str(w.message)).group() for w in caught]
    assert retries == ["retry 1 of 5"] * 3 + ["retry 2 of 5"]  # reads 30 and 31 fail back to back
    assert reads["n"] > 31


def wikitext_like(lines: int) -> str:
    """Lines like WikiText's raw files (a title, sentences with spaced punctuation and numbers, " \n" line ends,
    runs of spaces), with no blank line: the whole text is one paragraph of data.format=text."""
    rng = random.Random(7)
    words = ["the", "game", "was", "released", "in", "1998", ",", "and", "@-@", "its", "sequel", "(", ")", "."]
    out = []
    for i in range(lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
        out.append(f" = Section {i} = " if i % 9 == 0 else sentence)
        out[-1] += "  " * (i % 3 == 1) + " \n"
    return "".join(out)


def paragraph_records(data: bytes, max_bytes: int) -> list[tuple[int, bytes]]:
    """(start byte, raw record) of a txt file as llm.data.pieces documents it, read whole from the start: a
    paragraph is cut at the first line start at or after each multiple of max_bytes, when it started at or before
    the multiple before."""
    records: list[tuple[int, bytes]] = []
    pos, previous, previous_blank, paragraph = 0, -1, True, 0
    for line in data.splitlines(keepends=True):
        blank, cut = not line.strip(), pos - pos % max_bytes
        if not blank and (previous_blank or (previous < cut and paragraph <= cut - max_bytes)):
            records.append((pos, b""))
            paragraph = pos if previous_blank else paragraph
        if not blank:
            records[-1] = (records[-1][0], records[-1][1] + line)
        elif records and not previous_blank:
            records.append((-1, b""))  # the blank line ends the paragraph
        previous, previous_blank, pos = pos, blank, pos + len(line)
    return [r for r in records if r[0] >= 0]


def test_txt_records_are_the_same_whatever_the_ranges(tmp_path: Path) -> None:
    """Random files of short and long paragraphs, each read as ranges that tile it, and again from each record's
    start (where a resumed stream reads again) and end (where a failed read resumes): the records of the whole file
    read from its start, each exactly once."""
    from llm.data.pieces import _records

    rng = random.Random(0)
    for _ in range(500):
        max_bytes = rng.randint(2, 60)
        lines = [b"\n" if r < 0.2 else b" \n" if r < 0.25 else b"x" * rng.randint(1, 30) + b"\n"
                 for r in (rng.random() for _ in range(rng.randint(1, 40)))]
        data = b"".join(lines)[: None if rng.random() < 0.7 else -1]
        path = tmp_path / "f.txt"
        path.write_bytes(data)
        whole = paragraph_records(data, max_bytes)
        ends = sorted({0, len(data), *(rng.randint(0, len(data)) for _ in range(rng.randint(0, 5)))})
        with path.open("rb") as f:
            tiled = [record for lo, hi in pairwise(ends) for record in _records(f, "text", lo, hi, max_bytes)]
            assert [record[:2] for record in tiled] == whole, (data, max_bytes, ends)
            records = list(_records(f, "text", 0, len(data), max_bytes))
            assert tiled == records  # the paragraph edges of each record too
            for i, (at, _, after, _) in enumerate(records):
                assert [r[:2] for r in _records(f, "text", at, len(data), max_bytes)] == whole[i:]
                assert [r[:2] for r in _records(f, "text", after, len(data), max_bytes)] == whole[i + 1 :]


def test_text_without_blank_lines_is_cut_at_lines_and_keeps_every_token(tmp_path: Path, bpe: Tokenizer) -> None:
    """A text file without blank lines of ~20 x max_doc_chars is documents of about max_doc_chars bytes cut at
    lines, each tokenized whole and followed by EOS: streaming, prepare and the validation set (what eval.py
    evaluates) each yield exactly their tokens, and 4 nodes each get documents. Before, it was one document that
    the one node whose byte range held its start read whole: the others stopped with "got no training
    documents"."""
    from llm.data.streaming import StreamingTokens
    from llm.data.tokenizer import eos_id
    from llm.data.validation import build_val_windows

    text = wikitext_like(400)
    path = tmp_path / "wiki.test.raw"
    path.write_text(text)
    cfg = DataConfig(source=str(path), format="text", max_doc_chars=1000, val_bucket=10**9, seq_len=16,
                     cache_dir=str(tmp_path / "cache"))
    assert len(text) > 20 * cfg.max_doc_chars and "\n\n" not in text
    records = [raw.decode() for _, raw in paragraph_records(text.encode(), cfg.max_doc_chars)]
    documents = [records[0].lstrip(), *records[1:-1], records[-1].rstrip()]  # one paragraph: stripped at its ends
    assert len(documents) >= 10 and max(map(len, documents)) > cfg.max_doc_chars  # tokenized in text_parts
    assert max(map(len, documents)) <= 2 * cfg.max_doc_chars + max(map(len, text.splitlines()))
    assert "".join(documents) == text.strip()  # every character, the newlines and indents at the cuts too
    expected = [t for doc in documents for t in [*bpe.encode(doc, add_special_tokens=False).ids, eos_id(bpe)]]
    # the whole paragraph's tokens, an EOS after each part
    assert [t for t in expected if t != eos_id(bpe)] == bpe.encode(text.strip(), add_special_tokens=False).ids
    stream = StreamingTokens(cfg, bpe)
    streamed = [int(t) for _, chunk in stream.chunks(0, 0, 1, None) for t in chunk]
    assert streamed == expected
    shares = [[int(t) for _, chunk in stream.chunks(0, node, 4, None) for t in chunk] for node in range(4)]
    assert all(shares) and [t for share in shares for t in share] == expected
    index = prepare(cfg, bpe, tmp_path / "prepared")
    assert sum(p["num_tokens"] for p in index["pieces"]) == len(expected)
    assert (tmp_path / "prepared" / "tokens_00000.bin").read_bytes() == torch.tensor(expected).numpy().astype(
        "uint32").tobytes()
    width = cfg.seq_len + 1
    held = replace(cfg, val_bucket=1, val_tokens=len(expected) // width * width)
    assert build_val_windows(held, bpe).flatten().tolist() == expected[: held.val_tokens]


def test_long_paragraphs_are_cut_keeping_every_character(tmp_path: Path, bpe: Tokenizer) -> None:
    """Paragraphs of several lines, some over max_doc_chars, between blank lines: the documents of each cut one join
    back to it, stripped at its ends only (every character kept at a cut: the line's end and the next one's indent),
    and prepare holds each paragraph's whole tokens, an EOS after each document. Before, each part was stripped, and
    the whitespace at every cut was lost (WikiText-2 lost 2 tokens under the default max_doc_chars)."""
    from llm.data.pieces import read_piece
    from llm.data.tokenizer import eos_id

    rng = random.Random(3)
    paragraphs = [wikitext_like(rng.randint(1, 80)) for _ in range(12)]
    path = tmp_path / "wiki.raw"
    path.write_text(" \n".join(paragraphs))  # a blank line (as WikiText's, one space) between paragraphs
    cfg = DataConfig(source=str(path), format="text", max_doc_chars=500, val_bucket=10**9, id_column=None)
    source = resolve_source(str(path), id_column=None, data_format="text")
    piece = list_pieces(source)[0]
    documents = [text for _, batch, _ in read_piece(source, piece, 0, piece.size, 7, cfg.max_doc_chars)
                 for text in batch["text"]]
    assert len(documents) > len(paragraphs) + 10  # cut many times
    assert "".join(documents) == "".join(paragraph.strip() for paragraph in paragraphs)
    whole = [t for paragraph in paragraphs for t in bpe.encode(paragraph.strip(), add_special_tokens=False).ids]
    tokens = tmp_path / "prepared" / "tokens_00000.bin"
    index = prepare(cfg, bpe, tmp_path / "prepared")
    prepared = torch.from_numpy(np.fromfile(tokens, dtype=np.uint32).astype(np.int64)).tolist()
    assert [t for t in prepared if t != eos_id(bpe)] == whole
    assert sum(p["num_tokens"] for p in index["pieces"]) == len(whole) + len(documents)


def test_a_word_longer_than_max_doc_chars_is_cut_and_kept(bpe: Tokenizer) -> None:
    from llm.data.tokenizer import encode_documents, eos_id, text_parts

    text = wikitext_like(400).strip()
    parts = text_parts(text, 1000)
    assert "".join(parts) == text and max(map(len, parts)) <= 1000 and len(parts) > 20
    assert text_parts("x" * 25, 10) == ["x" * 10] * 2 + ["x" * 5]
    assert text_parts("ab cd  ef", 5) == ["ab", " cd ", " ef"]  # before the space that precedes a word
    tokens, lengths = encode_documents(bpe, ["x" * 2500, "short one"], eos_id(bpe), max_chars=1000)
    assert bpe.decode(tokens.tolist()) == "x" * 2500 + "short one"
    assert tokens.tolist().count(eos_id(bpe)) == 2 and lengths.sum() == len(tokens)
    with pytest.raises(ValueError, match=r"max_doc_chars.*expected a positive integer"):
        DataConfig(max_doc_chars=0).validate()


def test_integer_text_column_is_one_line_naming_file_and_column(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from llm.cli.data import main

    path = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3], "id": ["a", "b", "c"]}), path)
    assert main(["prepare", "--out", str(tmp_path / "out"), "--source", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"isollm-data prepare: error: data.source: {path} column 'text' holds int64, expected text "
                   "(string); set data.text_column")
    lines = tmp_path / "numbers.jsonl"
    lines.write_text('{"text": "fine"}\n{"text": 7}\n')
    cfg = DataConfig(source=str(lines), id_column=None)
    reader = PieceReader(resolve_source(str(lines)), cfg)
    with pytest.raises(ValueError, match=rf"^data.source: {lines} field 'text' holds int, expected text"):
        list(reader.batches(0, 0, reader.pieces[0].size))


def windows_of(loader, batches: int) -> list[bytes]:
    return [bytes(w.numpy()) for b in islice(iter(loader), batches) for w in b]


@pytest.mark.slow
def test_prepared_resume_with_another_world_size(tmp_path: Path, data_cfg: DataConfig, bpe: Tokenizer) -> None:
    """2 processes x 2 workers, then 3 processes x 2 workers, then 1 process, each loader built per rank
    from every rank's saved state: every window of the global order is read once, none twice, none lost.
    Odd batch counts leave the workers of a rank one batch apart, so the frontier has holes to skip."""
    out = tmp_path / "prepared"
    prepare(data_cfg, bpe, out)
    cfg = replace(data_cfg, prepared=str(out), shuffle_block=5)
    global_order = windows_of(build_train_loader(replace(cfg, num_workers=0), bpe, 1, 0, 1), 400)
    assert len(set(global_order)) == len(global_order)  # windows are identifiable by their tokens
    seen: list[bytes] = []
    saved: list[dict] | None = None
    for ranks, workers, batches in [(2, 2, 5), (3, 2, 7), (1, 0, 40)]:
        states = []
        for rank in range(ranks):
            loader = build_train_loader(replace(cfg, num_workers=workers), bpe, 3, rank, ranks)
            if saved is not None:
                loader.load_state_dicts(json.loads(json.dumps(saved)))
            seen += windows_of(loader, batches)
            states.append(loader.state_dict())
        saved = states
    assert len(seen) == len(set(seen)), "a window was read twice"
    assert set(seen) == set(global_order[: len(seen)]), "a window was skipped"


def test_continued_positions_are_every_position_once() -> None:
    """Random runs of 1-9 nodes each taking 0-6 windows, resumed up to 5 times with another number of nodes:
    no position is taken twice, and every position below the last frontier was taken."""
    rng = random.Random(0)
    for _ in range(300):
        nodes, states, taken = rng.randint(1, 9), None, []
        for _ in range(rng.randint(1, 5)):
            states = states or [START] * nodes
            counts = [rng.randint(0, 6) for _ in range(nodes)]
            for node, count in enumerate(counts):
                taken += islice(node_positions(states[node], node, nodes), count)
            saved = [{**s, "taken": s["taken"] + c} for s, c in zip(states, counts, strict=True)]
            nodes = rng.randint(1, 9)
            states = continue_positions(saved, nodes)
        assert len(taken) == len(set(taken))
        frontier, skip = states[0]["from"], set(states[0]["skip"])
        assert set(taken) == set(range(frontier)) | skip and min(skip, default=frontier) >= frontier


def test_streamed_resume_with_another_world_size_is_one_line(data_cfg: DataConfig, bpe: Tokenizer) -> None:
    states = [build_train_loader(data_cfg, bpe, 2, rank, 2).state_dict() for rank in range(2)]
    with pytest.raises(ValueError) as raised:
        build_train_loader(data_cfg, bpe, 2, 0, 1).load_state_dicts(states)
    message = str(raised.value)
    assert message.startswith("resume: the data loader state was written by 2 processes, resuming with 1 ")
    assert "isollm-data prepare" in message and "\n" not in message
    build_train_loader(data_cfg, bpe, 2, 1, 2).load_state_dicts(states)  # the same processes: its own state


def test_prepared_nodes_split_one_global_order(tmp_path: Path, data_cfg: DataConfig, bpe: Tokenizer) -> None:
    """Node i of N reads the 1-node order's windows i, i + N, ...: over one epoch's windows, every window
    once, for 1 to 64 nodes, and the nodes' counts differ by at most one."""
    from llm.data.shards import PreparedTokens

    out = tmp_path / "prepared"
    prepare(data_cfg, bpe, out)
    cfg = replace(data_cfg, prepared=str(out), seq_len=16, shuffle_block=4)
    source = PreparedTokens(cfg, bpe)
    epoch_windows = source.epoch_tokens // (cfg.seq_len + 1)
    one = [bytes(w) for w, _ in islice(source.node_windows(0, 1, None), epoch_windows)]
    for nodes in NODES:
        counts = [len(range(node, epoch_windows, nodes)) for node in range(nodes)]
        assert max(counts) - min(counts) <= 1
        seen = [bytes(w) for node in range(nodes)
                for w, _ in islice(source.node_windows(node, nodes, None), counts[node])]
        assert Counter(seen) == Counter(one), nodes
