"""Training-step throughput of every ffn x attn_scoring, next to transformers' Qwen3 and the roofline.

    .venv/bin/python bench/bench_train_step.py                 # 6 layers, hidden 384, vocab 8192, 8 x 256
    .venv/bin/python bench/bench_train_step.py --quick         # fewer timed steps
    .venv/bin/python bench/bench_train_step.py --device cuda --dtype bf16 --compile --preset 134m --seq 2048
    .venv/bin/python bench/bench_train_step.py --variants swiglu+softmax swiglu+iso_tanh   # named pairs only
    .venv/bin/python bench/bench_train_step.py --packed-docs 700   # also swiglu's step on packed documents
    .venv/bin/python bench/bench_train_step.py --no-tf32 swiglu+iso_tanh --profile "swiglu+iso_tanh no-tf32"

A step is what the trainer does per micro-batch: forward, fp32 cross-entropy, backward, AdamW. All
models are built first and then timed round-robin (one step of each, repeated), so that a change in
machine load hits every variant alike. tokens/s is the best round (on a shared machine the spread comes
from other processes, which only ever slow a step down), and every ratio is the ratio of those best
tokens/s, so that it agrees with the columns beside it. The non-SwiGLU FFNs are parameter-matched
(``ffn_param_match``), as in a fair comparison. ``--compile`` compiles our models as ``train.compile`` does
(each decoder layer in place, one graph for all layers) and transformers' Qwen3 whole.

Columns: tokens/s; ``vs qwen3``: our tokens/s over transformers' ``Qwen3ForCausalLM`` at the identical
shape (same layers, heads, widths, vocab, tied embeddings, qk-norm); ``vs swiglu``: tokens/s over that of
swiglu with the same attention scoring (and the same packing); ``roofline``: the machine's measured
matmul FLOP/s divided by the variant's training FLOPs per token (``llm.metrics.flops``), the tokens/s a
step would reach if it ran at matmul speed; ``of roofline``: tokens/s over that, i.e. the MFU against the
measured matmul rate; on CUDA ``MFU``, against the GPU's dense datasheet peak; ``first s``: the first step's
seconds (compilation, allocator, optimizer state). Rows ending in ``packed`` feed the trainer's inputs for
document masking: ``position_ids`` restarting at documents of ``--packed-docs`` tokens on average. Every step runs
its fp32 matmuls as the trainer's does (``train.tf32``, default on: TF32 on CUDA); rows ending in ``no-tf32``
(``--no-tf32``) run a second copy of the variant with them in full fp32 (``train.tf32: false``). Under bf16
autocast that changes only what runs in fp32 on purpose, iso_tanh's running sums; their ``vs swiglu`` is over the
same variant's row, what TF32 brings.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from llm.config import load_config
from llm.metrics.flops import flops_per_token, measure_matmul_flops, mfu, peak_flops
from llm.model import IsoLLMConfig, IsoLLMForCausalLM, ModelConfig
from llm.model.attention import ATTN_SCORING_REGISTRY
from llm.model.ffn import FFN_REGISTRY
from llm.train.setup import compile_decoder_layers
from llm.train.step import tf32_matmuls

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def qwen3_twin(config: ModelConfig) -> Qwen3ForCausalLM:
    """transformers' own Qwen3 at our shape (SDPA attention, as ours)."""
    hf = Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.resolved_head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta}, attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(hf)


def packed_positions(seq: int, mean_length: int, device: torch.device) -> torch.Tensor:
    """``[1, seq]`` position ids restarting at documents of ``mean_length`` tokens on average (exponential
    lengths, fixed seed), as the trainer's document masking gives them."""
    generator = torch.Generator().manual_seed(0)
    lengths = (torch.empty(seq).exponential_(1 / mean_length, generator=generator).long() + 1).tolist()
    positions = torch.cat([torch.arange(n) for n in lengths])[:seq]
    return positions[None].to(device)


def make_step(model: nn.Module, batch: torch.Tensor, dtype: torch.dtype,
              position_ids: torch.Tensor | None = None, tf32: bool = True) -> Callable[[], None]:
    """One training micro-step as each model trains: forward, loss, backward, fused AdamW (the trainer's
    ``build_optimizer``), fp32 matmuls at TF32 on CUDA unless ``tf32`` is False (``train.tf32``). Ours computes its
    loss itself, fused with the LM head (``shift_labels``, as the trainer calls it); transformers' Qwen3 computes
    fp32 cross-entropy from its logits, as its ``loss_function`` does."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    autocast = torch.autocast(batch.device.type, dtype=dtype, enabled=dtype != torch.float32)
    fused_loss = isinstance(getattr(model, "_orig_mod", model), IsoLLMForCausalLM)
    packing = {} if position_ids is None else {"position_ids": position_ids.expand_as(inputs)}

    def step() -> None:
        with autocast, tf32_matmuls(batch.device, tf32):
            if fused_loss:
                loss = model(inputs, shift_labels=targets, **packing).loss
            else:
                logits = model(inputs).logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


ROOFLINE_MATMUL_N = {"cpu": 1024, "cuda": 8192}
"""The roofline's matmul: ``[n, n] @ [n, n]`` in the step's dtype, timed in every round (best kept); on a GPU
large enough to reach the tensor cores' rate."""

def top_kernels(step: Callable[[], None], device: torch.device, steps: int = 3, count: int = 10) -> list[str]:
    """The ``count`` kernels (CUDA) or ops (CPU) with the most self time over ``steps`` steps, torch.profiler's
    figures: where a step's time goes, and so what keeps it from the roofline."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    times = sorted(((getattr(e, attr), e.key) for e in prof.key_averages() if getattr(e, attr) > 0), reverse=True)
    total = sum(t for t, _ in times)
    return [f"{t / total:6.1%} {t / steps / 1e3:8.2f} ms  {name[:110]}" for t, name in times[:count]]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def variant_pairs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, str]]:
    """(ffn, scoring) pairs to time: ``--variants``, else every ``--ffn`` x ``--attn-scoring``; swiglu with
    each scoring (the reference of ``vs swiglu``) and swiglu+softmax always come first."""
    if args.variants:
        pairs = []
        for name in args.variants:
            ffn, _, scoring = name.partition("+")
            if ffn not in FFN_REGISTRY or scoring not in ATTN_SCORING_REGISTRY:
                parser.error(f"--variants: {name!r} is not FFN+SCORING with FFN in {sorted(FFN_REGISTRY)} and "
                             f"SCORING in {sorted(ATTN_SCORING_REGISTRY)}")
            pairs.append((ffn, scoring))
    else:
        pairs = [(ffn, scoring) for scoring in args.attn_scoring for ffn in args.ffn]
    scorings = ["softmax", *dict.fromkeys(s for _, s in pairs if s != "softmax")]
    references = [("swiglu", scoring) for scoring in scorings]
    return list(dict.fromkeys([*references, *pairs]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-cpu", help="configs/sizes/<preset>.yaml")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8, help="timed steps per model (best reported)")
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--ffn", nargs="+", choices=FFN_REGISTRY, default=list(FFN_REGISTRY),
                        help="FFN variants to time (swiglu is always included: the ratios need it)")
    parser.add_argument("--attn-scoring", nargs="+", choices=ATTN_SCORING_REGISTRY,
                        default=list(ATTN_SCORING_REGISTRY), help="attention scorings to time")
    parser.add_argument("--variants", nargs="+", metavar="FFN+SCORING",
                        help="time exactly these ffn+scoring pairs instead of --ffn x --attn-scoring (swiglu with "
                             "each named scoring is added: the ratios need it)")
    parser.add_argument("--json", metavar="PATH", help="also write the table's figures to PATH as JSON")
    parser.add_argument("--packed-docs", type=int, default=0, metavar="MEAN",
                        help="also time swiglu with each scoring on packed documents of MEAN tokens on average")
    parser.add_argument("--no-qwen3", action="store_true",
                        help="leave out transformers' Qwen3 (its fp32 logits do not fit a large micro batch)")
    parser.add_argument("--no-tf32", nargs="+", default=[], metavar="FFN+SCORING",
                        help="also time these variants (of those timed) with fp32 matmuls in full fp32 "
                             "(train.tf32: false): rows '<name> no-tf32'")
    parser.add_argument("--profile", nargs="*", default=None, metavar="ROW",
                        help="also print the 10 kernels with the most time in these rows' steps (torch.profiler; "
                             "bare: swiglu+softmax)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 3 if args.quick else args.rounds
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    matmul_n = ROOFLINE_MATMUL_N.get(device.type, ROOFLINE_MATMUL_N["cpu"])
    base = load_config(f"configs/sizes/{args.preset}.yaml", ["train.max_steps=1"]).model

    variants: dict[str, ModelConfig] = {
        f"{ffn}+{scoring}": replace(base, ffn=ffn, attn_scoring=scoring, ffn_param_match=ffn != "swiglu")
        for ffn, scoring in variant_pairs(parser, args)
    }
    if unknown := set(args.no_tf32) - set(variants):
        parser.error(f"--no-tf32: {sorted(unknown)} are not among the timed variants {list(variants)}")
    torch.manual_seed(0)
    models: dict[str, nn.Module] = {
        name: IsoLLMForCausalLM(IsoLLMConfig.from_model_config(cfg)) for name, cfg in variants.items()
    }
    models |= {f"{name} no-tf32": IsoLLMForCausalLM(IsoLLMConfig.from_model_config(variants[name]))
               for name in args.no_tf32}
    if not args.no_qwen3:
        models["transformers Qwen3"] = qwen3_twin(base)
    batch = torch.randint(0, base.vocab_size, (args.batch, args.seq + 1), device=device)
    positions = packed_positions(args.seq, args.packed_docs, device) if args.packed_docs else None
    steps, first_step = {}, {}
    for name, model in models.items():
        model.to(device).train()
        if args.compile and isinstance(model, IsoLLMForCausalLM):
            compile_decoder_layers(model)
        elif args.compile:
            model = torch.compile(model)
        packed_rows = [f"{name} packed"] if positions is not None and name.startswith("swiglu+") else []
        for row in [name, *packed_rows]:
            steps[row] = make_step(model, batch, dtype, positions if row in packed_rows else None,
                                   tf32=not row.endswith(" no-tf32"))
            synchronize(device)
            start = time.perf_counter()
            steps[row]()  # warm-up: allocator, AdamW state, compilation
            synchronize(device)
            first_step[row] = time.perf_counter() - start

    profiled = ["swiglu+softmax"] if args.profile == [] else args.profile or []
    if unknown := set(profiled) - set(steps):
        parser.error(f"--profile: {sorted(unknown)} are not among the timed rows {list(steps)}")
    times: dict[str, list[float]] = {name: [] for name in steps}
    matmul_rates: list[float] = []
    names = list(steps)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: no model always goes first
            step = steps[name]
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
        # the roofline's matmul rate, measured in the same rounds as the steps, at the steps' fp32 precision
        with tf32_matmuls(device):
            matmul_rates.append(measure_matmul_flops(n=matmul_n, dtype=dtype, device=device, repeats=1))

    tokens = args.batch * args.seq
    tps = {name: tokens / min(t) for name, t in times.items()}
    matmul = max(matmul_rates)
    with tf32_matmuls(device):
        gpu_peak = peak_flops(device, dtype) if device.type == "cuda" else None
    print(f"# training step, {args.preset} ({base.num_hidden_layers} layers, hidden {base.hidden_size}, "
          f"vocab {base.vocab_size}), batch {args.batch} x {args.seq}, {args.dtype}, {device.type}"
          f"{', compiled' if args.compile else ''}, best of {rounds} steps")
    print(f"# measured {args.dtype} matmul ({matmul_n}^3, best of {rounds}): {matmul / 1e9:.1f} GFLOP/s")
    header = f"{'variant':<30}{'tokens/s':>10}{'vs qwen3':>10}{'vs swiglu':>10}{'roofline':>10}{'of roofline':>12}"
    print(header + (f"{'MFU':>8}" if gpu_peak else "") + f"{'first s':>9}")
    figures = {}
    for name, value in tps.items():
        variant, packed = name.removesuffix(" packed").removesuffix(" no-tf32"), name.endswith(" packed")
        cfg = variants.get(variant, base)
        fpt = flops_per_token(cfg, args.seq, training=True)
        # the reference: swiglu with the same attention and packing; for a no-tf32 row, its variant at TF32
        swiglu = variant if name.endswith(" no-tf32") else f"swiglu+{cfg.attn_scoring}" + (" packed" if packed else "")
        figures[name] = f = {
            "tokens_per_s": value,
            "vs_qwen3": value / tps["transformers Qwen3"] if "transformers Qwen3" in tps else None,
            "vs_swiglu": value / tps[swiglu],
            "of_roofline": mfu(value, fpt, matmul),
            "mfu_datasheet": mfu(value, fpt, gpu_peak) if gpu_peak else None,
            "first_step_s": first_step[name],
        }
        vs_qwen3 = f"{f['vs_qwen3']:>9.2f}x" if f["vs_qwen3"] is not None else f"{'-':>10}"
        row = (f"{name:<30}{value:>10.0f}{vs_qwen3}{f['vs_swiglu']:>9.2f}x{matmul / fpt:>10.0f}"
               f"{f['of_roofline']:>11.0%} ")
        print(row + (f"{f['mfu_datasheet']:>8.1%}" if gpu_peak else "") + f"{first_step[name]:>9.1f}")
    kernels = {row: top_kernels(steps[row], device) for row in profiled}
    for row, lines in kernels.items():
        print(f"# the 10 {'kernels' if device.type == 'cuda' else 'ops'} with the most self time in {row}'s "
              f"step (share, ms per step, name):")
        print("\n".join(f"#   {line}" for line in lines))
    if args.json:
        setup = f"{args.preset}, {args.batch} x {args.seq}"
        Path(args.json).write_text(json.dumps({"setup": setup, "matmul_flops": matmul, "variants": figures,
                                               "top_kernels": kernels}, indent=1))


if __name__ == "__main__":
    main()
