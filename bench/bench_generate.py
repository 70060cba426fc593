"""Generation speed and state memory at growing context: softmax with its KV cache vs iso_tanh's O(1) state.

    .venv/bin/python bench/bench_generate.py                      # contexts 1k, 4k, 16k, 32 new tokens
    .venv/bin/python bench/bench_generate.py --contexts 512 2048 --new-tokens 16
    python bench/bench_generate.py --device cuda --dtype bf16 --preset 134m --contexts 4096 8192 16384 32768

For each context length the prompt is prefilled once (timed separately), then ``--new-tokens``
tokens are decoded one at a time through the model's ``IsoLLMCache``, exactly as ``generate()``
does. "state MiB" is the bytes held by the cache after decoding (KV tensors for softmax, the
``(S, G)`` sums for iso_tanh), an exact count rather than a noisy process measurement. Ratios are
iso_tanh over softmax at the same context; "vs first" is a scoring's time per token over its own at the
first context: flat (1.0x) for iso_tanh, whose step costs the same whatever the context, growing for
softmax, whose step reads the whole KV cache.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from llm.config import load_config
from llm.model import IsoLLMCache, IsoLLMConfig, IsoLLMForCausalLM


def cache_bytes(cache: IsoLLMCache) -> int:
    """Bytes of every tensor the cache holds: each layer's attention state (a tuple) and FFN state (a dict)."""
    held = [t for layer in cache.layers for t in (*(layer.attention or ()), *layer.ffn.values())]
    return sum(t.numel() * t.element_size() for t in held)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode(model: IsoLLMForCausalLM, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, int]:
    """Prefill seconds, decode tokens/s and final cache bytes for greedy decoding."""
    cache = IsoLLMCache(model.config.num_hidden_layers)
    synchronize(prompt.device)
    start = time.perf_counter()
    logits = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits
    synchronize(prompt.device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = logits[:, -1:].argmax(-1)
        logits = model(token, cache=cache, use_cache=True).logits
    synchronize(prompt.device)
    return prefill, new_tokens / (time.perf_counter() - start), cache_bytes(cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-cpu", help="configs/sizes/<preset>.yaml")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="weights and cache dtype")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_config(f"configs/sizes/{args.preset}.yaml", ["train.max_steps=1"]).model
    base = replace(base, max_position_embeddings=max(base.max_position_embeddings,
                                                     max(args.contexts) + args.new_tokens))
    device = torch.device(args.device)
    torch.manual_seed(0)
    models = {scoring: IsoLLMForCausalLM(IsoLLMConfig.from_model_config(replace(base, attn_scoring=scoring)))
              .to(device, DTYPES[args.dtype]).eval() for scoring in ("softmax", "iso_tanh")}
    print(f"# generation, {args.preset} ({base.num_hidden_layers} layers, hidden {base.hidden_size}), batch 1, "
          f"{args.dtype}, {device.type}, {args.new_tokens} new tokens after the prompt")
    print(f"{'context':>8}{'scoring':>10}{'prefill s':>11}{'ms/token':>10}{'vs first':>10}{'state MiB':>11}"
          f"{'tok/s ratio':>13}{'state ratio':>13}")
    first: dict[str, float] = {}
    for context in args.contexts:
        prompt = torch.randint(0, base.vocab_size, (1, context), device=device)
        results = {scoring: decode(model, prompt, args.new_tokens) for scoring, model in models.items()}
        soft = results["softmax"]
        for scoring, (prefill, tps, nbytes) in results.items():
            first.setdefault(scoring, tps)
            print(f"{context:>8}{scoring:>10}{prefill:>11.3f}{1e3 / tps:>10.2f}{first[scoring] / tps:>9.2f}x"
                  f"{nbytes / 2**20:>11.2f}{tps / soft[1]:>12.2f}x{nbytes / soft[2]:>12.3f}x")


if __name__ == "__main__":
    main()
