"""What every bench times with: dtypes, device sync, one timed call, rotated rounds over rows (in this process or
each in its own worker process), the trainer's step, packed documents, and each row's figures against its
``reference`` row (bench/paired.py's statistics).

A round times one call of every row, in an order rotated from round to round, so that a change in machine load
hits every row of that round alike and no row always goes first; a row's ratio is then paired per round with its
reference's. Rows that must be measured alone (their memory, or another tree's ``llm``) each run in a worker
process (``Worker``, the other side ``serve``): the parent asks one worker at a time for one timed call, so the
workers never share the machine, and the process overheads stay outside the timed call.

This module imports from ``llm`` only ``tf32_matmuls``, which every tree since the fused loss has: bench_trees.py's
workers run it against an older tree's ``llm``.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import TypeVar

import torch
from paired import csv_row, paired_ratio, write_csv

from llm.train.step import tf32_matmuls

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Key = TypeVar("Key", bound=Hashable)


def positive_int(text: str) -> int:
    """An argparse type for ``--rounds`` and other counts, checked when the arguments are parsed (before anything
    is built): at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


COMMON = {
    "--preset": {"default": "small-cpu", "help": "configs/sizes/<preset>.yaml"},
    "--rounds": {"type": positive_int, "default": 10, "help": "timed rounds, one call of every row each (paired; "
                                                             "intervals from 6 rounds, bench/paired.py)"},
    "--batch": {"type": positive_int, "default": 8, "help": "the micro batch (sequences)"},
    "--seq": {"type": positive_int, "default": 256, "help": "tokens per sequence"},
    "--compile": {"action": "store_true", "help": "compile as train.compile does (ours per decoder layer)"},
    "--device": {"default": "cpu", "help": "cpu or cuda"},
    "--dtype": {"choices": DTYPES, "default": "fp32"},
    "--threads": {"type": int, "default": 0, "help": "torch threads on CPU (0: torch's default)"},
    "--json": {"metavar": "PATH", "help": "also write the figures (and every round's seconds) as JSON"},
    "--csv": {"metavar": "PATH", "help": "also write one line per row (bench/paired.py CSV_COLUMNS)"},
}
"""The options the benches share, by flag."""


def parser(doc: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def parse(parser: argparse.ArgumentParser, *common: str, **defaults: object) -> argparse.Namespace:
    """``parser``'s arguments with the ``COMMON`` options named (``defaults`` override theirs); torch's threads
    set from ``--threads``."""
    for flag in common:
        parser.add_argument(flag, **COMMON[flag])
    parser.set_defaults(**defaults)
    args = parser.parse_args()
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    return args


def write_figures(args: argparse.Namespace, figures: object = None, rows: list[dict] | None = None) -> None:
    """``figures`` to ``--json`` and ``rows`` to ``--csv`` (bench/paired.py ``write_csv``), each where it was asked
    for (a bench without the option never is)."""
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if getattr(args, "csv", None):
        write_csv(Path(args.csv), rows)


def synchronize(device: torch.device) -> None:
    """Wait for the device (a GPU's kernels return before they are done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> Callable[[], float]:
    """``fn`` as a call that returns its seconds, the device synchronised before and after."""
    def call() -> float:
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start
    return call


def peak_increase(call: Callable[[], float], device: torch.device) -> tuple[int, float]:
    """Run ``call`` once: the bytes by which it raised the peak memory (on CUDA torch's peak allocation, the
    peak reset before it; on CPU the process's peak resident set, which also holds the temporaries: measure it
    in a process of its own), and what ``call`` returned."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    value = call()
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - before, value
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, value


def time_rounds(calls: dict[Key, Callable[[], float]], rounds: int) -> dict[Key, list[float]]:
    """Every row's seconds per round, one call of each row per round, the rows' order rotated round by round."""
    seconds: dict[Key, list[float]] = {key: [] for key in calls}
    keys = list(calls)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            seconds[key].append(calls[key]())
    return seconds


def figures(name: str, reference: str | None, seconds: dict[str, list[float]], tokens: dict[str, int]) -> dict:
    """A row's figures: its tokens/s (median over rounds) and its ratio over ``reference`` (paired per round, per
    token; itself where None), keyed as bench/paired.py's ``CSV_COLUMNS``."""
    per_token = {key: [s / tokens[key] for s in seconds[key]] for key in (name, reference or name)}
    return csv_row(name, reference, statistics.median(1 / s for s in per_token[name]),
                   paired_ratio(per_token[name], per_token[reference or name]))


def make_step(optimizer: torch.optim.Optimizer | Iterable[torch.nn.Parameter], loss: Callable[[], torch.Tensor],
              device: torch.device, dtype: torch.dtype, tf32: bool = True) -> Callable[[], None]:
    """One training micro-step as the trainer takes it: forward under autocast, backward outside it, both in the
    trainer's TF32 scope (``train.tf32``), then ``optimizer``'s step (given parameters instead: a fused AdamW's over
    them, all that bench_trees.py asks of an older tree's ``llm``) and ``zero_grad``."""
    optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else torch.optim.AdamW(optimizer, fused=True)

    def step() -> None:
        with tf32_matmuls(device, tf32):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                value = loss()
            value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def packed_positions(batch: int, seq: int, mean_length: float, device: torch.device) -> torch.Tensor:
    """``[batch, seq]`` position ids restarting at documents of ``mean_length`` tokens on average (exponential
    lengths of at least 1, fixed seed), as the trainer's document masking gives them."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.empty(batch, seq).exponential_(1 / mean_length, generator=generator).long() + 1
    ends = lengths.cumsum(1)
    index = torch.searchsorted(ends, torch.arange(seq).expand(batch, seq).contiguous(), right=True)
    return (torch.arange(seq) - (ends - lengths).gather(1, index)).to(device)


class Worker:
    """A process that builds one row, prints one JSON line about it (``serve``), then answers each ``step`` line
    on its stdin with one timed call's seconds; it exits at the end of its stdin."""

    def __init__(self, argv: list[str], **popen: object) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen)
        self.info = json.loads(self.reply())

    def reply(self) -> str:
        if not (line := self.proc.stdout.readline()):
            raise RuntimeError(self.death())
        return line

    def death(self) -> str:
        """Which worker died and how: its exit code, or the signal that killed it (SIGKILL: often the kernel's
        out-of-memory killer, when too many workers run at once)."""
        code = self.proc.wait()
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited (code {code})"
        return f"the worker {' '.join(self.proc.args)} {how}; its error, if any, is above"

    def __call__(self) -> float:
        try:
            print("step", file=self.proc.stdin, flush=True)
        except BrokenPipeError:
            raise RuntimeError(self.death()) from None
        return float(self.reply())

    def close(self) -> None:
        self.proc.communicate()  # closes its stdin (a worker that died: ignoring the broken pipe) and waits


def worker_rounds(starts: dict[Key, Callable[[], Worker]],
                  rounds: int) -> tuple[dict[Key, dict], dict[Key, list[float]]]:
    """Start every worker (each sets up alone), then time them in rounds: each one's set-up info and seconds."""
    workers: dict[Key, Worker] = {}
    try:
        for key, start in starts.items():
            workers[key] = start()
        return {key: w.info for key, w in workers.items()}, time_rounds(workers, rounds)
    finally:
        for worker in workers.values():
            worker.close()


def serve(call: Callable[[], float], info: dict) -> None:
    """The worker's side of ``Worker``: ``info`` as one JSON line, then one ``call`` per ``step`` line."""
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        if line.strip() == "step":
            print(call(), flush=True)
