"""Forward + backward time and peak memory of the attention scorings, against SDPA softmax.

    .venv/bin/python bench/bench_attention.py                      # T = 512 .. 8192
    .venv/bin/python bench/bench_attention.py --lengths 512,1024,2048
    .venv/bin/python bench/bench_attention.py --impls sdpa,chunked --chunk-size 16,32,64,128   # chunk sizes
    .venv/bin/python bench/bench_attention.py --device cuda --dtype bf16 --impls sdpa,chunked,fla

Each (implementation, T) runs in its own worker process (bench/harness.py ``Worker``) so that its memory is
measured alone: "MiB" is the increase of the process's peak resident set over its first full pass (the inputs and
a tiny warm-up pass come before the baseline), which on CPU covers everything autograd keeps alive plus the
largest temporaries; on CUDA it is the increase of torch's peak allocated GPU memory. Then the workers of one T
are timed in ``--rounds`` rounds, one forward + backward pass of each per round (one worker at a time, in an
order rotated round by round), and each implementation's speed over SDPA's is paired per round: ms is the median
round's, the ratio SDPA's seconds over the implementation's, median [95% interval] (bench/paired.py; at least 6
rounds), above 1 faster than SDPA. The memory ratio is SDPA's MiB over the implementation's (one measurement: the
allocations repeat exactly). Use ``--threads 1`` on a busy machine: oversubscribed OpenMP threads make every small
op slow. With several ``--chunk-size`` values each chunked form runs at each (rows ``IMPL@SIZE``), so the sizes
compare through their paired ratios over SDPA.

Implementations:
  sdpa        softmax through F.scaled_dot_product_attention (``SoftmaxScoring``)
  chunked     iso_tanh_chunked, all chunks at once (what ``IsoTanhScoring`` runs eagerly on CPU, and on CUDA below
              ``FLA_MIN_LENGTH``)
  chunked_compiled  the same under ``torch.compile`` (what ``train.compile`` runs there)
  fla         iso_tanh through flash-linear-attention's chunked Triton kernel, llm/model/fla_kernel.py's custom
              ops (what ``IsoTanhScoring`` runs eagerly on CUDA from ``FLA_MIN_LENGTH`` on; needs fla-core and a GPU)
  fla_compiled  the same under ``torch.compile`` (``fullgraph=True``: the ops compile without a graph break),
              what ``train.compile`` runs on CUDA from ``FLA_MIN_LENGTH`` on
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import harness
import torch
from harness import DTYPES, Worker, peak_increase, serve, timed, worker_rounds
from paired import paired_ratio

from llm.model.attention import SoftmaxScoring
from llm.model.config import ModelConfig
from llm.model.fla_kernel import fla_kernel
from llm.model.iso_tanh import iso_tanh_chunked, iso_tanh_linear_attention

IMPLS = ("sdpa", "chunked", "chunked_compiled", "fla", "fla_compiled")
CHUNKED = ("chunked", "chunked_compiled")


def fla_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    kernel = fla_kernel()
    if kernel is None:
        raise RuntimeError("fla: flash-linear-attention is not importable (pip install -e '.[gpu]', on a GPU)")
    return iso_tanh_linear_attention(q, k, v, None, kernel)[0]


def attention_fn(impl: str, chunk_size: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    softmax = SoftmaxScoring(ModelConfig())

    eager = {"sdpa": lambda q, k, v: softmax(q, k, v)[0], "fla": fla_attention,
             "chunked": lambda q, k, v: iso_tanh_chunked(q, k, v, chunk_size)[0]}
    fn = eager[impl.removesuffix("_compiled")]  # an IMPL_compiled is IMPL under torch.compile, graph-break free
    return torch.compile(fn, fullgraph=True) if impl.endswith("_compiled") else fn


def worker(args: argparse.Namespace) -> None:
    """One (impl, T, chunk size) in this process: its first full pass's peak-memory increase in MiB, then one
    timed forward + backward pass per request (bench/harness.py ``serve``)."""
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    q, k, v = (torch.randn(args.batch, heads, args.t, args.head_dim, dtype=dtype, device=device).requires_grad_()
               for heads in (args.heads, args.kv_heads, args.kv_heads))
    grad_out = torch.randn(args.batch, args.heads, args.t, args.head_dim, dtype=dtype, device=device)
    fn = attention_fn(args.worker, args.chunk_size[0])
    # a tiny pass first: one-time costs (kernel set-up, thread pools, fla's autotuning) stay out of the measurement
    fn(*(x[:, :, :16].detach().requires_grad_() for x in (q, k, v))).sum().backward()

    def step() -> None:
        fn(q, k, v).backward(grad_out)
        q.grad = k.grad = v.grad = None

    mib, _ = peak_increase(timed(step, device), device)
    serve(timed(step, device), {"mib": mib / 2**20})


def compare(args: argparse.Namespace) -> None:
    """Per length, every implementation (each chunked one at each chunk size) in its worker, timed in paired
    rounds: its median ms with its speed over SDPA's, and its MiB with SDPA's over it."""
    rows = {f"{impl}@{c}" if impl in CHUNKED and len(args.chunk_size) > 1 else impl: (impl, c)
            for impl in IMPLS if impl in args.impls for c in (args.chunk_size if impl in CHUNKED else [0])}
    print(f"B={args.batch} H={args.heads} Hkv={args.kv_heads} D={args.head_dim} dtype={args.dtype} device="
          f"{args.device} threads={args.threads}, {args.rounds} rounds; ms (SDPA's time over it, paired per round: "
          f"median [95% interval]) | MiB (SDPA's over it)")
    print(" | ".join([f"{'T':>6}", *(f"{n + ' ms':>40}" for n in rows), *(f"{n + ' MiB':>18}" for n in rows)]))
    by_length: dict[int, dict[str, dict | None]] = {}
    for t in args.lengths:
        def start(impl: str, chunk: int, t: int = t) -> Worker:
            return Worker([sys.executable, __file__, *sys.argv[1:], "--worker", impl, f"--t={t}",
                           f"--chunk-size={chunk or args.chunk_size[0]}"])

        info, seconds = worker_rounds({name: lambda r=row: start(*r) for name, row in rows.items()}, args.rounds)
        by_length[t] = {name: {"ms": 1e3 * statistics.median(seconds[name]), "seconds": seconds[name],
                               "mib": info[name]["mib"]} for name in rows}
        ref = by_length[t]["sdpa"]
        times = [f"{r['ms']:.2f} ({paired_ratio(r['seconds'], ref['seconds'])!s})" for r in by_length[t].values()]
        mibs = [f"{r['mib']:.1f} ({ref['mib'] / max(r['mib'], 1e-9):.1f}x)" for r in by_length[t].values()]
        print(" | ".join([f"{t:>6}", *(f"{c:>40}" for c in times), *(f"{c:>18}" for c in mibs)]), flush=True)
        harness.write_figures(args, by_length)  # after every length: a run stopped by a time box keeps them


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--impls", type=lambda s: s.split(","), default=["sdpa", "chunked"],
                        help=f"comma-separated, from {','.join(IMPLS)} (default: all but fla, which needs a GPU, "
                             f"and chunked_compiled, which compiles for minutes on CPU)")
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=0, help="0: same as --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=lambda s: [int(x) for x in s.split(",")],
                        default=[ModelConfig.iso_tanh_chunk_size], help="iso_tanh's chunk size (comma-separated: each)")
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--t", type=int, help=argparse.SUPPRESS)
    args = harness.parse(parser, "--batch", "--device", "--dtype", "--rounds", "--threads", "--json", batch=1)
    args.kv_heads = args.kv_heads or args.heads
    if not {"sdpa"} <= set(args.impls) <= set(IMPLS):
        parser.error(f"--impls: must include sdpa and name only {', '.join(IMPLS)}")
    if any("fla" in impl for impl in args.impls) and args.device != "cuda":
        parser.error("--impls fla, fla_compiled: flash-linear-attention's kernels run on --device cuda only")
    worker(args) if args.worker else compare(args)


if __name__ == "__main__":
    main()
