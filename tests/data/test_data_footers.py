"""Parquet footers are read once per job: a cold cache reads each file's footer once, a warm one none, a changed
file is read again, and the pieces, the token stream and its resume are the same whatever the cache held.
Footer reads are counted through ``llm.data.footers.read_metadata``; ``new_process`` forgets what this process
learnt, as a process started now (another rank, a spawned worker, the next job) would not know it."""

from __future__ import annotations

import json
import os
import pickle
from collections import Counter
from itertools import islice
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest
import torch
from tiny import REPO, TINY_MODEL, fineweb_files, run, torchrun
from tokenizers import Tokenizer

import llm.data.footers as footers
import llm.data.pieces as pieces
import llm.data.sources as sources
from llm.cli.data import main
from llm.config import DataConfig
from llm.data.cache_io import files_cache_path
from llm.data.files import file_size
from llm.data.pieces import list_pieces
from llm.data.sources import data_source
from llm.data.stream import TrainLoader, build_train_loader

WORKER = Path(__file__).with_name("footers_worker.py")


def new_process() -> None:
    """Forget every footer, file list and piece list this process knows."""
    footers._KNOWN.clear()
    for cached in (footers.parquet_metadata, list_pieces, sources._resolve_once, sources._repository_files,
                   file_size):
        cached.cache_clear()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Footer reads by file, from now on (listing and reading rows alike)."""
    counts: Counter[str] = Counter()
    real = footers.read_metadata

    def counting(file: str):
        counts[file] += 1
        return real(file)

    monkeypatch.setattr(footers, "read_metadata", counting)
    new_process()
    return counts


def write_part(path: Path, rows: int, start: int = 0) -> None:
    """``rows`` sample documents (from ``start``) in row groups of 15."""
    table = pq.read_table(fineweb_files()[0], columns=["text", "id"]).slice(start, rows)
    pq.write_table(table, path, row_group_size=15)


@pytest.fixture
def corpus(tmp_path: Path) -> list[str]:
    """4 files of 40 rows, each in row groups of 15, 15 and 10."""
    (tmp_path / "corpus").mkdir()
    files = [tmp_path / "corpus" / f"part-{k}.parquet" for k in range(4)]
    for k, path in enumerate(files):
        write_part(path, 40, 40 * k)
    return [str(f) for f in files]


@pytest.fixture
def cfg(tmp_path: Path, corpus: list[str]) -> DataConfig:
    return DataConfig(source=str(Path(corpus[0]).parent), seq_len=32, shuffle_block=4, val_bucket=20,
                      val_tokens=100, tokenize_batch=8, max_doc_chars=600, cache_dir=str(tmp_path / "cache"))


def test_cold_cache_reads_each_footer_once_and_warm_none(cfg: DataConfig, corpus: list[str],
                                                         reads: Counter[str]) -> None:
    cold = list_pieces(data_source(cfg))
    assert reads == dict.fromkeys(corpus, 1)  # resolving and listing share the reads
    assert [(p.group, p.size) for p in cold[:3]] == [(0, 15), (1, 15), (2, 10)] and len(cold) == 12
    assert [p.name for p in Path(cfg.cache_dir).iterdir()] == [files_cache_path("footers", corpus, cfg.cache_dir).name]
    reads.clear()
    new_process()
    assert list_pieces(data_source(cfg)) == cold
    assert not reads


def test_changed_file_is_read_again(cfg: DataConfig, corpus: list[str], reads: Counter[str]) -> None:
    """A rewritten file (size and mtime), or one only touched (mtime), is read again, alone; an added file
    makes another list of files, read whole."""
    list_pieces(data_source(cfg))
    write_part(Path(corpus[1]), 20)
    reads.clear()
    new_process()
    changed = list_pieces(data_source(cfg))
    assert reads == {corpus[1]: 1}
    assert [p.size for p in changed if p.file == corpus[1]] == [15, 5] and len(changed) == 11
    stat = os.stat(corpus[2])
    os.utime(corpus[2], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    reads.clear()
    new_process()
    assert list_pieces(data_source(cfg)) == changed
    assert reads == {corpus[2]: 1}
    added = str(Path(corpus[0]).with_name("part-4.parquet"))
    write_part(Path(added), 10)
    reads.clear()
    new_process()
    assert list_pieces(data_source(cfg))[-1].file == added
    assert reads == dict.fromkeys([*corpus, added], 1)
    reads.clear()
    new_process()
    list_pieces(data_source(cfg))
    assert not reads


def test_remote_files_are_fingerprinted_by_one_listing_per_directory(tmp_path: Path, reads: Counter[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Files behind fsspec (``memory://`` standing in for ``hf://``): one directory listing, not a request per
    file, gives every fingerprint; a changed ETag re-reads that file alone; a filesystem whose listing has no
    content key (size alone) is read by every process."""
    fs = fsspec.filesystem("memory")
    table = pq.read_table(fineweb_files()[0], columns=["text", "id"]).slice(0, 30)
    files = [f"memory://{tmp_path.name}/part-{k}.parquet" for k in range(3)]
    for url in files:
        with fs.open(url, "wb") as f:
            pq.write_table(table, f, row_group_size=10)
    etags = dict.fromkeys(files, "v1")
    listed: list[str] = []
    real_ls = type(fs).ls

    def ls_with_etags(self, path: str, detail: bool = True, **kwargs):
        listed.append(path)
        return [{**entry, "ETag": etags[f"memory://{entry['name'].lstrip('/')}"]}
                for entry in real_ls(self, path, detail=True, **kwargs)]

    monkeypatch.setattr(type(fs), "ls", ls_with_etags)
    monkeypatch.setattr(type(fs), "info", lambda *_a, **_k: pytest.fail("a file was asked for alone"))
    cache = str(tmp_path / "cache")
    try:
        assert [[rows for rows, _ in f.row_groups] for f in footers.footers(files, cache)] == [[10, 10, 10]] * 3
        assert reads == dict.fromkeys(files, 1) and listed == [f"/{tmp_path.name}"]
        etags[files[1]] = "v2"
        reads.clear()
        new_process()
        footers.footers(files, cache)
        assert reads == {files[1]: 1} and len(listed) == 2
        monkeypatch.setattr(type(fs), "ls", real_ls)
        for _ in range(2):
            reads.clear()
            new_process()
            footers.footers(files, cache)
            assert reads == dict.fromkeys(files, 1)
    finally:
        for url in files:
            fs.rm_file(url)


def batches(cfg: DataConfig, tok: Tokenizer, count: int, state: dict | None = None) -> tuple[list, dict]:
    """The next ``count`` batches of rank 1 of 2 (from ``state``), and the loader state after them."""
    loader = build_train_loader(cfg, tok, 2, 1, 2)
    if state is not None:
        loader.load_state_dict(state)
    taken = [batch.tolist() for batch in islice(loader, count)]
    return taken, loader.state_dict()


def damage_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(200))


def damage_row_count(path: Path) -> None:
    """Valid JSON whose first row group claims a row less: only the checksum tells."""
    cached = json.loads(path.read_text())
    next(iter(cached["files"].values()))["row_groups"][0][0] -= 1
    path.write_text(json.dumps(cached))


@pytest.mark.parametrize("damage", [damage_garbage, damage_row_count])
def test_stream_and_resume_are_the_same_cold_warm_and_after_a_corrupt_cache(
        cfg: DataConfig, corpus: list[str], bpe: Tokenizer, reads: Counter[str], damage) -> None:
    cold, cold_state = batches(cfg, bpe, 6)
    first, state = batches(cfg, bpe, 3)
    new_process()
    warm, warm_state = batches(cfg, bpe, 6)
    assert warm == cold and warm_state == cold_state
    new_process()
    assert batches(cfg, bpe, 3, state)[0] == cold[3:] and first == cold[:3]  # a resume reads the warm cache
    path = files_cache_path("footers", corpus, cfg.cache_dir)
    damage(path)
    new_process()
    with pytest.warns(UserWarning, match=rf"^rebuilding the footer cache {path}: unreadable \(.+\)$"):
        rebuilt, _ = batches(cfg, bpe, 6)
    assert rebuilt == cold
    reads.clear()
    new_process()
    list_pieces(data_source(cfg))
    assert not reads  # the rebuilt cache was written back


def test_unwritable_cache_dir_warns_and_lists(cfg: DataConfig, corpus: list[str], reads: Counter[str],
                                              tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    cfg.cache_dir = str(blocked)
    with pytest.warns(UserWarning, match=r"^could not write the footer cache .*not-a-directory/footers_\w+\.json "
                                         r"\(\w+Error: .+\); the next process reads the footers again$"):
        assert len(list_pieces(data_source(cfg))) == 12
    assert reads == dict.fromkeys(corpus, 1)


def test_workers_get_the_pieces_with_their_dataset(cfg: DataConfig, bpe: Tokenizer, reads: Counter[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader unpickled in a new process (as a spawned DataLoader worker receives its dataset), then forked
    into 2 workers, lists nothing and yields the same batches."""
    cfg.num_workers = 2
    loader = build_train_loader(cfg, bpe, 2, 0, 1)
    shipped = pickle.dumps(loader)
    expected = [b.tolist() for b in islice(loader, 4)]

    def listed(*_args, **_kwargs):
        raise AssertionError("a worker listed the source")

    for module, name in ((pieces, "list_pieces"), (pieces, "footers"), (sources, "footers")):
        monkeypatch.setattr(module, name, listed)
    new_process()
    restored: TrainLoader = pickle.loads(shipped)
    assert restored.source.pieces == loader.source.pieces
    assert [b.tolist() for b in islice(restored, 4)] == expected


def test_plan_and_prepare_share_the_cache(cfg: DataConfig, corpus: list[str], bpe: Tokenizer, reads: Counter[str],
                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Cold, ``isollm-data plan`` reads every footer; then ``prepare`` and ``plan`` in new processes read only
    the footer of the file whose rows they read (the first), and a training loader none."""
    tok = tmp_path / "tok.json"
    bpe.save(str(tok))
    plan = ["plan", cfg.source, f"data.cache_dir={cfg.cache_dir}", "--world-size", "2", "--tokenizer", str(tok),
            "--sample-docs", "4"]
    assert main(plan) == 0
    assert set(reads) == set(corpus) and reads[corpus[0]] == 2  # listed, then sampled
    for command in (["prepare", "--source", cfg.source, "--tokenizer", str(tok), "--out", str(tmp_path / "out"),
                     "--max-tokens", "100", f"data.cache_dir={cfg.cache_dir}"], plan):
        reads.clear()
        new_process()
        assert main(command) == 0
        assert reads == {corpus[0]: 1}
    reads.clear()
    new_process()
    build_train_loader(cfg, bpe, 2, 0, 1)
    assert not reads
    capsys.readouterr()


@pytest.mark.slow
def test_rank_1_reads_no_footers_and_hashes_no_file(cfg: DataConfig, corpus: list[str], bpe: Tokenizer,
                                                    tmp_path: Path) -> None:
    """2 gloo processes build the trainer's data (``build_data``) on a cold cache: rank 0 reads the footers and hashes
    each file once (the content fingerprint), rank 1 neither, and both hold the same validation windows; a second
    start (a requeue) reads no footer and hashes no file on either rank. Before, every rank hashed every file at
    every start."""
    tok = tmp_path / "tok.json"
    bpe.save(str(tok))
    overrides = [*TINY_MODEL, f"data.source={cfg.source}", f"data.tokenizer={tok}", f"data.cache_dir={cfg.cache_dir}",
                 "data.val_bucket=20", "data.val_tokens=100", "train.micro_batch_size=2", "train.max_steps=1"]
    env = {"ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(REPO)}  # the worker imports this checkout's llm
    run(torchrun(2, str(WORKER), str(tmp_path), *overrides), env=env)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert set(ranks[0]["reads"]) == set(corpus) and ranks[1]["reads"] == []
    assert sorted(ranks[0]["hashed"]) == corpus and ranks[1]["hashed"] == []
    assert ranks[0]["val"] == ranks[1]["val"]
    assert torch.tensor(ranks[0]["val"]).shape == (3, 33)
    run(torchrun(2, str(WORKER), str(tmp_path), *overrides), env=env)
    again = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["reads"], r["hashed"], r["val"]) for r in again] == [([], [], ranks[0]["val"])] * 2


def test_data_warnings_print_as_one_line() -> None:
    """The footer cache's warnings (a DataWarning) print as one ``warning:`` line in the command lines,
    not Python's file:line plus the source line."""
    import warnings

    from llm.data.errors import DataWarning
    from llm.errors import one_line_warnings

    default = warnings.formatwarning
    try:
        one_line_warnings()
        text = warnings.formatwarning(DataWarning("could not write the footer cache x"), DataWarning, "f.py", 3)
        assert text == "warning: could not write the footer cache x\n"
        assert "f.py:3" in warnings.formatwarning(UserWarning("theirs"), UserWarning, "f.py", 3)
    finally:
        warnings.formatwarning = default
