"""Pieces of a source, the unit below the file that work is split into, and their reading with retries.

- parquet: one piece per row group, measured in rows (known from the footer). A range of rows of a row
  group is read by decoding the row group (the smallest unit parquet reads) and slicing it.
- jsonl / txt: one piece per file, measured in bytes. A byte range ``[lo, hi)`` owns the records that
  *start* inside it (a line for jsonl; a paragraph for txt: a non-blank line after a blank line or the file's
  start, through the next blank line), so ranges that tile a file own every record exactly once and a reader
  of one range reads at most one record past its end.
- A long txt paragraph (a file without blank lines) is cut into several records at line starts: at the first
  line start at or after each multiple of ``data.max_doc_chars`` bytes of the file, when the paragraph started
  at or before the multiple before it. A paragraph shorter than ``max_doc_chars`` bytes is never cut; a longer
  one becomes records of at most about 2 x ``max_doc_chars`` bytes (a line is never cut), so that the nodes that
  split the file by bytes each get records. Each record is a document, followed by EOS like any other. A paragraph
  is stripped of whitespace at its ends only: the records of a cut one join back to it, every character kept (the
  newline that ends a record and the indent that starts the next).

A position inside a piece is an integer in the piece's unit: the row index, or the byte offset of a record's
start. ``PieceReader`` yields batches of ``data.tokenize_batch`` records with the position before and after
each, and re-opens a failed read at the last good position.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
from huggingface_hub.utils import httpx as hub_httpx

from llm.config import DataConfig
from llm.data.errors import DataError, DataWarning
from llm.data.files import file_size, open_file
from llm.data.footers import footers, parquet_metadata
from llm.data.sources import Source, resolve_source, source_files

__all__ = ["Batch", "Piece", "PieceReader", "iter_local_texts", "list_pieces", "read_errors", "read_piece"]

# Rows by column: ``text`` and, when the source has one, the id column.
Batch = dict[str, list]


@dataclass(frozen=True)
class Piece:
    file: str
    kind: str
    """The file's format: parquet, json (JSON Lines) or text."""
    group: int
    """Parquet row group; 0 for a line-oriented file (one piece per file)."""
    size: int
    """Length in the piece's unit: rows (parquet) or bytes (jsonl, txt)."""
    num_bytes: int
    """Bytes on disk (a row group's compressed size)."""


@functools.cache
def list_pieces(source: Source) -> tuple[Piece, ...]:
    """Every piece of the source in source order (files in order, row groups in order), once per process; parquet
    row groups from the footers, which ``source.cache_dir`` keeps across processes (``llm.data.footers``).
    DataLoader workers get the pieces with their dataset (``PieceReader.pieces``) and never list."""
    kind, files = source_files(source)
    pieces: list[Piece] = []
    if kind == "parquet":
        for file, footer in zip(files, footers(files, source.cache_dir), strict=True):
            pieces.extend(Piece(file, kind, group, rows, nbytes)
                          for group, (rows, nbytes) in enumerate(footer.row_groups) if rows)
    else:
        pieces.extend(Piece(file, kind, 0, size, size) for file in files if (size := file_size(file)))
    if not pieces:
        raise DataError(f"data.source: {source.path} holds no documents")
    return tuple(pieces)


def _parquet(source: Source, piece: Piece, start: int, hi: int, batch_size: int
             ) -> Iterator[tuple[int, Batch, int]]:
    # decoded batch by batch (memory of one batch, whatever the row group's size); rows before ``start``
    # are decoded and dropped, as parquet pages cannot be entered in the middle. The footer is read once per
    # process that reads the file (``parquet_metadata``): every segment of every epoch opens its file again,
    # and on the hub a footer read is another request
    with open_file(piece.file) as f:
        parquet = pq.ParquetFile(f, metadata=parquet_metadata(piece.file))
        names = parquet.schema_arrow.names
        columns = [source.text_column] + ([source.id_column] if source.id_column in names else [])
        row = 0
        for record in parquet.iter_batches(batch_size=batch_size, row_groups=[piece.group], columns=columns,
                                           use_threads=False):
            first, end = max(start, row), min(hi, row + record.num_rows)
            if first < end:
                yield first, record.slice(first - row, end - first).to_pydict(), end
            row += record.num_rows
            if row >= hi:
                return


def _first_line_start(f: BinaryIO, pos: int) -> int:
    """The first line start at or after ``pos``."""
    if pos == 0:
        return 0
    f.seek(pos - 1)
    if f.read(1) == b"\n":
        return pos
    f.readline()
    return f.tell()


def _previous_line_blank(f: BinaryIO, line_start: int) -> bool:
    """Whether the line before the one starting at ``line_start`` is blank (True at the file's start)."""
    end, tail = line_start - 1, b""  # the previous line's newline is at line_start - 1
    while end > 0:
        begin = max(0, end - 4096)
        f.seek(begin)
        tail = f.read(end - begin) + tail
        newline = tail.rfind(b"\n")
        if newline >= 0 or begin == 0:
            return not tail[newline + 1 :].strip()
        if tail.strip():
            return False
        end = begin
    return True


def _records(f: BinaryIO, kind: str, start: int, hi: int, max_bytes: int
             ) -> Iterator[tuple[int, bytes, int, tuple[bool, bool]]]:
    """(start byte, raw record, byte where the next record may start, whether the record starts and ends its
    paragraph) of the records starting in ``[start, hi)``: lines, or paragraphs cut at lines past ``max_bytes``
    (the module's docstring)."""
    # Every jsonl line is a record. Whether a txt line starts one depends on where its paragraph started, but only
    # as far as whether that was at or before the multiple of max_bytes before the previous one: read from there,
    # the records before ``start`` dropped (at most 2 x max_bytes and a line more read at the start of a range).
    text = kind == "text"
    pos = _first_line_start(f, max(start - start % max_bytes - max_bytes, 0) if text else start)
    after_blank = not text or _previous_line_blank(f, pos)  # the line at pos follows a blank one (or is jsonl)
    previous = paragraph = -1  # the previous line's start, the paragraph's: -1 before the first line read
    first, lines = pos, []  # the record being read: its start and lines
    f.seek(pos)
    while True:
        line = f.readline()
        blank, cut = text and not line.strip(), pos - pos % max_bytes  # cut: the last multiple of max_bytes <= pos
        if not line or blank or after_blank or (previous < cut and paragraph <= cut - max_bytes):
            if lines and first >= start:
                yield first, b"".join(lines), pos, (first == paragraph, not line or blank)
            lines = []
            if not line or pos >= hi:
                return
        if not blank:
            paragraph = pos if after_blank else paragraph
            first = first if lines else pos
            lines.append(line)
        previous, after_blank, pos = pos, blank or not text, pos + len(line)


def _decode(source: Source, piece: Piece, raw: bytes, edges: tuple[bool, bool], pos: int
            ) -> tuple[str | None, object]:
    """(text, id) of one raw record starting at byte ``pos``; a txt record is stripped at the ``edges`` (start, end)
    of its paragraph. A jsonl record that is not an object holding the text column is refused, as
    ``llm.data.sources`` refuses it up front in a local file (a hub file is met here first)."""
    if piece.kind == "text":
        text = raw.decode("utf-8", errors="replace")  # a record holds whole lines: no character is split
        text = text.lstrip() if edges[0] else text
        return text.rstrip() if edges[1] else text, None
    if not raw.strip():
        return None, None
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"data.source: {piece.file} holds a line that is not UTF-8 JSON at byte {pos} ({err})"
                        ) from None
    if not isinstance(record, dict) or source.text_column not in record:
        raise DataError(f"data.source: {piece.file} holds a record without field {source.text_column!r} at byte "
                        f"{pos}; set data.text_column")
    text = record[source.text_column]
    if text is not None and not isinstance(text, str):
        raise DataError(f"data.source: {piece.file} field {source.text_column!r} holds "
                        f"{type(text).__name__}, expected text (string); set data.text_column")
    return text, record.get(source.id_column) if source.id_column else None


def _lines(source: Source, piece: Piece, start: int, hi: int, batch_size: int, max_bytes: int
           ) -> Iterator[tuple[int, Batch, int]]:
    with open_file(piece.file) as f:
        batch: list[tuple[str | None, object]] = []
        first = start
        for pos, raw, after, edges in _records(f, piece.kind, start, hi, max_bytes):
            if not batch:
                first = pos
            batch.append(_decode(source, piece, raw, edges, pos))
            if len(batch) == batch_size:
                yield first, _columns(source, batch), after
                batch = []
        if batch:
            yield first, _columns(source, batch), hi


def _columns(source: Source, rows: list[tuple[str | None, object]]) -> Batch:
    batch: Batch = {source.text_column: [text for text, _ in rows]}
    if source.id_column:
        batch[source.id_column] = [key for _, key in rows]
    return batch


def read_piece(source: Source, piece: Piece, start: int, hi: int, batch_size: int,
               max_bytes: int = DataConfig.max_doc_chars) -> Iterator[tuple[int, Batch, int]]:
    """(position before, rows, position after) of the records of ``piece`` from position ``start`` to the
    end of the range ending at ``hi``, in batches of ``batch_size``; a txt paragraph is cut at lines past
    ``max_bytes`` (``data.max_doc_chars``)."""
    if piece.kind == "parquet":
        return _parquet(source, piece, start, hi, batch_size)
    return _lines(source, piece, start, hi, batch_size, max_bytes)


def read_errors() -> tuple[type[BaseException], ...]:
    """What a failed read raises, retried by ``PieceReader.batches``.

    - ``OSError``: ``ConnectionError`` and ``TimeoutError`` (which ``asyncio.TimeoutError`` and fsspec's
      ``FSTimeoutError`` are since Python 3.11); requests' ``RequestException``; huggingface_hub's
      ``HfHubHTTPError``; and a local file that vanished or is corrupt (pyarrow raises ``OSError``, e.g.
      "ZSTD decompression failed" for a damaged parquet page).
    - pyarrow's ``ArrowException``: ``ArrowInvalid`` for a malformed file.
    - the hub client's ``httpx.HTTPError`` (``huggingface_hub.utils.httpx``): timeouts, network and protocol
      errors are not ``OSError``.
    - aiohttp's ``ClientError`` (fsspec's http filesystem) once aiohttp is loaded: it cannot have raised
      otherwise, and importing it costs a second.
    """
    errors: tuple[type[BaseException], ...] = (OSError, pa.ArrowException, hub_httpx.HTTPError)
    if "aiohttp" in sys.modules:
        errors += (sys.modules["aiohttp"].ClientError,)
    return errors


class PieceReader:
    """Reads ranges of a source's pieces in batches of ``data.tokenize_batch`` records, retrying failures."""

    def __init__(self, source: Source, data_cfg: DataConfig) -> None:
        self.source = source
        self.pieces = list_pieces(source)
        self.cfg = data_cfg

    def label(self, piece: Piece) -> str:
        """The piece as a user finds it: its file (a hub file by URL), and the row group when there are
        several."""
        # from the pieces, not the footer: this runs when reading the file just failed
        if piece.kind == "parquet" and sum(p.file == piece.file for p in self.pieces) > 1:
            return f"row group {piece.group} of {piece.file}"
        return piece.file

    def batches(self, piece: int, start: int, hi: int) -> Iterator[tuple[int, Batch, int]]:
        """(position before, rows, position after) from ``start`` to ``hi`` of piece ``piece``; a failed read
        (``read_errors()``) is retried from the position after the last good batch, as ``data.read_retries`` and
        ``data.retry_backoff_s`` say, so the rows continue exactly as if nothing had failed."""
        failures, retries = 0, self.cfg.read_retries
        while True:
            try:
                for before, rows, after in read_piece(self.source, self.pieces[piece], start, hi,
                                                      self.cfg.tokenize_batch, self.cfg.max_doc_chars):
                    failures = 0
                    yield before, rows, after
                    start = after
                return
            except read_errors() as err:
                failures += 1
                reason = f"{type(err).__name__}: {' '.join(str(err).split())}"
                label = self.label(self.pieces[piece])
                if failures > retries:
                    raise DataError(f"data.source: could not read {label} after {retries} retries ({reason})") from err
                delay = self.cfg.retry_backoff_s * 2 ** (failures - 1)
                warnings.warn(f"data.source: reading {label} failed ({reason}); retry {failures} of "
                              f"{retries} in {delay:g} s from the last good position", DataWarning, stacklevel=2)
                time.sleep(delay)


def iter_local_texts(files: list[str], text_column: str = "text", batch_size: int = 256) -> Iterator[str]:
    """Texts of local files, directories or globs (all of one type), in order, for tokenizer training."""
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
    for piece in list_pieces(source):
        for _, batch, _ in read_piece(source, piece, 0, piece.size, batch_size):
            yield from (text for text in batch[source.text_column] if text)
