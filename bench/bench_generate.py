"""Generation speed and state memory at growing context: softmax with its KV cache vs iso_tanh's O(1) state,
each with the growing cache and with a static one (``IsoLLMCache(max_length=...)``, one CUDA graph per step).

    .venv/bin/python bench/bench_generate.py                      # contexts 1k, 4k, 16k, 32 new tokens
    .venv/bin/python bench/bench_generate.py --contexts 512 2048 --new-tokens 16
    python bench/bench_generate.py --device cuda --dtype bf16 --preset 134m --contexts 4096 8192 16384 32768

For each context length the prompt is prefilled once (timed separately), then one token is decoded untimed (with a
static cache on CUDA it captures the step's graph) and ``--new-tokens`` more are timed, one at a time, exactly as
``generate()`` decodes. "state MiB" is the bytes held by the cache after decoding (KV tensors for softmax, a static
cache's whole buffers, the ``(S, G)`` sums for iso_tanh), an exact count rather than a noisy process measurement.
The four rows of a context decode side by side, one token of each per round, so that "vs softmax" (a scoring's speed
over softmax's with the same cache at the same context) and "vs growing" (a static cache's over the growing one's)
are paired per token: the median over the ``--new-tokens`` rounds with its 95% interval (bench/paired.py; at least 6
tokens); ms/token is the median token's: across contexts (run one after the other, so unpaired: no ratio is
printed) it stays flat for iso_tanh, whose step costs the same whatever the context, and grows for softmax, whose
step reads the whole KV cache."""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace

import harness
import torch
from harness import DTYPES, positive_int, time_rounds, timed
from paired import paired_ratio

from llm.config import load_config
from llm.model import IsoLLMCache, IsoLLMConfig, IsoLLMForCausalLM


@torch.no_grad()
def decode_rounds(models: dict[str, IsoLLMForCausalLM], prompt: torch.Tensor,
                  new_tokens: int) -> dict[tuple[str, str], tuple[float, list[float], int]]:
    """For every (scoring, cache): prefill seconds, each decoded token's seconds, and the final cache bytes.
    The four decode side by side, one token of each per round (bench/harness.py ``time_rounds``), so that each
    token's ratios pair steps taken under the same machine load."""
    rows = [(scoring, cache) for scoring in models for cache in ("growing", "static")]
    caches, logits, prefill = {}, {}, {}
    for row in rows:
        model = models[row[0]]
        caches[row] = IsoLLMCache(model.config.num_hidden_layers,
                                  max_length=prompt.shape[1] + new_tokens + 1 if row[1] == "static" else None)
        prefill[row] = timed(lambda r=row, m=model: logits.__setitem__(r, m(
            prompt, cache=caches[r], use_cache=True, logits_to_keep=1).logits), prompt.device)()

    def decode(row: tuple[str, str]) -> None:
        logits[row] = models[row[0]](logits[row][:, -1:].argmax(-1), cache=caches[row], use_cache=True).logits

    steps = {row: timed(lambda r=row: decode(r), prompt.device) for row in rows}
    for step in steps.values():  # untimed: captures a static cache's graph on CUDA
        step()
    seconds = time_rounds(steps, new_tokens)
    return {row: (prefill[row], seconds[row], sum(t.numel() * t.element_size() for t in caches[row].tensors()))
            for row in rows}


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--new-tokens", type=positive_int, default=32, help="timed tokens: the paired rounds")
    args = harness.parse(parser, "--preset", "--device", "--dtype", "--threads", "--json")
    base = load_config(f"configs/sizes/{args.preset}.yaml", ["train.max_steps=1"]).model
    base = replace(base, max_position_embeddings=max(base.max_position_embeddings,
                                                     max(args.contexts) + args.new_tokens + 1))
    device = torch.device(args.device)
    torch.manual_seed(0)
    models = {scoring: IsoLLMForCausalLM(IsoLLMConfig.from_model_config(replace(base, attn_scoring=scoring)))
              .to(device, DTYPES[args.dtype]).eval() for scoring in ("softmax", "iso_tanh")}
    print(f"# generation, {args.preset} ({base.num_hidden_layers} layers, hidden {base.hidden_size}), batch 1, "
          f"{args.dtype}, {device.type}, {args.new_tokens} new tokens after the prompt")
    print(f"{'context':>8}{'scoring':>10}{'cache':>8}{'prefill s':>11}{'ms/token':>10}"
          f"{'state MiB':>11}{'vs softmax [95% interval]':>26}{'vs growing [95% interval]':>26}")
    figures: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
    for context in args.contexts:
        results = decode_rounds(models, torch.randint(0, base.vocab_size, (1, context), device=device), args.new_tokens)
        for (scoring, cache), (prefill, seconds, nbytes) in results.items():
            tps = 1 / statistics.median(seconds)
            vs_softmax = paired_ratio(seconds, results["softmax", cache][1])
            vs_growing = paired_ratio(seconds, results[scoring, "growing"][1])
            print(f"{context:>8}{scoring:>10}{cache:>8}{prefill:>11.3f}{1e3 / tps:>10.2f}"
                  f"{nbytes / 2**20:>11.2f}{vs_softmax!s:>26}{vs_growing!s:>26}")
            row = {"tokens_per_s": tps, "state_bytes": nbytes, "vs_softmax": asdict(vs_softmax),
                   "vs_growing": asdict(vs_growing)}
            figures.setdefault(context, {}).setdefault(scoring, {})[cache] = row
    harness.write_figures(args, figures)


if __name__ == "__main__":
    main()
