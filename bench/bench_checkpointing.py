"""Activation checkpointing: activation memory and step time with and without it, side by side in one run.

    .venv/bin/python bench/bench_checkpointing.py --threads 2            # 134m preset, batch 1 x 1024, fp32
    python bench/bench_checkpointing.py --device cuda --dtype bf16 --seq 2048 --batch 8

Modes: ``none``; ``every_2`` and ``full`` (``train.activation_checkpointing`` = 2 and 1: every second layer or
every layer keeps only its input, transformers' ``activation_checkpointing_enable``). Each mode runs in its own
subprocess so its memory is measured alone. "saved MiB" is what autograd keeps after the forward pass (counted
through saved-tensor hooks, the weights excluded: a deterministic count), "peak MiB" the measured increase of the
peak over a forward + backward step (on CPU the process's peak resident set, which also holds the temporaries and
the recomputed layer; on CUDA torch's peak allocated memory). Time is the best of ``--rounds`` steps after a
warm-up. Ratios are against ``none``; the goal is activation memory at most 40% of ``none`` for at
most 35% more step time at the 134m preset.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from dataclasses import replace

import torch

from llm.config import load_config
from llm.model import IsoLLMConfig, IsoLLMForCausalLM

MODES = {"none": 0, "every_2": 2, "full": 1}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def saved_bytes(model: IsoLLMForCausalLM, ids: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids[:, :-1], shift_labels=ids[:, 1:]).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def child(args: argparse.Namespace) -> None:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    base = load_config(f"configs/sizes/{args.preset}.yaml", ["train.max_steps=1"]).model
    base = replace(base, max_position_embeddings=max(base.max_position_embeddings, args.seq))
    torch.manual_seed(0)
    model = IsoLLMForCausalLM(IsoLLMConfig.from_model_config(base)).to(device, dtype).train()
    if MODES[args.child]:
        model.activation_checkpointing_enable(every_n_layers=MODES[args.child])
    ids = torch.randint(0, base.vocab_size, (args.batch, args.seq + 1), device=device)
    for p in model.parameters():  # the gradients' memory is part of the baseline, not of the activations
        p.grad = torch.zeros_like(p)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    baseline = peak_bytes(device)  # the process's peak so far: the first step is what raises it
    model(ids[:, :-1], shift_labels=ids[:, 1:]).loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = peak_bytes(device) - baseline
    saved, best = saved_bytes(model, ids), float("inf")
    for _ in range(args.rounds):
        start = time.perf_counter()
        model(ids[:, :-1], shift_labels=ids[:, 1:]).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    print(json.dumps({"seconds": best, "saved": saved, "peak": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="134m", help="configs/sizes/<preset>.yaml")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return
    print(f"# activation checkpointing, {args.preset}, batch {args.batch} x {args.seq}, {args.dtype}, {args.device}")
    print(f"{'mode':>9}{'step s':>9}{'saved MiB':>11}{'peak MiB':>10}{'time ratio':>12}{'saved ratio':>13}"
          f"{'peak ratio':>12}")
    results = {}
    for mode in MODES:
        argv = [sys.executable, __file__, *sys.argv[1:], "--child", mode]
        results[mode] = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
        row, none = results[mode], results["none"]
        print(f"{mode:>9}{row['seconds']:>9.2f}{row['saved'] / 2**20:>11.0f}{row['peak'] / 2**20:>10.0f}"
              f"{row['seconds'] / none['seconds']:>11.2f}x{row['saved'] / none['saved']:>12.2f}x"
              f"{row['peak'] / max(none['peak'], 1):>11.2f}x")


if __name__ == "__main__":
    main()
