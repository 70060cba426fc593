"""Forward + backward time and peak memory of the attention scorings, against SDPA softmax.

    .venv/bin/python bench/bench_attention.py            # T = 512 .. 8192
    .venv/bin/python bench/bench_attention.py --quick    # T <= 2048
    .venv/bin/python bench/bench_attention.py --tune 16,32,64,128,256   # iso_tanh chunk sizes
    .venv/bin/python bench/bench_attention.py --device cuda --dtype bf16 --impls sdpa,chunked,fla

Each (implementation, T) runs in its own subprocess so that its memory is measured alone: "MiB" is
the increase of the process's peak resident set over the run (the inputs and a tiny warm-up pass come
before the baseline), which on CPU covers everything autograd keeps alive plus the largest
temporaries; on CUDA it is the increase of torch's peak allocated GPU memory. Time is the best of
``--repeats`` forward + backward passes after one warm-up pass (the best, not the median: on a shared
machine the spread comes from other processes). Use ``--threads 1``
on a busy machine: oversubscribed OpenMP threads make every small op slow. Ratios are SDPA's time (memory)
divided by the implementation's: above 1 means faster (smaller) than SDPA.

Implementations:
  sdpa        softmax through F.scaled_dot_product_attention (``SoftmaxScoring``)
  naive       iso_tanh_naive, the O(T^2) reference (skipped above ``--naive-max-t``)
  chunked     iso_tanh_chunked, all chunks at once (what ``IsoTanhScoring`` runs eagerly on CPU, and on CUDA below
              ``FLA_MIN_LENGTH``)
  chunked_compiled  the same under ``torch.compile`` (what ``train.compile`` runs there)
  chunk_loop  iso_tanh_chunked called once per chunk with the carried state: the Python-loop
              alternative to the vectorised form, for comparison
  fla         iso_tanh through flash-linear-attention's chunked Triton kernel, llm/model/fla_kernel.py's custom
              ops (what ``IsoTanhScoring`` runs eagerly on CUDA from ``FLA_MIN_LENGTH`` on; needs fla-core and a GPU)
  fla_compiled  the same under ``torch.compile`` (``fullgraph=True``: the ops compile without a graph break),
              what ``train.compile`` runs on CUDA from ``FLA_MIN_LENGTH`` on
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llm.model.attention import SoftmaxScoring
from llm.model.config import ModelConfig
from llm.model.fla_kernel import fla_kernel
from llm.model.iso_tanh import (
    iso_tanh_chunked,
    iso_tanh_linear_attention,
    iso_tanh_naive,
)

IMPLS = ("sdpa", "naive", "chunked", "chunked_compiled", "chunk_loop", "fla", "fla_compiled")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def chunk_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int) -> torch.Tensor:
    outs, state = [], None
    for lo in range(0, q.shape[2], chunk_size):
        piece = slice(lo, lo + chunk_size)
        out, state = iso_tanh_chunked(q[:, :, piece], k[:, :, piece], v[:, :, piece], chunk_size, state)
        outs.append(out)
    return torch.cat(outs, dim=2)


def fla_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    kernel = fla_kernel()
    if kernel is None:
        raise RuntimeError("fla: flash-linear-attention is not importable (pip install -e '.[gpu]', on a GPU)")
    return iso_tanh_linear_attention(q, k, v, None, kernel)[0]


def attention_fn(impl: str, chunk_size: int) -> Attention:
    softmax = SoftmaxScoring(ModelConfig())

    def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return iso_tanh_chunked(q, k, v, chunk_size)[0]

    return {
        "sdpa": lambda q, k, v: softmax(q, k, v)[0],
        "naive": iso_tanh_naive,
        "chunked": chunked,
        "chunked_compiled": torch.compile(chunked, fullgraph=True),
        "chunk_loop": lambda q, k, v: chunk_loop(q, k, v, chunk_size),
        "fla": fla_attention,
        "fla_compiled": torch.compile(fla_attention, fullgraph=True),
    }[impl]


def start_peak(device: torch.device) -> float:
    """The memory the measured peak is counted from. On CUDA the peak is reset here: the warm-up (fla's
    autotuning above all) can peak higher than the measured passes, which would read as zero."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    return peak_mib(device)


def peak_mib(device: torch.device) -> float:
    """The process's peak resident set on CPU (Linux reports KiB); torch's peak allocation on CUDA."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One (impl, T) in this process: best fwd+bwd milliseconds and peak-memory increase in MiB."""
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    q, k, v = (torch.randn(args.batch, heads, args.t, args.head_dim, dtype=dtype, device=device).requires_grad_()
               for heads in (args.heads, args.kv_heads, args.kv_heads))
    grad_out = torch.randn(args.batch, args.heads, args.t, args.head_dim, dtype=dtype, device=device)
    fn = attention_fn(args.impl, args.chunk_size)
    small = [x[:, :, :16].detach().requires_grad_(True) for x in (q, k, v)]
    fn(*small).sum().backward()  # one-time costs (kernel set-up, thread pools) stay out of the delta
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    synchronize()
    baseline = start_peak(device)
    times = []
    for _ in range(1 + args.repeats):
        start = time.perf_counter()
        fn(q, k, v).backward(grad_out)
        synchronize()
        times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    return {"ms": 1e3 * min(times[1:]), "mib": peak_mib(device) - baseline}


def run_worker(args: argparse.Namespace, impl: str, t: int, chunk_size: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--worker", f"--impl={impl}", f"--t={t}", f"--chunk-size={chunk_size}"]
    for flag in ("batch", "heads", "kv_heads", "head_dim", "dtype", "repeats", "threads", "device"):
        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{impl} at T={t} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fmt(result: dict[str, float] | None, ref: dict[str, float], key: str) -> str:
    if result is None:
        return "skipped"
    return f"{result[key]:9.1f} ({ref[key] / max(result[key], 1e-9):4.1f}x)"


def compare(args: argparse.Namespace) -> None:
    impls = [impl for impl in IMPLS if impl in args.impls]
    print(f"B={args.batch} H={args.heads} Hkv={args.kv_heads} D={args.head_dim} dtype={args.dtype} "
          f"device={args.device} threads={args.threads} chunk={args.chunk_size}; value (SDPA / value)")
    header = ["T"] + [f"{impl} ms" for impl in impls] + [f"{impl} MiB" for impl in impls]
    print(" | ".join(f"{h:>18}" for h in header))
    by_length = {}
    for t in args.lengths:
        results = {impl: None if impl == "naive" and t > args.naive_max_t else
                   run_worker(args, impl, t, args.chunk_size) for impl in impls}
        by_length[t] = results
        ref = results["sdpa"]
        cells = [str(t)] + [fmt(results[i], ref, key) for key in ("ms", "mib") for i in impls]
        print(" | ".join(f"{c:>18}" for c in cells), flush=True)
        if args.json:  # after every length, so that a run stopped by a time box keeps what it measured
            Path(args.json).write_text(json.dumps(by_length, indent=1))
    if "naive" in impls and max(args.lengths) > args.naive_max_t:
        print(f"naive skipped above T={args.naive_max_t}: it holds several B*H*T^2 score tensors "
              f"(raise --naive-max-t to run it)")


def tune(args: argparse.Namespace) -> None:
    print(f"iso_tanh_chunked fwd+bwd ms by chunk size (B={args.batch} H={args.heads} Hkv={args.kv_heads} "
          f"D={args.head_dim} dtype={args.dtype} threads={args.threads})")
    print(" | ".join(f"{h:>10}" for h in ["T", *map(str, args.tune)]))
    for t in args.lengths:
        cells = [f"{run_worker(args, 'chunked', t, c)['ms']:.1f}" for c in args.tune]
        print(" | ".join(f"{c:>10}" for c in [str(t), *cells]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--quick", action="store_true", help="only T <= 2048")
    parser.add_argument("--impls", type=lambda s: s.split(","), default=[i for i in IMPLS if "fla" not in i
                                                                          and "compiled" not in i],
                        help=f"comma-separated, from {','.join(IMPLS)} (default: all but fla, which needs a GPU, "
                             f"and chunked_compiled, which compiles for minutes on CPU)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=0, help="0: same as --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--chunk-size", type=int, default=ModelConfig.iso_tanh_chunk_size)
    parser.add_argument("--tune", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="comma-separated chunk sizes: time iso_tanh_chunked for each instead")
    parser.add_argument("--naive-max-t", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", metavar="PATH", help="also write {T: {impl: {ms, mib}}} to PATH")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--t", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.kv_heads = args.kv_heads or args.heads
    if args.quick:
        args.lengths = [t for t in args.lengths if t <= 2048]
    unknown = set(args.impls) - set(IMPLS)
    if unknown or "sdpa" not in args.impls:
        parser.error(f"--impls: must include sdpa and name only {', '.join(IMPLS)}")
    if any("fla" in impl for impl in args.impls) and args.device != "cuda":
        parser.error("--impls fla, fla_compiled: flash-linear-attention's kernels run on --device cuda only")
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(measure(args)))
    elif args.tune:
        tune(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
