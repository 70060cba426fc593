"""Document masking's cost: forward + backward of the whole model on packed windows, with position_ids that
restart at each document (masked) against plain positions (unmasked), side by side in one run.

    .venv/bin/python bench/bench_packing.py --threads 2               # small-cpu, T = 1024, batch 4
    python bench/bench_packing.py --device cuda --dtype bf16 --preset 134m --seq 2048 --batch 8

The documents have FineWeb's length distribution roughly (exponential, mean ``--mean-doc`` tokens), so a
window holds a few. Masked softmax runs SDPA with a dense block-diagonal ``[B, 1, T, T]`` mask, which rules
out the flash kernel; iso_tanh restarts its chunked sums (on CUDA it leaves fla's kernel for the torch form);
isogmlp's causal mean restarts its prefix. After one warm-up step of each, every round times one unmasked and
one masked step (in alternating order); the seconds are the median round's, and the ratio is masked over
unmasked within each round (above 1: masking costs that much more), the median over ``--rounds`` with its 95%
bootstrap interval (bench/paired.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from paired import paired_ratio

from llm.config import load_config
from llm.model import IsoLLMConfig, IsoLLMForCausalLM

VARIANTS = {
    "swiglu+softmax": dict(),
    "swiglu+iso_tanh": dict(attn_scoring="iso_tanh"),
    "isogmlp[causal_mean]+softmax": dict(ffn="isogmlp", isogmlp_gate="causal_mean"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def packed_positions(batch: int, seq: int, mean_doc: float, generator: torch.Generator) -> torch.Tensor:
    """``[batch, seq]`` positions restarting at 0 at each document (exponential lengths, at least 1)."""
    rows = []
    for _ in range(batch):
        pieces, filled = [], 0
        while filled < seq:
            length = max(1, int(torch.empty(1).exponential_(1 / mean_doc, generator=generator)))
            pieces.append(torch.arange(min(length, seq - filled)))
            filled += len(pieces[-1])
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


def step_seconds(model: IsoLLMForCausalLM, ids: torch.Tensor, positions: torch.Tensor | None) -> float:
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model(ids, position_ids=positions, shift_labels=ids).loss.backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)  # outside the timing: the trainer's zero_grad is no part of what is compared
    return elapsed


def paired_seconds(model: IsoLLMForCausalLM, ids: torch.Tensor, positions: torch.Tensor,
                   rounds: int) -> tuple[list[float], list[float]]:
    """Per round, one unmasked and one masked step's seconds (alternating which goes first), after a warm-up
    step of each."""
    for mask in (None, positions):
        step_seconds(model, ids, mask)
    plain, masked = [], []
    for r in range(rounds):
        for mask in ((None, positions) if r % 2 == 0 else (positions, None)):
            (plain if mask is None else masked).append(step_seconds(model, ids, mask))
    return plain, masked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-cpu", help="configs/sizes/<preset>.yaml")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--mean-doc", type=float, default=400.0, help="mean document length in tokens")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    base = load_config(f"configs/sizes/{args.preset}.yaml", ["train.max_steps=1"]).model
    base = replace(base, max_position_embeddings=max(base.max_position_embeddings, args.seq))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, base.vocab_size, (args.batch, args.seq), generator=generator).to(device)
    positions = packed_positions(args.batch, args.seq, args.mean_doc, generator).to(device)
    documents = int((positions == 0).sum())
    print(f"# training step (forward + backward), {args.preset}, batch {args.batch} x {args.seq}, {args.dtype}, "
          f"{device.type}; {documents} documents ({documents / args.batch:.1f} per window)")
    print(f"{'variant':>30}{'unmasked s':>12}{'masked s':>10}{'masked / unmasked [95% interval]':>34}")
    for name, overrides in VARIANTS.items():
        torch.manual_seed(0)
        config = IsoLLMConfig.from_model_config(replace(base, **overrides))
        model = IsoLLMForCausalLM(config).to(device, DTYPES[args.dtype]).train()
        plain, masked = paired_seconds(model, ids, positions, args.rounds)
        ratio = paired_ratio(plain, masked)  # per round: masked seconds over unmasked
        print(f"{name:>30}{statistics.median(plain):>12.3f}{statistics.median(masked):>10.3f}{ratio!s:>34}")


if __name__ == "__main__":
    main()
