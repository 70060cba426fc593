"""Fixtures every test folder may use; ``tests/tiny.py`` holds the shared constants and helpers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tiny import FINEWEB, fineweb_files

LONGEST = ("tests/test_readme.py", "tests/launch/test_gpu_check.py")
"""The files of the longest single tests (``--durations``, 2026-12-01: the README's commands ~3.5 minutes, each third
of the GPU check's dry run ~2): their ``slow`` tests start first, in this order."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest tests first, then the other ``slow`` ones, then the rest, each in collection order: xdist
    (``make test``'s ``-n 2 --dist loadgroup``) hands tests out in this order, so the short ones fill the end on both
    workers instead of one long test started last keeping a worker busy alone (the README's test, collected near the
    end, could start last and run its ~3.5 minutes alone)."""
    def rank(item: pytest.Item) -> tuple[int, bool]:
        slow, path = item.get_closest_marker("slow") is not None, item.nodeid.split("::")[0]
        return LONGEST.index(path) if slow and path in LONGEST else len(LONGEST), not slow

    items.sort(key=rank)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads; on a shared 2-core machine two threads per process made
    them ~15x slower (27 ms -> 460 ms a step under load), and one thread keeps CPU runs bitwise
    reproducible."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each in-process ``fit`` starts from a clean slate."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def footer_caches_out_of_the_repo(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    """A test whose ``DataConfig`` keeps the default ``cache_dir`` (``data_cache``, relative to the repository
    root the suite runs from) writes its footer and digest caches under pytest's temporary folder instead."""
    from llm.config import DataConfig
    from llm.data import cache_io, files, footers

    scratch = str(tmp_path_factory.getbasetemp() / "data_cache")
    for module in (files, footers):
        monkeypatch.setattr(module, "files_cache_path", lambda kind, paths, cache_dir: cache_io.files_cache_path(
            kind, paths, scratch if cache_dir == DataConfig.cache_dir else cache_dir))


REPO_DATA_CACHE = Path(__file__).resolve().parents[1] / "data_cache"
"""``data.cache_dir``'s default seen from the repository root, where the suite and its subprocesses run."""


@pytest.fixture(scope="session")
def repo_data_cache_existed() -> bool:
    return REPO_DATA_CACHE.exists()


@pytest.fixture(autouse=True)
def nothing_cached_in_the_repo(repo_data_cache_existed: bool):
    """A test that leaves the repository's ``data_cache/`` behind (a subprocess or worker given no
    ``data.cache_dir``, which the footer fixture above cannot reach) fails, naming itself; the folder is removed.
    Checked only where the folder did not exist before the session (a user's own runs may have made it)."""
    yield
    if not repo_data_cache_existed and REPO_DATA_CACHE.exists():
        shutil.rmtree(REPO_DATA_CACHE, ignore_errors=True)
        pytest.fail(f"this test wrote {REPO_DATA_CACHE}: give its runs data.cache_dir under tmp_path")


@pytest.fixture(scope="session")
def fineweb() -> Path:
    fineweb_files()
    return FINEWEB


@pytest.fixture(scope="session")
def bpe(fineweb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-token byte-level BPE trained on one shard of the sample (about a second)."""
    from llm.data import train_tokenizer

    out = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_tokenizer(fineweb_files()[:1], 512, out)
    return out
