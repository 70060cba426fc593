"""One row of bench/bench_trees.py: a training step of one variant, built from the ``llm`` package of the tree
this process runs in (``PYTHONPATH`` and working directory set to that tree by bench_trees.py), timed on request.

It prints ``ready SECONDS`` after its warm-up step (the first step's seconds), then for every ``step`` line read
from stdin takes one step and prints its seconds; it exits at the end of stdin. It uses only what every tree of
this repository since the fused loss has (``load_config``, ``IsoLLMForCausalLM(shift_labels=...)``,
``compile_decoder_layers``, ``tf32_matmuls``), so that an older commit's tree runs it unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from llm.config import load_config
from llm.model import IsoLLMConfig, IsoLLMForCausalLM
from llm.train.setup import compile_decoder_layers
from llm.train.step import tf32_matmuls

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--variant", required=True, help="FFN+SCORING")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--dtype", choices=DTYPES, required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    ffn, _, scoring = args.variant.partition("+")
    base = load_config(f"configs/sizes/{args.preset}.yaml", ["train.max_steps=1"]).model
    config = dataclasses.replace(base, ffn=ffn, attn_scoring=scoring, ffn_param_match=ffn != "swiglu")
    torch.manual_seed(0)
    model = IsoLLMForCausalLM(IsoLLMConfig.from_model_config(config)).to(device).train()
    if args.compile:
        compile_decoder_layers(model)
    batch = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def timed_step() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        # step_rows.make_step's step, written out: step_rows imports this tree's llm APIs, which an older
        # baseline tree may lack. As the trainer: forward under autocast, backward outside it, both under TF32.
        with tf32_matmuls(device):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = model(batch[:, :-1], shift_labels=batch[:, 1:]).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    print(f"ready {timed_step()}", flush=True)
    for line in sys.stdin:
        if line.strip() == "step":
            print(timed_step(), flush=True)


if __name__ == "__main__":
    main()
