"""Document sources: a hub dataset or local files, both read through ``datasets`` streaming.

Local files go through the same ``load_dataset(builder, data_files=..., streaming=True)`` path as FineWeb on
the hub, so the code that trains at scale is the code the tests run on the local sample. Local inputs are
checked up front (one-line errors naming the file) because ``datasets`` reports most of these problems late,
deep in a worker, or not at all:

- parquet: must hold ``text_column``; files with zero rows are skipped (counted, with a warning).
- jsonl/json: empty files are skipped; the first record must hold ``text_column``.
- txt: one document per blank-line-separated paragraph (``sample_by="paragraph"``: a whole file as one
  document would make a single-file corpus unshardable across workers); empty files are skipped; non-UTF-8
  bytes are decoded with ``errors="replace"`` and the affected files counted in a warning.

``ShardReader`` reads a source shard by shard and retries a failed read from the last good position; the
training stream and the validation set both read through it.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import glob
import json
import sys
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
from huggingface_hub.utils import httpx as hub_httpx

from llm.config import DataConfig
from llm.data.errors import DataError

__all__ = [
    "LOCAL_BUILDERS",
    "ShardReader",
    "Source",
    "data_source",
    "iter_local_texts",
    "open_dataset",
    "read_errors",
    "resolve_source",
]

LOCAL_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}
"""File suffix -> ``datasets`` packaged builder."""
FORMAT_BUILDERS = {"text": "text", "parquet": "parquet", "jsonl": "json", "json": "json"}
"""``data.format`` -> builder, for local files whatever their suffix (WikiText-2's ``wiki.test.raw`` is text)."""


@dataclass(frozen=True)
class Source:
    """A resolved document source: what ``load_dataset`` is called with, and which columns hold what."""

    path: str
    """Hub dataset id, or the ``datasets`` builder name ("parquet", "json", "text") for local files."""
    name: str | None
    split: str
    text_column: str
    id_column: str | None
    data_files: tuple[str, ...] = ()
    """Local files in sorted order (empty for the hub)."""
    builder_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_local(self) -> bool:
        return bool(self.data_files)

    def identity(self) -> dict[str, Any]:
        """What determines the documents (for cache keys): local files by path and size."""
        files = [[f, Path(f).stat().st_size] for f in self.data_files]
        return {"path": self.path, "name": self.name, "split": self.split, "text_column": self.text_column,
                "id_column": self.id_column, "files": files}


def _looks_local(spec: str) -> bool:
    return (
        Path(spec).expanduser().exists()
        or any(ch in spec for ch in "*?[")
        or spec.startswith((".", "/", "~"))
        or Path(spec).suffix.lower() in LOCAL_BUILDERS
    )


def _expand(spec: str, any_suffix: bool = False) -> list[Path]:
    """The files of ``spec``; ``any_suffix`` (a ``data.format`` is given): a directory's files whatever their
    suffix, and no suffix is refused."""
    path = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise FileNotFoundError(f"data.source: no files match {spec}")
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and (any_suffix or p.suffix.lower() in LOCAL_BUILDERS))
        if not files:
            raise FileNotFoundError(
                f"data.source: no {'/'.join(sorted(LOCAL_BUILDERS))} files in directory {path}"
            )
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"data.source: no such file: {path}")
    unsupported = [f for f in files if f.suffix.lower() not in LOCAL_BUILDERS]
    if unsupported and not any_suffix:
        raise DataError(
            f"data.source: unsupported file type {unsupported[0]} (expected {', '.join(LOCAL_BUILDERS)}, "
            f"or name the format: data.format={'|'.join(FORMAT_BUILDERS)})"
        )
    return files


def _check_parquet(path: Path, text_column: str) -> tuple[bool, list[str]]:
    """(has rows, column names); raises naming the file when it is unreadable or lacks the text column."""
    try:
        meta = pq.read_metadata(path)
    except Exception as err:
        raise DataError(f"data.source: {path} is not a readable parquet file ({err})") from None
    columns = list(meta.schema.to_arrow_schema().names)
    if text_column not in columns:
        raise DataError(f"data.source: {path} has no column {text_column!r} (columns: {', '.join(columns)})")
    return meta.num_rows > 0, columns


def _check_json(path: Path, text_column: str) -> bool:
    with path.open("rb") as f:
        first = next((line for line in f if line.strip()), None)
    if first is None:
        return False
    try:
        record = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True  # a pretty-printed JSON array or object: let the json builder parse the whole file
    if isinstance(record, dict) and text_column not in record:
        raise DataError(
            f"data.source: {path} has no field {text_column!r} (fields: {', '.join(map(str, record))})"
        )
    return True


def _check_text(path: Path) -> tuple[bool, bool]:
    """(has content, holds non-UTF-8 bytes)."""
    data = path.read_bytes()
    try:
        return bool(data.decode("utf-8").strip()), False
    except UnicodeDecodeError:
        return bool(data.strip()), True


def resolve_source(
    source: str, name: str | None = None, split: str = "train", text_column: str = "text",
    id_column: str | None = "id", file_format: str | None = None,
) -> Source:
    """Validate ``source`` (hub id or local file/dir/glob) and describe how to stream it; ``file_format``
    (``data.format``) reads local files as that format instead of by suffix."""
    if not _looks_local(source):
        return Source(path=source, name=name, split=split, text_column=text_column, id_column=id_column)
    files = _expand(source, any_suffix=file_format is not None)
    kinds = {FORMAT_BUILDERS[file_format]} if file_format else {LOCAL_BUILDERS[f.suffix.lower()] for f in files}
    if len(kinds) > 1:
        raise DataError(f"data.source: {source} mixes file types ({', '.join(sorted(kinds))}); use one kind")
    builder = kinds.pop()
    kept: list[Path] = []
    kwargs: dict[str, Any] = {}
    bad_utf8: list[Path] = []
    if builder == "parquet":
        all_columns = [_check_parquet(f, text_column) for f in files]
        kept = [f for f, (has_rows, _) in zip(files, all_columns, strict=True) if has_rows]
        if id_column is not None and not all(id_column in cols for _, cols in all_columns):
            id_column = None  # hash the text instead of failing: the split stays deterministic
        kwargs["columns"] = [text_column] + ([id_column] if id_column else [])
    elif builder == "json":
        kept = [f for f in files if _check_json(f, text_column)]
    else:
        for f in files:
            has_content, invalid = _check_text(f)
            if has_content:
                kept.append(f)
            if invalid:
                bad_utf8.append(f)
        text_column, id_column = "text", None
        kwargs.update(sample_by="paragraph", encoding="utf-8", encoding_errors="replace")
    if bad_utf8:
        warnings.warn(
            f"data.source: {len(bad_utf8)} txt file(s) hold non-UTF-8 bytes (first: {bad_utf8[0]}); "
            "decoded with errors='replace'", stacklevel=2,
        )
    if len(kept) < len(files):
        skipped = [f for f in files if f not in kept]
        if not kept:
            raise DataError(f"data.source: every file of {source} is empty (e.g. {skipped[0]})")
        warnings.warn(f"data.source: skipped {len(skipped)} empty file(s) (first: {skipped[0]})",
                      stacklevel=2)
    return Source(path=builder, name=None, split="train", text_column=text_column, id_column=id_column,
                  data_files=tuple(str(f) for f in kept), builder_kwargs=kwargs)


@functools.cache
def _resolve_once(source: str, name: str | None, split: str, text_column: str, id_column: str | None,
                  file_format: str | None) -> Source:
    return resolve_source(source, name, split, text_column, id_column, file_format)


def data_source(data_cfg: DataConfig) -> Source:
    """The run's source, resolved once per process: the training stream, the prepared-shard check and the
    validation set (and its cache key) all need it, and resolving reads every parquet footer (every txt
    file whole) and warns about skipped files. Local files changed after the first call are not re-checked."""
    return _resolve_once(data_cfg.source, data_cfg.name, data_cfg.split, data_cfg.text_column,
                         data_cfg.id_column, data_cfg.format)


def open_dataset(source: Source) -> datasets.IterableDataset:
    """The source as one streaming ``datasets.IterableDataset`` in source order (shard i = file i locally)."""
    if source.is_local:
        return datasets.load_dataset(source.path, data_files=list(source.data_files), split="train",
                                     streaming=True, **source.builder_kwargs)
    return datasets.load_dataset(source.path, source.name, split=source.split, streaming=True)


_OPEN_READERS: weakref.WeakSet[Iterator[dict[str, list]]] = weakref.WeakSet()


@atexit.register
def _close_open_readers() -> None:
    """Close ``datasets`` readers still suspended at exit (a training loop stops mid-stream): finalised
    later, during interpreter teardown, datasets' parquet reader prints a spurious traceback."""
    for reader in list(_OPEN_READERS):
        reader.close()


def read_errors() -> tuple[type[BaseException], ...]:
    """What a failed streaming read raises, retried by ``ShardReader.batches``.

    - ``OSError``: ``ConnectionError`` and ``TimeoutError`` (which ``asyncio.TimeoutError`` and fsspec's
      ``FSTimeoutError`` are since Python 3.11); requests' ``RequestException``; huggingface_hub's
      ``HfHubHTTPError``; the ``ConnectionError("Server Disconnected")`` datasets raises once its own read
      retries are spent; and a local file that vanished or is corrupt (pyarrow raises ``OSError``, e.g.
      "ZSTD decompression failed" for a damaged parquet page).
    - pyarrow's ``ArrowException``: ``ArrowInvalid`` for a malformed file.
    - the hub client's ``httpx.HTTPError`` (``huggingface_hub.utils.httpx``, also what datasets retries):
      timeouts, network and protocol errors are not ``OSError``.
    - aiohttp's ``ClientError`` (fsspec's http filesystem) once aiohttp is loaded: it cannot have raised
      otherwise, and importing it costs a second.
    """
    errors: tuple[type[BaseException], ...] = (OSError, pa.ArrowException, hub_httpx.HTTPError)
    if "aiohttp" in sys.modules:
        errors += (sys.modules["aiohttp"].ClientError,)
    return errors


class ShardReader:
    """A source opened for streaming, read one shard at a time in batches of ``data.tokenize_batch`` rows."""

    def __init__(self, source: Source, data_cfg: DataConfig) -> None:
        self.source = source
        self.dataset = open_dataset(source)
        self.num_shards = self.dataset.n_shards
        self.batch_size = data_cfg.tokenize_batch
        self.retries = data_cfg.read_retries
        self.backoff_s = data_cfg.retry_backoff_s

    def _open(self, shard: int, state: dict[str, Any] | None
              ) -> tuple[datasets.IterableDataset, Iterator[dict[str, list]]]:
        """(the shard's dataset, a batch reader over it) positioned at ``state`` (None: the shard's start).

        ``datasets`` resumes a single unshuffled shard exactly from its ``state_dict()``."""
        dataset = self.dataset.shard(num_shards=self.num_shards, index=shard, contiguous=True)
        if state is not None:
            dataset.load_state_dict(state)
        # .iter() rather than iter(): inside a DataLoader worker the latter re-splits shards among workers
        reader = dataset.iter(batch_size=self.batch_size)
        _OPEN_READERS.add(reader)
        return dataset, reader

    def label(self, shard: int) -> str:
        """The shard as a user finds it: its file for local sources, else hub id, config, split and index."""
        if self.source.is_local and len(self.source.data_files) == self.num_shards:
            return self.source.data_files[shard]
        name = f"/{self.source.name}" if self.source.name else ""
        return f"{self.source.path}{name} split {self.source.split} shard {shard} of {self.num_shards}"

    def batches(self, shard: int, state: dict[str, Any] | None
                ) -> Iterator[tuple[dict[str, Any] | None, dict[str, list]]]:
        """(reader state before the batch, the batch's rows by column) for one shard, from ``state``.

        A failed read (``read_errors()``) re-opens the shard at the state before the failed batch and
        retries after ``retry_backoff_s * 2**(k - 1)`` seconds (retry k), so the rows continue exactly as
        if nothing had failed; ``read_retries`` consecutive failures raise ``DataError``."""
        dataset, reader = self._open(shard, state)
        failures = 0
        while True:
            try:
                batch = next(reader)
            except StopIteration:
                return
            except read_errors() as err:
                reader.close()
                failures += 1
                reason = f"{type(err).__name__}: {' '.join(str(err).split())}"
                if failures > self.retries:
                    raise DataError(f"data.source: could not read {self.label(shard)} after "
                                    f"{self.retries} retries ({reason})") from err
                delay = self.backoff_s * 2 ** (failures - 1)
                warnings.warn(f"data.source: reading {self.label(shard)} failed ({reason}); retry "
                              f"{failures} of {self.retries} in {delay:g} s from the last good "
                              f"position", stacklevel=2)
                time.sleep(delay)
                dataset, reader = self._open(shard, state)
                continue
            failures = 0
            yield state, batch
            state = dataset.state_dict()


def iter_local_texts(files: list[str], text_column: str = "text", batch_size: int = 256) -> Iterator[str]:
    """Texts of local files, directories or globs (all of one type), for tokenizer training."""
    checked = [resolve_source(spec, text_column=text_column, id_column=None) for spec in files]
    if not checked:
        raise DataError("no input files given")
    for spec, resolved in zip(files, checked, strict=True):
        if not resolved.is_local:
            raise FileNotFoundError(f"no such file: {spec}")
    if len({s.path for s in checked}) > 1:
        kinds = ", ".join(sorted({s.path for s in checked}))
        raise DataError(f"input files mix types ({kinds}); use one kind")
    source = dataclasses.replace(checked[0], data_files=tuple(f for s in checked for f in s.data_files))
    for batch in open_dataset(source).iter(batch_size=batch_size):
        yield from (text for text in batch[source.text_column] if text)
