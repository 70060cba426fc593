"""Data-pipeline throughput: read + tokenize + pack + shuffle tokens/s of the training loader on the FineWeb
sample, with the Qwen3 tokenizer and a small trained BPE, for 0/1/2 DataLoader workers, next to what a
training step consumes, and how many workers (one core each) keep up with a GPU; with ``--startup``, what a
training start and a resume cost against the source's size instead (below).

    .venv/bin/python bench/bench_data.py                       # defaults: ../shared/data/fineweb-sample
    .venv/bin/python bench/bench_data.py --workers 0 1 2 --no-bpe --tokens 2000000
    .venv/bin/python bench/bench_data.py --startup 0.1 2 --seq-len 64    # sources of 0.1 and 2 GB, 1 and 2 ranks

The loader must outpace training: the ratio column is loader tokens/s over the training step's tokens/s
(~2,000 tokens/s for a 14M model at vocab 8192 on this CPU, ~280 at the Qwen3 vocabulary); the last column
is ceil(gpu tokens/s / loader tokens/s) of the 1-worker row (a worker tokenizes on one thread, so that
row is the rate of one worker process and its core): the DataLoader workers per GPU that keep up with
``--gpu-tokens-per-s`` (default 700,000: the 83m preset at 40% MFU on one H100, about 400 TFLOP/s over
~570 MFLOP per token).

``--startup GB...``: for each size, a local parquet source of about that many GB (copies of one file of the
sample's rows repeated, ~100 MB) is built in a temporary directory (under /tmp; removed after). For each source and
each ``--ranks`` count of processes (started as torchrun starts them: ``RANK``, ``WORLD_SIZE``), a start runs
train.py (a 2-layer model of hidden size 32 at Qwen3's vocabulary: one step and its checkpoint) on cold data caches
(a fresh ``data.cache_dir``: footers, content digests, validation windows), then a resume loads that checkpoint
with the caches warm and exits where its first step would start (``train.max_steps`` reached). Each is timed from
launching its ranks to their exit (the start's includes its step, a 2-window evaluation and the checkpoint's save,
alike for every source), and each rank's reads are
its ``rchar`` (/proc/self/io: every byte read through a system call, page-cache hits included; Linux adds a reaped
child's to its parent's, so the ranks are reaped one at a time): the imports and the tokenizer read ~200 MB per rank
whatever the source, the content fingerprint reads the source. The built files are in the page cache (dropping it
needs root): a cold disk adds its read time to every byte still read.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data.stream import build_train_loader
from llm.data.tokenizer import load_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
STARTUP_RUN = ["model.vocab_size=151680", "model.hidden_size=32", "model.intermediate_size=64", "trackers=[]",
               "model.num_hidden_layers=2", "model.num_attention_heads=2", "model.num_key_value_heads=1"]


def measure(cfg: DataConfig, tok: Tokenizer, micro_batch_size: int, tokens: int) -> tuple[float, float]:
    """(seconds to the first batch, tokens/s over the whole run, startup included) for one loader.

    The first batch waits for a whole shuffle block (shuffle_block windows), after which a block's batches
    come from memory: only a run over several blocks measures the sustained rate."""
    start = time.perf_counter()
    loader = iter(build_train_loader(cfg, tok, micro_batch_size, 0, 1))
    next(loader)
    first = time.perf_counter() - start
    per_batch = micro_batch_size * (cfg.seq_len + 1)
    batches = max(2, tokens // per_batch)
    for _ in range(batches - 1):
        next(loader)
    return first, batches * per_batch / (time.perf_counter() - start)


def launch(ranks: int, overrides: list[str]) -> tuple[float, list[int]]:
    """train.py on ``ranks`` processes: seconds until the last exits, and the bytes each read (``rchar``)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free.getsockname()[1]), "WORLD_SIZE": str(ranks)}
    start, reads = time.time(), []
    procs = [subprocess.Popen([sys.executable, "train.py", *overrides], cwd=REPO, stdout=subprocess.DEVNULL,
                              env={**os.environ, "ACCELERATE_USE_CPU": "1", **(
                                  {**group, "RANK": str(r), "LOCAL_RANK": str(r)} if ranks > 1 else {})})
             for r in range(ranks)]
    for proc in procs:
        before = int(Path("/proc/self/io").read_text().split()[1])
        if proc.wait():
            raise RuntimeError(f"train.py {' '.join(overrides)} exited {proc.returncode}")
        reads.append(int(Path("/proc/self/io").read_text().split()[1]) - before)
    return time.time() - start, reads


def startup(args: argparse.Namespace) -> None:
    """The ``--startup`` table (module docstring): per source and process count, a start and a resume."""
    sample = pa.concat_tables(pq.read_table(f, columns=["text", "id"]) for f in Path(args.source).glob("*.parquet"))
    print(f"{'GB':>5}{'ranks':>6}{'start s':>9}{'resume s':>9}  MB read per rank: start | resume")
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(pa.concat_tables([sample] * 14), one := Path(tmp, "one.parquet"))  # ~100 MB
        for i, gb in enumerate(args.startup):
            (source := Path(tmp, str(i))).mkdir()
            for k in range(max(1, round(gb * 1e9 / one.stat().st_size))):
                shutil.copyfile(one, source / f"{k}.parquet")
            size = sum(f.stat().st_size for f in source.iterdir()) / 1e9
            for ranks in args.ranks:
                run = [*STARTUP_RUN, f"data.source={source}", f"data.cache_dir={tmp}/cache-{i}-{ranks}",
                       f"out_dir={tmp}", f"name={i}-{ranks}", "data.val_tokens=130", f"data.seq_len={args.seq_len}",
                       "train.micro_batch_size=2", f"train.global_batch_tokens={2 * ranks * args.seq_len}"]
                (start, first), (resume, then) = (launch(ranks, [*run, *extra]) for extra in (
                    ["train.max_steps=1"], ["train.max_steps=1", "resume=true"]))
                mb = [", ".join(f"{b / 1e6:.0f}" for b in reads) for reads in (first, then)]
                print(f"{size:>5.2f}{ranks:>6}{start:>9.1f}{resume:>9.1f}  {mb[0]} | {mb[1]}", flush=True)
            shutil.rmtree(source)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--source", default=str(REPO / "../shared/data/fineweb-sample"))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4_000_000,
                        help="tokens timed per configuration (several shuffle blocks)")
    parser.add_argument("--shuffle-block", type=int, default=64, help="windows per shuffle block")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2],
                        help="DataLoader workers per configuration (0: in-process, multi-threaded tokenizer)")
    parser.add_argument("--bpe", help="a trained tokenizer.json to use instead of training one")
    parser.add_argument("--bpe-vocab", type=int, default=8192)
    parser.add_argument("--no-bpe", action="store_true", help="measure the Qwen3 tokenizer only")
    parser.add_argument("--gpu-tokens-per-s", type=float, default=700_000.0,
                        help="what one GPU consumes, for the workers-per-GPU column")
    parser.add_argument("--step-tokens-per-s", type=float, nargs="+", default=[2000.0, 280.0],
                        help="training throughput(s) to compare with (tokens/s of a training step)")
    parser.add_argument("--startup", type=float, nargs="+", metavar="GB", help="the start-up table, of these sources")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="--startup: processes per run")
    args = parser.parse_args()
    if args.startup:
        return startup(args)

    # the trained BPE and the loaders' data caches (footers, digests): a fresh folder, removed after, never the
    # repository's data_cache/ (DataConfig's default), which a test suite running beside this checks stays absent
    with tempfile.TemporaryDirectory() as scratch:
        tokenizers = {"qwen3": load_tokenizer(None)}
        if args.bpe:
            tokenizers["bpe"] = load_tokenizer(args.bpe)
        elif not args.no_bpe:
            start = time.perf_counter()
            tokenizers[f"bpe-{args.bpe_vocab}"] = train_tokenizer([args.source], args.bpe_vocab, scratch)
            print(f"trained bpe-{args.bpe_vocab} in {time.perf_counter() - start:.1f} s")

        steps = "  ".join(f"{t:,.0f}/s" for t in args.step_tokens_per_s)
        print(f"seq_len {args.seq_len}, micro batch {args.micro_batch_size}, {args.tokens:,} tokens per row")
        print(f"{'tokenizer':<12}{'workers':>8}{'first batch s':>15}{'tokens/s':>12}   "
              f"loader / training ({steps})   workers per GPU at {args.gpu_tokens_per_s:,.0f}/s")
        for name, tok in tokenizers.items():
            for workers in args.workers:
                cfg = DataConfig(source=args.source, seq_len=args.seq_len, num_workers=workers,
                                 shuffle_block=args.shuffle_block, cache_dir=scratch)
                first, rate = measure(cfg, tok, args.micro_batch_size, args.tokens)
                ratios = "  ".join(f"{rate / t:>8.1f}x" for t in args.step_tokens_per_s)
                per_gpu = f"{math.ceil(args.gpu_tokens_per_s / rate):>6}" if workers == 1 else ""
                print(f"{name:<12}{workers:>8}{first:>15.2f}{rate:>12,.0f}   {ratios}   {per_gpu}")


if __name__ == "__main__":
    main()
