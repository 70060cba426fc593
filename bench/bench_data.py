"""Data-pipeline throughput: read + tokenize + pack + shuffle tokens/s of the training loader on the FineWeb
sample, with the Qwen3 tokenizer and a small trained BPE, for 0/1/2 DataLoader workers, next to what a
training step consumes, and how many workers (one core each) keep up with a GPU.

    .venv/bin/python bench/bench_data.py                       # defaults: ../shared/data/fineweb-sample
    .venv/bin/python bench/bench_data.py --workers 0 1 2 --no-bpe --tokens 2000000

The loader must outpace training: the ratio column is loader tokens/s over the training step's tokens/s
(~2,000 tokens/s for a 14M model at vocab 8192 on this CPU, ~280 at the Qwen3 vocabulary); the last column
is ceil(gpu tokens/s / loader tokens/s) of the 1-worker row (a worker tokenizes on one thread, so that
row is the rate of one worker process and its core): the DataLoader workers per GPU that keep up with
``--gpu-tokens-per-s`` (default 700,000: the 83m preset at 40% MFU on one H100, about 400 TFLOP/s over
~570 MFLOP per token).
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import harness
from tokenizers import Tokenizer

from llm.config import DataConfig
from llm.data.stream import build_train_loader
from llm.data.tokenizer import load_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[1]


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
    args = parser.parse_args()

    tokenizers = {"qwen3": load_tokenizer(None)}
    if args.bpe:
        tokenizers["bpe"] = load_tokenizer(args.bpe)
    elif not args.no_bpe:
        start = time.perf_counter()
        bpe = train_tokenizer([args.source], args.bpe_vocab, tempfile.mkdtemp())
        tokenizers[f"bpe-{args.bpe_vocab}"] = bpe
        print(f"trained bpe-{args.bpe_vocab} in {time.perf_counter() - start:.1f} s")

    steps = "  ".join(f"{t:,.0f}/s" for t in args.step_tokens_per_s)
    print(f"seq_len {args.seq_len}, micro batch {args.micro_batch_size}, {args.tokens:,} tokens per row")
    print(f"{'tokenizer':<12}{'workers':>8}{'first batch s':>15}{'tokens/s':>12}   "
          f"loader / training ({steps})   workers per GPU at {args.gpu_tokens_per_s:,.0f}/s")
    for name, tok in tokenizers.items():
        for workers in args.workers:
            cfg = DataConfig(source=args.source, seq_len=args.seq_len, num_workers=workers,
                             shuffle_block=args.shuffle_block)
            first, rate = measure(cfg, tok, args.micro_batch_size, args.tokens)
            ratios = "  ".join(f"{rate / t:>8.1f}x" for t in args.step_tokens_per_s)
            per_gpu = f"{math.ceil(args.gpu_tokens_per_s / rate):>6}" if workers == 1 else ""
            print(f"{name:<12}{workers:>8}{first:>15.2f}{rate:>12,.0f}   {ratios}   {per_gpu}")


if __name__ == "__main__":
    main()
