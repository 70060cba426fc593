"""Where the training signals go: metrics.jsonl, Accelerate trackers and a progress bar.

metrics.jsonl is the record of a run (rows documented in docs/ARCHITECTURE.md); every row is
appended and flushed at once, so a crashed run keeps everything it logged. TensorBoard / W&B
receive the same rows flattened by ``llm.metrics.flatten_for_tracker``. Only the main process
writes (rank 0 of torch.distributed: under DeepSpeed on CPU Accelerate calls every rank main).
A row that cannot be written (a full disk) does not raise where it happens: ``MetricsLog.failure``
says what failed, and the trainer stops every rank together at its next agreement point. A tracker that fails
(TensorBoard's disk, W&B's connection) is dropped with a warning instead: metrics.jsonl holds every row anyway, and
the run goes on on every rank (``drop_tracker``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from llm.data.cache_io import write_atomically
from llm.errors import IsollmWarning, one_line, stderr_line
from llm.metrics.layers import flatten_for_tracker
from llm.train.distributed import is_main_process

__all__ = ["MetricsLog", "ProgressBar", "drop_tracker", "main_print", "peak_memory", "truncate_metrics"]


def peak_memory(device: torch.device) -> tuple[int, str]:
    """Peak memory in bytes and what was measured: CUDA max allocated on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "cpu_max_rss"  # Linux reports KiB


def main_print(message: str) -> None:
    """Print on rank 0 only."""
    if is_main_process():
        print(message, flush=True)


def main_warning(message: str) -> None:
    """``warning: <message>`` on rank 0's stderr, where every other warning of the command lines goes."""
    if is_main_process():
        stderr_line(f"warning: {message}")


def truncate_metrics(path: str | Path, step: int) -> None:
    """Drop the train/eval rows past ``step`` (logged by a run after its last checkpoint and about to
    be logged again by the resumed run), so each step appears once in the file. A line that is not a row (torn by a
    crash mid-write, or two rows run together after one) is never dropped: it is appended to ``<path>.damaged``
    first, with one warning line naming both files, and the readable rows stay for compare."""
    path = Path(path)
    if not path.is_file():
        return
    kept, damaged = [], []
    for number, line in enumerate(path.read_text(errors="surrogateescape").splitlines(), start=1):
        try:
            row = json.loads(line)
            if row.get("kind") == "meta" or int(row["step"]) <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError, AttributeError):  # not a JSON object with a step
            damaged.append((number, line))
    if damaged:
        aside = path.with_name(f"{path.name}.damaged")
        with open(aside, "a", errors="surrogateescape") as f:
            f.write("".join(line + "\n" for _, line in damaged))
            f.flush()
            os.fsync(f.fileno())
        main_warning(f"{path}: {len(damaged)} unreadable line(s) (line {', '.join(str(n) for n, _ in damaged[:5])}"
                     f"{', ...' if len(damaged) > 5 else ''}) moved to {aside}, the other rows kept")
    write_atomically(path, lambda tmp: tmp.write_text("".join(line + "\n" for line in kept),
                                                      errors="surrogateescape"))


def drop_tracker(accelerator: Accelerator, tracker: Any, reason: str) -> None:
    """Stop using ``tracker`` for the rest of the run, with one warning line."""
    accelerator.trackers.remove(tracker)
    warnings.warn(f"tracker {tracker.name} {reason}; it is off for the rest of the run (metrics.jsonl keeps every "
                  f"row)", IsollmWarning, stacklevel=3)


class MetricsLog:
    """Append rows to metrics.jsonl and the Accelerate trackers on the main process; an ``OSError`` opening the file
    or writing a row closes it and is kept in ``failure``, one line naming the file and the row (module docstring)."""

    def __init__(self, path: str | Path, accelerator: Accelerator) -> None:
        self.path = Path(path)
        self.accelerator = accelerator
        self.main = is_main_process()
        self.failure: str | None = None
        self._file = None
        if self.main:
            try:
                self._file = open(self.path, "a")  # noqa: SIM115 - open for the run's lifetime
            except OSError as err:
                self.failure = f"could not open {self.path} ({one_line(err)})"

    def log(self, kind: str, step: int, tokens: int, **fields: Any) -> None:
        row = {"kind": kind, "step": step, "tokens": tokens, **fields}
        if self._file is not None:
            try:
                self._write_line(json.dumps(row) + "\n")
            except OSError as err:
                self.failure = f"could not write the {kind} row of step {step} to {self.path} ({one_line(err)})"
                self.close()
        if kind != "meta" and self.main:
            self.log_to_trackers(flatten_for_tracker(row), step)

    def log_to_trackers(self, values: dict[str, float], step: int) -> None:
        """Each tracker's ``log``; one that fails is dropped with a warning, on the main process alone, with no
        collective (module docstring)."""
        for tracker in list(self.accelerator.trackers):
            try:
                tracker.log(values, step=step)
            except Exception as err:  # TensorBoard raises OSError, W&B its own types
                drop_tracker(self.accelerator, tracker, f"failed at step {step} ({one_line(err)})")

    def _write_line(self, line: str) -> None:
        self._file.write(line)
        self._file.flush()

    def close(self) -> None:
        """Close the file; after a failed write, whatever its buffer still holds is dropped (the flush on close
        would fail the same way)."""
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:
                if self.failure is None:
                    raise


class ProgressBar:
    """tqdm over optimizer steps on the main process (loss, tokens/s; tqdm gives the ETA)."""

    def __init__(self, start: int, total: int) -> None:
        self._main = is_main_process()
        self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, disable=not self._main)

    def update(self, loss: float, tokens_per_s: float) -> None:
        self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        self._bar.update(1)

    def drawn(self) -> bool:
        """Whether the bar is on the screen (the main process's, until ``close``)."""
        return not self._bar.disable

    def write(self, message: str) -> None:
        if self._main:  # tqdm.write prints even when the bar is disabled
            self._bar.write(message)

    def close(self) -> None:
        self._bar.close()
