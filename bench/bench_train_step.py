"""Training-step throughput of every ffn x attn_scoring, next to transformers' Qwen3 and the roofline, with
each ratio paired per round and given with its 95% interval.

    .venv/bin/python bench/bench_train_step.py                 # 6 layers, hidden 384, vocab 8192, 8 x 256
    .venv/bin/python bench/bench_train_step.py --quick         # 5 rounds
    .venv/bin/python bench/bench_train_step.py --device cuda --dtype bf16 --compile --preset 134m --seq 2048
    .venv/bin/python bench/bench_train_step.py --variants swiglu+softmax swiglu+iso_tanh   # named pairs only
    .venv/bin/python bench/bench_train_step.py --packed-docs 700   # also swiglu's step on packed documents
    .venv/bin/python bench/bench_train_step.py --no-tf32 swiglu+iso_tanh --profile "swiglu+iso_tanh no-tf32"
    .venv/bin/python bench/bench_train_step.py --csv step.csv  # one line per row: variant, tokens_per_s, ratio, ...

Rows and steps: bench/step_rows.py (the trainer's step, its TF32 scope over forward and backward, and every row
compiled or failing loudly). All rows are built first and then timed in rounds: each round times one step of
every row, in an order rotated from round to round, so that a change in machine load hits every row of that round
alike. ``ratio`` is a row's tokens/s over the baseline row's (``--baseline``, default swiglu+softmax), taken within
each round and then summarised as the median over rounds with a 95% bootstrap interval (bench/paired.py): a
target counts as met only when the interval's lower end clears it. ``tokens/s`` is the median round's. The
non-SwiGLU FFNs are parameter-matched (``ffn_param_match``), as in a fair comparison.

Columns: ``roofline``, the machine's measured matmul FLOP/s (timed in every round, best kept) over the row's
training FLOPs per token (``llm.metrics.flops``); ``of roofline``: tokens/s over that; on CUDA ``MFU``, against the
GPU's dense datasheet peak, and ``step MiB``, the step's peak memory above what the resident models hold (the
largest over rounds); ``first s``: the first step's seconds (compilation, allocator, optimizer state). Rows ending
in ``packed`` feed the trainer's inputs for document masking (``position_ids`` restarting at documents of
``--packed-docs`` tokens on average); rows ending in ``no-tf32`` run their fp32 matmuls in full fp32
(``train.tf32: false``); ``--extra-row`` adds a copy of a variant with model fields changed (e.g. an FP8 LM
head); ``--also-batch N`` the baseline variant at micro batch N (rows differing in batch compare tokens/s).
The comparisons below the table pair each such row with the row it changes, swiglu+SCORING with each FFN of that
scoring, and the baseline with each transformers row (``--qwen3``: bench/step_rows.py, ``QWEN3_ROWS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import OmegaConf
from paired import paired_ratio, write_csv
from step_rows import QWEN3_ROWS, Row, check_compiled, make_step, ours, qwen3, strict_compilation

from llm.config import load_config
from llm.metrics.flops import flops_per_token, measure_matmul_flops, mfu, peak_flops
from llm.model import ModelConfig
from llm.model.attention import ATTN_SCORING_REGISTRY
from llm.model.ffn import FFN_REGISTRY
from llm.train.step import tf32_matmuls

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROOFLINE_MATMUL_N = {"cpu": 1024, "cuda": 8192}
"""The roofline's matmul: ``[n, n] @ [n, n]`` in the step's dtype, timed in every round (best kept); on a GPU
large enough to reach the tensor cores' rate."""


def packed_positions(seq: int, mean_length: int, device: torch.device) -> torch.Tensor:
    """``[1, seq]`` position ids restarting at documents of ``mean_length`` tokens on average (exponential
    lengths, fixed seed), as the trainer's document masking gives them."""
    generator = torch.Generator().manual_seed(0)
    lengths = (torch.empty(seq).exponential_(1 / mean_length, generator=generator).long() + 1).tolist()
    positions = torch.cat([torch.arange(n) for n in lengths])[:seq]
    return positions[None].to(device)


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
    each scoring (the reference of the FFN comparisons) and swiglu+softmax always come first."""
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


def extra_rows(parser: argparse.ArgumentParser, specs: list[str],
               variants: dict[str, ModelConfig]) -> dict[str, tuple[str, ModelConfig]]:
    """``--extra-row "VARIANT LABEL:FIELD=VALUE[,FIELD=VALUE]"`` -> {"VARIANT LABEL": (VARIANT, its config with
    those ModelConfig fields set, validated)}; VALUE typed as YAML types it (int, float, bool, string)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    rows = {}
    for spec in specs:
        name, _, assignments = spec.partition(":")
        variant = name.split(" ")[0]
        if variant not in variants or " " not in name or not assignments:
            parser.error(f"--extra-row: {spec!r} is not 'VARIANT LABEL:FIELD=VALUE[,...]' with VARIANT among the "
                         f"timed variants {list(variants)}")
        # YAML's typing, as a config override gets it (llm/config.py): "false" is False, not a true string
        changes = OmegaConf.to_container(OmegaConf.from_dotlist(assignments.split(",")))
        if unknown := [key for key in changes if key not in fields]:
            parser.error(f"--extra-row: {unknown[0]!r} is not a ModelConfig field (model.*)")
        rows[name] = (variant, dataclasses.replace(variants[variant], **changes).validate())
    return rows


def comparisons(rows: dict[str, Row], baseline: str, extras: dict[str, tuple[str, ModelConfig]]) -> list[tuple]:
    """(row, reference) pairs reported below the table (module docstring)."""
    pairs = [(name, name.removesuffix(" packed")) for name in rows if name.endswith(" packed")]
    pairs += [(name, name.removesuffix(" no-tf32")) for name in rows if name.endswith(" no-tf32")]
    pairs += [(name, variant) for name, (variant, _) in extras.items()]
    pairs += [(name, f"swiglu+{name.split('+')[1]}") for name in rows if "+" in name and " " not in name
              and not name.startswith("swiglu+") and not name.endswith("+softmax")]
    pairs += [(baseline, name) for name in rows if name in QWEN3_ROWS.values()]
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-cpu", help="configs/sizes/<preset>.yaml")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="config overrides for every row (e.g. model.max_position_embeddings=32768)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (each times one step of every row)")
    parser.add_argument("--quick", action="store_true", help="5 rounds (wider intervals)")
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
    parser.add_argument("--baseline", default="swiglu+softmax", help="the row every `ratio` is over")
    parser.add_argument("--also-batch", nargs="+", type=int, default=[], metavar="N",
                        help="also time the baseline variant at micro batch N (rows '<baseline> batch N')")
    parser.add_argument("--json", metavar="PATH", help="also write the figures and every round's seconds as JSON")
    parser.add_argument("--csv", metavar="PATH", help="also write one line per row: " + ", ".join(
        ("variant", "tokens_per_s", "ratio", "ratio_ci_low", "ratio_ci_high", "rounds", "mfu")))
    parser.add_argument("--packed-docs", type=int, default=0, metavar="MEAN",
                        help="also time swiglu with each scoring on packed documents of MEAN tokens on average")
    parser.add_argument("--qwen3", nargs="*", choices=QWEN3_ROWS, default=list(QWEN3_ROWS),
                        help="transformers Qwen3 rows (bare: none; their fp32 logits do not fit a large batch)")
    parser.add_argument("--no-tf32", nargs="+", default=[], metavar="FFN+SCORING",
                        help="also time these variants with fp32 matmuls in full fp32 (rows '<name> no-tf32')")
    parser.add_argument("--extra-row", action="append", default=[], metavar="'VARIANT LABEL:FIELD=VALUE,...'",
                        help="also time VARIANT with these ModelConfig fields changed, as row 'VARIANT LABEL'")
    parser.add_argument("--profile", nargs="*", default=None, metavar="ROW",
                        help="also print the 10 kernels with the most time in these rows' steps (torch.profiler; "
                             "bare: swiglu+softmax)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 5 if args.quick else args.rounds
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    base = load_config(f"configs/sizes/{args.preset}.yaml", ["train.max_steps=1", f"data.seq_len={args.seq}",
                                                                   *args.set]).model
    variants: dict[str, ModelConfig] = {
        f"{ffn}+{scoring}": dataclasses.replace(base, ffn=ffn, attn_scoring=scoring, ffn_param_match=ffn != "swiglu")
        for ffn, scoring in variant_pairs(parser, args)
    }
    if unknown := set(args.no_tf32) - set(variants):
        parser.error(f"--no-tf32: {sorted(unknown)} are not among the timed variants {list(variants)}")
    extras = extra_rows(parser, args.extra_row, variants)
    batch = torch.randint(0, base.vocab_size, (args.batch, args.seq + 1), device=device)
    positions = packed_positions(args.seq, args.packed_docs, device) if args.packed_docs else None

    torch.manual_seed(0)
    builders: dict[str, Callable[[], Row]] = {}
    for name, cfg in variants.items():
        builders[name] = lambda n=name, c=cfg: ours(n, c, batch, args.compile)
        if positions is not None and name.startswith("swiglu+"):
            builders[f"{name} packed"] = lambda n=name, c=cfg: ours(f"{n} packed", c, batch, args.compile, positions)
    builders |= {f"{n} no-tf32": lambda n=n: ours(f"{n} no-tf32", variants[n], batch, args.compile, tf32=False)
                 for n in args.no_tf32}
    builders |= {name: lambda n=name, c=cfg: ours(n, c, batch, args.compile) for name, (_, cfg) in extras.items()}
    if args.also_batch and args.baseline not in variants:
        parser.error(f"--also-batch: the baseline {args.baseline!r} is not one of our variants {list(variants)}")
    builders |= {f"{args.baseline} batch {n}": lambda n=n: ours(
        f"{args.baseline} batch {n}", variants[args.baseline],
        torch.randint(0, base.vocab_size, (n, args.seq + 1), device=device), args.compile) for n in args.also_batch}
    builders |= {QWEN3_ROWS[kind]: lambda k=kind: qwen3(k, base, batch, args.compile) for kind in args.qwen3}
    if args.baseline not in builders:
        parser.error(f"--baseline: {args.baseline!r} is not among the rows {list(builders)}")
    rows, steps, first_step, skipped = {}, {}, {}, {}
    with strict_compilation(len(builders)):
        for name, build in builders.items():
            try:
                rows[name] = build()
            except ImportError as err:  # Liger-Kernel: the gpu extra's
                skipped[name] = f"{err.name or err} is not installed"
                continue
            if name == QWEN3_ROWS["liger"] and device.type != "cuda":
                skipped[name] = "Liger-Kernel's kernels are Triton's, CUDA only"
                del rows[name]
                continue
            steps[name] = make_step(rows[name], device, dtype)
            synchronize(device)
            start = time.perf_counter()
            steps[name]()  # warm-up: allocator, AdamW state, compilation
            synchronize(device)
            first_step[name] = time.perf_counter() - start
            check_compiled(steps[name], name)
        seconds, peaks, matmul = time_rounds(steps, device, dtype, rounds)
    for name, reason in skipped.items():
        print(f"# skipped {name}: {reason}")
    report(args, rows, seconds, peaks, first_step, matmul, extras, steps, device, rounds, base)


def time_rounds(steps: dict[str, Callable[[], None]], device: torch.device, dtype: torch.dtype,
                rounds: int) -> tuple[dict[str, list[float]], dict[str, float], float]:
    """Every row's seconds per round (rows rotated), each step's peak memory above the resident models (CUDA,
    MiB, largest over rounds), and the best matmul rate measured in the same rounds; no compilation allowed."""
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    peaks = dict.fromkeys(steps, 0.0)
    rates, names = [], list(steps)
    matmul_n = ROOFLINE_MATMUL_N.get(device.type, ROOFLINE_MATMUL_N["cpu"])
    with torch.compiler.set_stance("fail_on_recompile"):
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: no row always goes first
                synchronize(device)
                if device.type == "cuda":
                    resident = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                steps[name]()
                synchronize(device)
                seconds[name].append(time.perf_counter() - start)
                if device.type == "cuda":
                    peaks[name] = max(peaks[name], (torch.cuda.max_memory_allocated() - resident) / 2**20)
            with tf32_matmuls(device):  # the roofline's matmul at the steps' fp32 precision
                rates.append(measure_matmul_flops(n=matmul_n, dtype=dtype, device=device, repeats=1))
    return seconds, peaks, max(rates)


def report(args: argparse.Namespace, rows: dict[str, Row], seconds: dict[str, list[float]], peaks: dict[str, float],
           first_step: dict[str, float], matmul: float, extras: dict, steps: dict, device: torch.device,
           rounds: int, base: ModelConfig) -> None:
    """Print the table and the comparisons; write --json and --csv."""
    per_token = {name: [s / row.tokens for s in seconds[name]] for name, row in rows.items()}
    with tf32_matmuls(device):
        gpu_peak = peak_flops(device, DTYPES[args.dtype]) if device.type == "cuda" else None
    print(f"# training step, {args.preset} ({base.num_hidden_layers} layers, hidden {base.hidden_size}, "
          f"vocab {base.vocab_size}), batch {args.batch} x {args.seq}, {args.dtype}, {device.type}"
          f"{', compiled' if args.compile else ''}, {rounds} rounds; ratio: tokens/s over {args.baseline}'s, "
          f"paired per round, median [95% interval]")
    print(f"# measured {args.dtype} matmul ({ROOFLINE_MATMUL_N.get(device.type, 1024)}^3, best of {rounds}): "
          f"{matmul / 1e9:.1f} GFLOP/s")
    cuda = device.type == "cuda"
    print(f"{'variant':<40}{'tokens/s':>10}{'ratio [95% interval]':>26}{'roofline':>10}{'of roofline':>12}"
          + (f"{'MFU':>8}{'step MiB':>10}" if cuda else "") + f"{'first s':>9}")
    figures = {}
    for name, row in rows.items():
        value = statistics.median(1 / s for s in per_token[name])
        ratio = paired_ratio(per_token[name], per_token[args.baseline])
        fpt = flops_per_token(row.config, args.seq, training=True)
        figures[name] = {"variant": name, "tokens_per_s": value, "ratio": ratio.median, "ratio_ci_low": ratio.low,
                         "ratio_ci_high": ratio.high, "rounds": ratio.rounds,
                         "mfu": mfu(value, fpt, gpu_peak) if gpu_peak else None,
                         "of_roofline": mfu(value, fpt, matmul), "step_peak_mib": peaks[name] if cuda else None,
                         "first_step_s": first_step[name]}
        f = figures[name]
        print(f"{name:<40}{value:>10.0f}{ratio!s:>26}{matmul / fpt:>10.0f}{f['of_roofline']:>11.0%} "
              + (f"{f['mfu']:>8.1%}{peaks[name]:>10.0f}" if cuda else "") + f"{first_step[name]:>9.1f}")
    compared = [(row, ref, paired_ratio(per_token[row], per_token[ref]))
                for row, ref in comparisons(rows, args.baseline, extras) if row in rows and ref in rows]
    if compared:
        print("# paired comparisons: row's tokens/s over reference's, median [95% interval]")
    for row, ref, ratio in compared:
        print(f"#   {row:<40} over {ref:<40} {ratio}")
    profiled = ["swiglu+softmax"] if args.profile == [] else args.profile or []
    kernels = {row: top_kernels(steps[row], device) for row in profiled if row in steps}
    for row, lines in kernels.items():
        print(f"# the 10 {'kernels' if cuda else 'ops'} with the most self time in {row}'s step (share, ms per "
              f"step, name):")
        print("\n".join(f"#   {line}" for line in lines))
    if args.csv:
        write_csv(Path(args.csv), list(figures.values()))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "setup": f"{args.preset}, {args.batch} x {args.seq}", "baseline": args.baseline, "rounds": rounds,
            "matmul_flops": matmul, "variants": figures, "seconds": seconds,
            "tokens": {name: row.tokens for name, row in rows.items()}, "top_kernels": kernels,
            "comparisons": [{"row": row, "reference": ref, **dataclasses.asdict(r)} for row, ref, r in compared],
        }, indent=1))


if __name__ == "__main__":
    main()
