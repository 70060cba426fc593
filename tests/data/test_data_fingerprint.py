"""A local source's content fingerprint reads its files once, then trusts each file by its stat (size, mtime, ctime,
inode; git's racy-clean rule): a start after the first reads none of the source, a file rewritten in place at the
same size with its mtime put back is read again (alone), and a run on prepared tokens reads none of the raw source.
Reads are counted through ``llm.data.files.file_checksum``, the one place the fingerprint reads a file's bytes;
``forget_sources`` forgets what this process learnt, as the next start's process would not know it."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest
from tiny import forget_sources
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data import files
from llm.data.shards import PreparedTokens, prepare
from llm.data.sources import data_source, source_fingerprint
from llm.data.stream import build_train_loader
from llm.data.tokenizer import as_transformers_tokenizer, tokenizer_identity
from llm.data.validation import build_val_windows, val_cache_path


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Bytes read by the fingerprint, by file, from now on."""
    counts: Counter[str] = Counter()
    real = files.file_checksum

    def counting(path: Path, algorithm, **kwargs) -> str:
        counts[str(path)] += path.stat().st_size
        return real(path, algorithm, **kwargs)

    monkeypatch.setattr(files, "file_checksum", counting)
    forget_sources()
    return counts


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The source's files count as changed long enough before their hash to trust its stat (the racy margin is
    for files changed within a clock tick of it, as the tests' just-written files all are)."""
    monkeypatch.setattr(files, "RACY_NS", 0)


def _start(cfg: DataConfig, tok: Tokenizer) -> str:
    """What a training start does with the data (its loader and validation set), in a new process."""
    forget_sources()
    loader = build_train_loader(cfg, tok, 2, 0, 1)
    build_val_windows(cfg, tok)
    return loader.source.fingerprints["source"]


def test_a_start_after_the_first_reads_none_of_the_source(data_cfg: DataConfig, bpe: Tokenizer,
                                                          hashed: Counter[str], settled: None) -> None:
    """Before, every start (and every rank) read every byte of the source again."""
    source = sorted(Path(data_cfg.source).iterdir())
    first = _start(data_cfg, bpe)
    assert hashed == {str(f): f.stat().st_size for f in source}  # each file read once, the validation key included
    hashed.clear()
    assert _start(data_cfg, bpe) == first and not hashed
    assert _start(DataConfig(**{**vars(data_cfg), "cache_dir": str(Path(data_cfg.cache_dir) / "other")}),
                  bpe) == first and sum(hashed.values()) == sum(f.stat().st_size for f in source)


def test_a_file_rewritten_at_its_size_with_its_mtime_put_back_is_read_again(tmp_path: Path, hashed: Counter[str],
                                                                            settled: None) -> None:
    paths = [tmp_path / f"part-{k}.txt" for k in range(3)]
    for k, path in enumerate(paths):
        path.write_text(f"document {k}\n" * 100)
    names, cache = [str(p) for p in paths], str(tmp_path / "cache")
    before = files.content_fingerprint(names, cache)
    was = paths[1].stat()
    time.sleep(0.05)  # past a coarse clock tick: the rewrite's ctime is another than the hash's stat saw
    paths[1].write_text(paths[1].read_text().replace("document 1", "document 7"))
    os.utime(paths[1], ns=(was.st_atime_ns, was.st_mtime_ns))
    assert paths[1].stat().st_size == was.st_size and paths[1].stat().st_mtime_ns == was.st_mtime_ns
    hashed.clear()
    after = files.content_fingerprint(names, cache)
    assert after != before and hashed == {names[1]: was.st_size}
    hashed.clear()
    assert files.content_fingerprint(names, cache) == after and not hashed


def test_a_file_changed_just_before_its_hash_is_read_again_until_it_settles(tmp_path: Path,
                                                                            hashed: Counter[str]) -> None:
    """The racy-clean rule: a stat taken within ``RACY_NS`` of the file's last change may not see a change in the
    same clock tick, so it is not trusted; a corrupt cache is rebuilt with a warning."""
    path = tmp_path / "part.txt"
    path.write_text("text\n" * 50)
    cache = str(tmp_path / "cache")
    first = files.content_fingerprint([str(path)], cache)
    assert files.content_fingerprint([str(path)], cache) == first and hashed == {str(path): 250 * 2}
    [written] = Path(cache).iterdir()
    entry = json.loads(written.read_text())["files"][str(path)]
    assert entry["stat"][2] >= entry["stat_ns"] - files.RACY_NS  # hashed within the margin of its ctime
    written.write_text("{")
    with pytest.warns(UserWarning, match="rebuilding the digest cache .*: unreadable"):
        assert files.content_fingerprint([str(path)], cache) == first


def test_a_run_on_prepared_tokens_reads_none_of_the_raw_source(data_cfg: DataConfig, bpe: Tokenizer, tmp_path: Path,
                                                               hashed: Counter[str]) -> None:
    """prepare records the fingerprint of what it tokenized; the run checks the prepared directory (its index and
    checksums) and takes the source's from there. Before, it hashed the raw source at every start."""
    index = prepare(data_cfg, bpe, tmp_path / "prepared", max_tokens=2_000)
    assert index["source_fingerprint"] == source_fingerprint(data_source(data_cfg))
    hashed.clear()
    forget_sources()
    tokens = PreparedTokens(DataConfig(**{**vars(data_cfg), "prepared": str(tmp_path / "prepared")}), bpe)
    assert tokens.fingerprints["source"] == index["source_fingerprint"] and not hashed


def test_a_tokenizer_and_its_saved_copy_are_one_fingerprint(data_cfg: DataConfig, bpe: Tokenizer,
                                                            tmp_path: Path) -> None:
    """A checkpoint's tokenizer.json (saved through transformers, which gives the BPE a post-processor) keys the
    run's validation cache: before, eval.py built the validation set again under another key."""
    as_transformers_tokenizer(bpe).save_pretrained(tmp_path)
    saved = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert saved.to_str() != bpe.to_str()
    assert tokenizer_identity(saved) == tokenizer_identity(bpe)
    assert val_cache_path(data_cfg, saved) == val_cache_path(data_cfg, bpe)
