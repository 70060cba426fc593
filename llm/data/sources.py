"""Document sources: a dataset repository (a hub id, or a local directory laid out like one with a README
``configs:`` block) or plain local files, resolved to a list of files of one format.

A repository's config name selects its files through ``datasets``' own data-files resolution
(``load_dataset_builder(path, name).config.data_files``), for a hub id and a local repository directory
alike, so the code that resolves FineWeb's ``sample-10BT`` on a cluster is the code the tests run offline.
Files are then read directly (``llm.data.pieces``: parquet row groups with pyarrow, line-oriented files by
byte range), which is what lets work be split below the file level. Parquet files are checked by their footers
(``llm.data.footers``: read once per job with ``data.cache_dir``); local inputs are checked up front (one-line
errors naming the file):

- parquet: must hold ``text_column`` as a string column; files with zero rows are skipped (counted, with a
  warning).
- jsonl/json (JSON Lines: one object per line): empty files are skipped; every line is read once per process: each
  must be UTF-8 JSON, and every record an object holding ``text_column`` (a bad line is named by its number).
- txt: one document per paragraph (separated by blank lines; a paragraph longer than ``data.max_doc_chars``
  bytes is cut at lines: ``llm.data.pieces``); empty files are skipped; a file that is not UTF-8 is refused,
  naming its first bad byte (decoded with replacement characters, it would train on U+FFFD).
"""

from __future__ import annotations

import functools
import glob
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm.config import FORMAT_NAMES, DataConfig
from llm.data.errors import DataError, DataWarning
from llm.data.files import content_fingerprint
from llm.data.footers import Footer, footers

__all__ = ["FORMATS", "FORMAT_NAMES", "Source", "data_source", "resolve_source", "source_files", "source_fingerprint"]

# File suffix -> how its documents are read.
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}
# Arrow types a parquet text column may have.
TEXT_TYPES = ("string", "large_string")


@dataclass(frozen=True)
class Source:
    """A resolved document source: where its files come from, their format, and which columns hold what."""

    path: str
    """Hub dataset id or local repository directory; for plain local files, their format."""
    name: str | None
    """Config name of a repository (FineWeb: sample-10BT); None for plain local files."""
    split: str
    text_column: str
    id_column: str | None
    data_files: tuple[str, ...] = ()
    """Plain local files in sorted order (empty for a repository: ``source_files`` resolves those)."""
    cache_dir: str | None = field(default=None, compare=False)
    """Where the parquet footers of the files are cached across processes (``data.cache_dir``); None: read by
    every process. Not part of what the source is."""

    @property
    def is_local(self) -> bool:
        """Plain local files, as opposed to a repository resolved by config name."""
        return bool(self.data_files)

    def identity(self) -> dict[str, Any]:
        """What determines the documents (for cache keys): local files by path and size."""
        files = [[f, Path(f).stat().st_size] for f in self.data_files]
        return {"path": self.path, "name": self.name, "split": self.split, "text_column": self.text_column,
                "id_column": self.id_column, "files": files}


def _is_repository(path: Path) -> bool:
    """A local directory laid out like a hub dataset repository: its README.md declares ``configs:``."""
    readme = path / "README.md"
    return path.is_dir() and readme.is_file() and "\nconfigs:" in readme.read_text(errors="replace")


def _looks_local(spec: str) -> bool:
    return (Path(spec).expanduser().exists() or glob.has_magic(spec) or spec.startswith((".", "/", "~"))
            or Path(spec).suffix.lower() in FORMATS)


def _expand(spec: str, any_suffix: bool = False) -> list[Path]:
    path = Path(spec).expanduser()
    if glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise FileNotFoundError(f"data.source: no files match {spec}")
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and (any_suffix or p.suffix.lower() in FORMATS))
        if not files:
            raise FileNotFoundError(f"data.source: no {'/'.join(sorted(FORMATS))} files in directory {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"data.source: no such file: {path}")
    unsupported = [f for f in files if f.suffix.lower() not in FORMATS]
    if unsupported and not any_suffix:
        raise DataError(f"data.source: unsupported file type {unsupported[0]} (expected {', '.join(FORMATS)}, "
                        f"or name the format: data.format={'|'.join(FORMAT_NAMES)})")
    return files


def file_format(files: list[str] | tuple[str, ...], where: str) -> str:
    """The one format of ``files`` (by suffix); ``DataError`` when they mix formats or one is unsupported."""
    kinds = {FORMATS.get(Path(f.split("?")[0]).suffix.lower()) for f in files}
    if None in kinds:
        raise DataError(f"data.source: {where} holds files of an unsupported type (expected {', '.join(FORMATS)})")
    if len(kinds) > 1:
        raise DataError(f"data.source: {where} mixes file types ({', '.join(sorted(map(str, kinds)))}); use one kind")
    return str(kinds.pop())


def check_parquet(file: str, footer: Footer, text_column: str) -> list[str]:
    """The file's columns; raises naming the file when it lacks the text column or it holds no text."""
    columns = dict(footer.columns)
    if text_column not in columns:
        raise DataError(f"data.source: {file} has no column {text_column!r} (columns: {', '.join(columns)})")
    if columns[text_column] not in TEXT_TYPES:
        raise DataError(f"data.source: {file} column {text_column!r} holds {columns[text_column]}, expected text "
                        "(string); set data.text_column")
    return list(columns)


def _check_json(path: Path, text_column: str) -> bool:
    """Whether the file holds a record. Every line is read (as a txt file is whole), so that a bad line is named
    by its number: one that is not UTF-8 or not JSON is a ``DataError``; records that are not objects or lack
    ``text_column`` (each would be dropped) are counted in one, naming the first."""
    records, lacking, first = 0, 0, ""
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as err:
                raise DataError(f"data.source: {path} line {number} is not UTF-8 (byte 0x{line[err.start]:02x} at "
                                f"column {err.start + 1}); convert it, e.g. iconv -f latin1 -t utf-8") from None
            except json.JSONDecodeError as err:
                raise DataError(f"data.source: {path} line {number} is not JSON ({err.msg}); expected JSON Lines "
                                "(one JSON object per line)") from None
            records += 1
            if not isinstance(record, dict) or text_column not in record:
                lacking += 1
                first = first or (f"line {number}: fields {', '.join(map(str, record))}" if isinstance(record, dict)
                                  else f"line {number}: a JSON {type(record).__name__}, not an object")
    if lacking:
        raise DataError(f"data.source: {path} has no field {text_column!r} in {lacking} of its {records} records "
                        f"(first: {first}); set data.text_column, or remove them")
    return records > 0


def _check_text(path: Path) -> bool:
    """Whether the file has content; a ``DataError`` naming the first byte that is not UTF-8 (a Latin-1 file's é
    would train as U+FFFD)."""
    data = path.read_bytes()
    try:
        return bool(data.decode("utf-8").strip())
    except UnicodeDecodeError as err:
        raise DataError(f"data.source: {path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                        "convert it, e.g. iconv -f latin1 -t utf-8") from None


def resolve_source(source: str, name: str | None = None, split: str = "train", text_column: str = "text",
                   id_column: str | None = "id", data_format: str | None = None, cache_dir: str | None = None,
                   ) -> Source:
    """Validate ``source`` (hub id, local repository directory, or local file/dir/glob) and describe it.
    A repository's files are resolved later, by ``source_files``. ``data_format`` (``data.format``) reads
    local files as that format whatever their suffix; parquet footers are cached in ``cache_dir``."""
    if not _looks_local(source) or _is_repository(Path(source).expanduser()):
        return Source(path=source, name=name, split=split, text_column=text_column, id_column=id_column,
                      cache_dir=cache_dir)
    files = _expand(source, any_suffix=data_format is not None)
    kind = FORMAT_NAMES[data_format] if data_format else file_format([str(f) for f in files], source)
    if kind == "parquet":
        found = footers([str(f) for f in files], cache_dir)
        all_columns = [check_parquet(str(f), footer, text_column) for f, footer in zip(files, found, strict=True)]
        kept = [f for f, footer in zip(files, found, strict=True) if footer.num_rows > 0]
        if id_column is not None and not all(id_column in cols for cols in all_columns):
            id_column = None  # hash the text instead of failing: the split stays deterministic
    elif kind == "json":
        kept = [f for f in files if _check_json(f, text_column)]
    else:
        kept = [f for f in files if _check_text(f)]
        text_column, id_column = "text", None
    if len(kept) < len(files):
        skipped = [f for f in files if f not in kept]
        if not kept:
            raise DataError(f"data.source: every file of {source} is empty (e.g. {skipped[0]})")
        warnings.warn(f"data.source: skipped {len(skipped)} empty file(s) (first: {skipped[0]})", DataWarning,
                      stacklevel=2)
    return Source(path=kind, name=None, split="train", text_column=text_column, id_column=id_column,
                  data_files=tuple(str(f) for f in kept), cache_dir=cache_dir)


@functools.cache
def _repository_files(path: str, name: str | None, split: str) -> tuple[str, ...]:
    import datasets  # loads slowly; only repositories need it

    from llm.hub_access import OFFLINE_HINT, offline_unless_reachable

    unreachable = None if Path(path).is_dir() else offline_unless_reachable()
    try:
        builder = datasets.load_dataset_builder(path, name)
    except Exception as err:
        hint = f"; {OFFLINE_HINT} ({unreachable})" if unreachable else ""
        raise DataError(f"data.source: cannot resolve {path!r} config {name!r} "
                        f"({' '.join(str(err).split())}){hint}") from None
    data_files = builder.config.data_files or {}
    if split not in data_files:
        raise DataError(f"data.source: {path} config {name!r} has no split {split!r} "
                        f"(splits: {', '.join(data_files) or 'none'})")
    return tuple(str(f) for f in data_files[split])


def source_files(source: Source) -> tuple[str, tuple[str, ...]]:
    """(format, files in source order): plain local files as resolved, a repository's through its config."""
    if source.is_local:  # resolve_source put the format (by suffix or data.format) in ``path``
        return source.path, source.data_files
    files = _repository_files(source.path, source.name, source.split)
    if not files:
        raise DataError(f"data.source: {source.path} config {source.name!r} split {source.split!r} has no files")
    kind = file_format(files, f"{source.path} config {source.name!r}")
    if kind == "parquet":
        for file, footer in zip(files, footers(files, source.cache_dir), strict=True):
            check_parquet(file, footer, source.text_column)
    return kind, files


@functools.cache
def source_fingerprint(source: Source) -> str:
    """What the source's files hold (``content_fingerprint``: a local file's bytes, read once per job with
    ``data.cache_dir`` and then trusted by its stat; a hub file's blob id), once per process: the validation cache's
    key, every streamed loader state and meta row record it, so a source rewritten at the same path (at the same
    size) is another validation set and is refused on resume."""
    return content_fingerprint(source_files(source)[1], source.cache_dir)


# ``resolve_source`` once per process for each set of arguments (``data_source``)
_resolve_once = functools.cache(resolve_source)


def data_source(data_cfg: DataConfig) -> Source:
    """The run's source, resolved once per process: the training stream, the prepared-shard check and the
    validation set (and its cache key) all need it, and resolving reads every parquet footer (cached in
    ``data.cache_dir`` across processes; every txt file whole) and warns about skipped files. Local files
    changed after the first call are not re-checked."""
    return _resolve_once(data_cfg.source, data_cfg.name, data_cfg.split, data_cfg.text_column,
                         data_cfg.id_column, data_cfg.format, data_cfg.cache_dir)
