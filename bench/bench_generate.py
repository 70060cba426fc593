"""Generation speed and state memory at growing context: softmax with its KV cache vs iso_tanh's O(1) state,
each with the growing cache and with a static one (``IsoLLMCache(max_length=...)``, one CUDA graph per step).

    .venv/bin/python bench/bench_generate.py                      # contexts 1k, 4k, 16k, 32 new tokens
    .venv/bin/python bench/bench_generate.py --contexts 512 2048 --new-tokens 16
    python bench/bench_generate.py --device cuda --dtype bf16 --preset 134m --contexts 4096 8192 16384 32768

For each context length the prompt is prefilled once (timed separately), then one token is decoded untimed (with a
static cache on CUDA it captures the step's graph) and ``--new-tokens`` more are timed, one at a time, exactly as
``generate()`` decodes. "state MiB" is the bytes held by the cache after decoding (KV tensors for softmax, a
static cache's whole buffers, the ``(S, G)`` sums for iso_tanh), an exact count rather than a noisy process
measurement. The four rows of a context decode side by side, one token of each per round, so that "vs softmax"
(a scoring's speed over softmax's with the same cache at the same context) and "vs growing" (a static cache's
over the growing one's) are paired per token: the median over the ``--new-tokens`` rounds with its 95% bootstrap
interval (bench/paired.py); ms/token is the median token's. "vs first" is a row's time per token over its own at
the first context, unpaired (the contexts run one after the other): flat (1.0x) for iso_tanh, whose step costs
the same whatever the context, growing for softmax, whose step reads the whole KV cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from paired import paired_ratio

from llm.config import load_config
from llm.model import IsoLLMCache, IsoLLMConfig, IsoLLMForCausalLM


def cache_bytes(cache: IsoLLMCache) -> int:
    return sum(t.numel() * t.element_size() for t in cache.tensors())


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode_rounds(models: dict[str, IsoLLMForCausalLM], prompt: torch.Tensor,
                  new_tokens: int) -> dict[tuple[str, str], tuple[float, list[float], int]]:
    """For every (scoring, cache): prefill seconds, each decoded token's seconds, and the final cache bytes.
    The four decode side by side, one token of each per round (in an order rotated from round to round), so
    that each token's ratios pair steps taken under the same machine load."""
    rows = [(scoring, cache) for scoring in models for cache in ("growing", "static")]
    caches, logits, prefill, seconds = {}, {}, {}, {row: [] for row in rows}
    for row in rows:
        model, static = models[row[0]], row[1] == "static"
        max_length = prompt.shape[1] + new_tokens + 1 if static else None
        caches[row] = IsoLLMCache(model.config.num_hidden_layers, max_length=max_length)
        synchronize(prompt.device)
        start = time.perf_counter()
        logits[row] = model(prompt, cache=caches[row], use_cache=True, logits_to_keep=1).logits
        synchronize(prompt.device)
        prefill[row] = time.perf_counter() - start
    for step in range(new_tokens + 1):  # the first step, untimed, captures a static cache's graph on CUDA
        for row in rows[step % len(rows):] + rows[:step % len(rows)]:
            start = time.perf_counter()
            logits[row] = models[row[0]](logits[row][:, -1:].argmax(-1), cache=caches[row], use_cache=True).logits
            synchronize(prompt.device)
            if step:
                seconds[row].append(time.perf_counter() - start)
    return {row: (prefill[row], seconds[row], cache_bytes(caches[row])) for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-cpu", help="configs/sizes/<preset>.yaml")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="weights and cache dtype")
    parser.add_argument("--json", metavar="PATH", help="also write tokens/s and state bytes to PATH as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_config(f"configs/sizes/{args.preset}.yaml", ["train.max_steps=1"]).model
    base = replace(base, max_position_embeddings=max(base.max_position_embeddings,
                                                     max(args.contexts) + args.new_tokens + 1))
    device = torch.device(args.device)
    torch.manual_seed(0)
    models = {scoring: IsoLLMForCausalLM(IsoLLMConfig.from_model_config(replace(base, attn_scoring=scoring)))
              .to(device, DTYPES[args.dtype]).eval() for scoring in ("softmax", "iso_tanh")}
    print(f"# generation, {args.preset} ({base.num_hidden_layers} layers, hidden {base.hidden_size}), batch 1, "
          f"{args.dtype}, {device.type}, {args.new_tokens} new tokens after the prompt")
    print(f"{'context':>8}{'scoring':>10}{'cache':>8}{'prefill s':>11}{'ms/token':>10}{'vs first':>10}"
          f"{'state MiB':>11}{'vs softmax [95% interval]':>26}{'vs growing [95% interval]':>26}")
    first: dict[tuple[str, str], float] = {}
    figures: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
    for context in args.contexts:
        prompt = torch.randint(0, base.vocab_size, (1, context), device=device)
        results = decode_rounds(models, prompt, args.new_tokens)
        for (scoring, cache), (prefill, seconds, nbytes) in results.items():
            tps = 1 / statistics.median(seconds)
            first.setdefault((scoring, cache), tps)
            vs_softmax = paired_ratio(seconds, results["softmax", cache][1])
            vs_growing = paired_ratio(seconds, results[scoring, "growing"][1])
            print(f"{context:>8}{scoring:>10}{cache:>8}{prefill:>11.3f}{1e3 / tps:>10.2f}"
                  f"{first[scoring, cache] / tps:>9.2f}x{nbytes / 2**20:>11.2f}{vs_softmax!s:>26}{vs_growing!s:>26}")
            row = {"tokens_per_s": tps, "state_bytes": nbytes, "vs_softmax": asdict(vs_softmax),
                   "vs_growing": asdict(vs_growing)}
            figures.setdefault(context, {}).setdefault(scoring, {})[cache] = row
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))

if __name__ == "__main__":
    main()
