"""Fixtures every test folder may use; ``tests/tiny.py`` holds the shared constants and helpers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from tiny import FINEWEB, fineweb_files, longest_first

os.environ["OMP_NUM_THREADS"] = "1"
"""Inherited by every process the suite starts (train.py, torchrun's ranks, the hub and lock contenders), also
those started without ``tiny.run``: one thread each, for the reason ``one_thread`` gives."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    longest_first(items)


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
