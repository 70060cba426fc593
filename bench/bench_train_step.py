"""Training-step throughput of every ffn x attn_scoring, next to transformers' Qwen3 and the roofline, with
each row's ratio over its reference row paired per round and given with its 95% interval.

    .venv/bin/python bench/bench_train_step.py                 # 6 layers, hidden 384, vocab 8192, 8 x 256
    .venv/bin/python bench/bench_train_step.py --rounds 6      # the fewest rounds with an interval
    .venv/bin/python bench/bench_train_step.py --device cuda --dtype bf16 --compile --preset 134m --seq 2048
    .venv/bin/python bench/bench_train_step.py --variants swiglu+softmax swiglu+iso_tanh   # named pairs only
    .venv/bin/python bench/bench_train_step.py --extra-row "swiglu+softmax packed" swiglu+softmax packed_docs=700
    .venv/bin/python bench/bench_train_step.py --extra-row "swiglu+iso_tanh no-tf32" swiglu+iso_tanh tf32=false \
        --profile "swiglu+iso_tanh no-tf32"
    .venv/bin/python bench/bench_train_step.py --csv step.csv  # one line per row: variant, reference, ...

Rows and steps: bench/step_rows.py (the trainer's step, its TF32 scope over forward and backward, and every row
compiled or failing loudly). All rows are built first and then timed in rounds (bench/harness.py): each round
times one step of every row, in an order rotated from round to round, so that a change in machine load hits every
row of that round alike. Every row names its ``reference``: a non-SwiGLU FFN with a scoring, swiglu with that
scoring; an ``--extra-row``, the row it changes; every other row (swiglu with each scoring, transformers' Qwen3
rows), the baseline (``--baseline``, default swiglu+softmax). ``ratio`` is a row's tokens/s over its reference's,
taken within each round and then summarised as the median over rounds with its 95% interval (bench/paired.py; at
least 6 rounds): a target counts as met only when the interval's lower end clears it. ``tokens/s`` is the median
over rounds of the row's own. The non-SwiGLU FFNs are parameter-matched (``ffn_param_match``), as in a fair
comparison.

``--extra-row LABEL REFERENCE KEY=VALUE...`` adds a copy of the row REFERENCE (a variant or an earlier extra row)
with changes: ModelConfig fields (e.g. ``lm_head_precision=fp8``, the FP8 LM head), ``batch=N`` (the micro batch;
rows differing in batch compare tokens/s), ``packed_docs=MEAN`` (the trainer's inputs for document masking:
``position_ids`` restarting at documents of MEAN tokens on average, exponential lengths), ``tf32=false`` (fp32
matmuls in full fp32, ``train.tf32: false``) and ``activation_checkpointing=N`` (every N-th layer keeps only its
input, ``train.activation_checkpointing``) and ``optimizer=muon`` (``train.optimizer``: every row steps the
trainer's optimizer, ``build_optimizer``, AdamW unless a row says otherwise; transformers' Qwen3 rows AdamW); values
typed as a config override types them. E.g. activation
checkpointing's cost and saving at the 134m preset::

    .venv/bin/python bench/bench_train_step.py --preset 134m --seq 1024 --batch 1 --variants swiglu+softmax \
        --qwen3 --extra-row every_2 swiglu+softmax activation_checkpointing=2 \
        --extra-row full swiglu+softmax activation_checkpointing=1

Columns: ``roofline``, the machine's measured matmul FLOP/s (timed in every round, best kept) over the row's
training FLOPs per token (``llm.metrics.flops``); ``of roofline``: tokens/s over that; on CUDA ``MFU``, against the
GPU's dense datasheet peak, and ``step MiB``, the step's peak memory above what the resident models hold (the
largest over rounds); ``saved MiB`` (eager rows), what autograd keeps from the forward pass for the backward,
the weights excluded: the activations, counted exactly through saved-tensor hooks (step_rows.py ``saved_bytes``);
``first s``: the first step's seconds (compilation, allocator, optimizer state).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import harness
import torch
from harness import DTYPES, figures, make_step, peak_increase, synchronize, time_rounds, timed
from omegaconf import OmegaConf
from paired import PairedRatio
from step_rows import QWEN3_ROWS, Row, Spec, check_compiled, ours, qwen3, saved_bytes, strict_compilation

from llm.config import load_config
from llm.metrics.flops import flops_per_token, mfu, peak_flops
from llm.model import ModelConfig
from llm.model.attention import ATTN_SCORING_REGISTRY
from llm.model.ffn import FFN_REGISTRY
from llm.train.optim import build_optimizer
from llm.train.step import tf32_matmuls

ROOFLINE_MATMUL_N = {"cpu": 1024, "cuda": 8192}
"""The roofline's matmul: ``[n, n] @ [n, n]`` in the step's dtype, timed in every round (best kept); on a GPU
large enough to reach the tensor cores' rate."""
ROW_KEYS = ("batch", "packed_docs", "tf32", "activation_checkpointing", "optimizer")
"""``--extra-row`` keys that change the row (``Spec``) rather than the model."""
VARIANTS = [f"{ffn}+{scoring}" for scoring in ATTN_SCORING_REGISTRY for ffn in FFN_REGISTRY]
"""Every FFN+SCORING pair: ``--variants``' choices and its default."""


def top_kernels(step: Callable[[], None], device: torch.device, steps: int = 3, count: int = 10) -> list[str]:
    """The ``count`` kernels (CUDA) or ops (CPU) with the most self time over ``steps`` steps, torch.profiler's
    figures: where a step's time goes, and so what keeps it from the roofline."""
    with torch.profiler.profile() as prof:  # CPU, and the GPU where there is one
        for _ in range(steps):
            step()
        synchronize(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    times = sorted(((getattr(e, attr), e.key) for e in prof.key_averages() if getattr(e, attr) > 0), reverse=True)
    total = sum(t for t, _ in times)
    return [f"{t / total:6.1%} {t / steps / 1e3:8.2f} ms  {name[:110]}" for t, name in times[:count]]


def variant_specs(variants: list[str], base: ModelConfig) -> dict[str, Spec]:
    """The ``variants`` to time (``VARIANTS``, checked by argparse); swiglu with each scoring (the reference of that
    scoring's FFNs) and swiglu+softmax always come first."""
    scorings = dict.fromkeys(["softmax", *(name.split("+")[1] for name in variants)])
    pairs = [name.split("+") for name in dict.fromkeys([*(f"swiglu+{scoring}" for scoring in scorings), *variants])]
    return {f"{ffn}+{scoring}": Spec(dataclasses.replace(base, ffn=ffn, attn_scoring=scoring,
                                                         ffn_param_match=ffn != "swiglu"),
                                     None if ffn == "swiglu" else f"swiglu+{scoring}") for ffn, scoring in pairs}


def extra_rows(parser: argparse.ArgumentParser, specs: list[list[str]], rows: dict[str, Spec]) -> dict[str, Spec]:
    """``--extra-row LABEL REFERENCE KEY=VALUE...`` -> {LABEL: REFERENCE's spec with those ModelConfig fields
    (validated) and ``ROW_KEYS`` changed, over REFERENCE}; VALUE typed as YAML types it (int, float, bool, str)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    rows = dict(rows)
    for label, reference, *assignments in (spec + [""] * (2 - len(spec)) for spec in specs):
        if reference not in rows or label in rows or not assignments:
            parser.error(f"--extra-row: {' '.join([label, reference, *assignments])!r} is not 'LABEL REFERENCE "
                         f"KEY=VALUE...' with a new LABEL and REFERENCE among the rows {list(rows)}")
        # YAML's typing, as a config override gets it (llm/config.py): "false" is False, not a true string
        changes = OmegaConf.to_container(OmegaConf.from_dotlist(assignments))
        if unknown := [key for key in changes if key not in fields | set(ROW_KEYS)]:
            parser.error(f"--extra-row: {unknown[0]!r} is neither a ModelConfig field (model.*) nor in {ROW_KEYS}")
        own = {key: changes.pop(key) for key in ROW_KEYS if key in changes}  # the rest: ModelConfig fields
        rows[label] = dataclasses.replace(rows[reference], **own, reference=reference,
                                          config=dataclasses.replace(rows[reference].config, **changes).validate())
    return rows


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="config overrides for every row (e.g. model.max_position_embeddings=32768)")
    parser.add_argument("--variants", nargs="+", metavar="FFN+SCORING", choices=VARIANTS, default=VARIANTS,
                        help="the ffn+scoring pairs to time (default: all; swiglu with each named scoring is added: "
                             "the ratios need it)")
    parser.add_argument("--baseline", default="swiglu+softmax", help="the reference of rows without their own")
    parser.add_argument("--qwen3", nargs="*", choices=QWEN3_ROWS, default=list(QWEN3_ROWS),
                        help="transformers Qwen3 rows (bare: none; their fp32 logits do not fit a large batch)")
    parser.add_argument("--extra-row", nargs="+", action="append", default=[], metavar="LABEL REFERENCE KEY=VALUE",
                        help="also time row REFERENCE with these changes as row LABEL (module docstring)")
    parser.add_argument("--profile", nargs="*", default=None, metavar="ROW",
                        help="also print the 10 kernels with the most time in these rows' steps (torch.profiler; "
                             "bare: swiglu+softmax)")
    args = harness.parse(parser, "--preset", "--batch", "--seq", "--compile", "--rounds", "--device", "--dtype",
                         "--threads", "--json", "--csv",
                         device="cuda" if torch.cuda.is_available() else "cpu")
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    base = load_config(f"configs/sizes/{args.preset}.yaml", ["train.max_steps=1", f"data.seq_len={args.seq}",
                                                                   *args.set]).model
    specs = extra_rows(parser, args.extra_row, variant_specs(args.variants, base))
    batch = torch.randint(0, base.vocab_size, (args.batch, args.seq + 1), device=device)

    torch.manual_seed(0)
    builders = {name: lambda s=spec: ours(s, batch, args.compile) for name, spec in specs.items()}
    builders |= {QWEN3_ROWS[kind]: lambda k=kind: qwen3(k, base, batch, args.compile) for kind in args.qwen3}
    if args.baseline not in builders:
        parser.error(f"--baseline: {args.baseline!r} is not among the rows {list(builders)}")
    rows, steps, measured = {}, {}, {}
    with strict_compilation(len(builders)):
        for name, build_row in builders.items():
            try:
                if name == QWEN3_ROWS["liger"] and device.type != "cuda":
                    raise ImportError("Liger-Kernel's kernels are Triton's, CUDA only")
                rows[name] = row = build_row()
            except ImportError as err:  # Liger-Kernel: the gpu extra's, CUDA only
                print(f"# skipped {name}: {f'{err.name} is not installed' if err.name else err}")
                continue
            run = load_config(None, ["train.max_steps=1", f"train.optimizer={row.spec.optimizer}"])
            steps[name] = make_step(build_optimizer(row.model, run), row.loss, device, dtype, row.spec.tf32)
            first_s = timed(steps[name], device)()  # warm-up: allocator, AdamW state, compilation
            check_compiled(steps[name], name)
            # compiled rows have no saved MiB: the saved-tensor hooks would recompile the graph
            measured[name] = {"first_step_s": first_s, "saved_mib": None if args.compile else saved_bytes(row) / 2**20}
        seconds, peaks, matmul = time_step_rounds(steps, device, dtype, args.rounds)
    report(args, rows, seconds, peaks, measured, matmul, steps, base)


def time_step_rounds(steps: dict[str, Callable[[], None]], device: torch.device, dtype: torch.dtype,
                     rounds: int) -> tuple[dict[str, list[float]], dict[str, float], float]:
    """Every row's seconds per round (bench/harness.py ``time_rounds``), each step's peak memory above the
    resident models (CUDA, MiB, largest over rounds), and the best rate of the roofline's matmul, timed as one
    more row of the same rounds (at the steps' fp32 precision); no compilation allowed."""
    peaks = dict.fromkeys(steps, 0.0)
    n = ROOFLINE_MATMUL_N.get(device.type, ROOFLINE_MATMUL_N["cpu"])
    a, b = torch.randn(2, n, n, device=device).to(dtype)

    def measured(name: str) -> float:
        peak, seconds = peak_increase(timed(steps[name], device), device)
        peaks[name] = max(peaks[name], peak / 2**20)  # read on CUDA only (on CPU: the process's, not the step's)
        return seconds

    def matmul() -> float:
        with tf32_matmuls(device):
            return timed(lambda: torch.mm(a, b), device)()

    torch.mm(a, b)  # its warm-up
    with torch.compiler.set_stance("fail_on_recompile"):
        seconds = time_rounds({**{name: lambda n=name: measured(n) for name in steps}, None: matmul}, rounds)
    return seconds, peaks, 2.0 * n**3 / min(seconds.pop(None))


def report(args: argparse.Namespace, rows: dict[str, Row], seconds: dict[str, list[float]], peaks: dict[str, float],
           measured: dict[str, dict], matmul: float, steps: dict, base: ModelConfig) -> None:
    """Print the table; write --json and --csv. ``measured``: each row's first step's seconds and saved MiB."""
    device, rounds = torch.device(args.device), args.rounds
    with tf32_matmuls(device):
        gpu_peak = peak_flops(device, DTYPES[args.dtype]) if device.type == "cuda" else None
    print(f"# training step, {args.preset} ({base.num_hidden_layers} layers, hidden {base.hidden_size}, "
          f"vocab {base.vocab_size}), batch {args.batch} x {args.seq}, {args.dtype}, {device.type}"
          f"{', compiled' if args.compile else ''}, {rounds} rounds; ratio: tokens/s over the reference row's "
          f"(last column), paired per round, median [95% interval]")
    print(f"# measured {args.dtype} matmul ({ROOFLINE_MATMUL_N.get(device.type, 1024)}^3, best of {rounds}): "
          f"{matmul / 1e9:.1f} GFLOP/s")
    cuda = device.type == "cuda"
    print(f"{'variant':<40}{'tokens/s':>10}{'ratio [95% interval]':>28}{'roofline':>10}{'of roofline':>12}"
          + (f"{'MFU':>8}{'step MiB':>10}" if cuda else "") + f"{'saved MiB':>10}{'first s':>9}  over")
    tokens = {name: row.tokens for name, row in rows.items()}
    table = {}
    for name, row in rows.items():
        reference = row.spec.reference or (args.baseline if args.baseline in rows else None)
        f = table[name] = figures(name, reference, seconds, tokens)
        fpt = flops_per_token(row.spec.config, args.seq, training=True)
        f |= {"mfu": mfu(f["tokens_per_s"], fpt, gpu_peak) if gpu_peak else None, **measured[name],
              "of_roofline": mfu(f["tokens_per_s"], fpt, matmul), "step_peak_mib": peaks[name] if cuda else None}
        ratio = PairedRatio(f["ratio"], f["ratio_ci_low"], f["ratio_ci_high"], f["rounds"])
        memory = (f"{f['mfu']:>8.1%}{peaks[name]:>10.0f}" if cuda else "") + (
            f"{f['saved_mib']:>10.1f}" if f["saved_mib"] is not None else f"{'-':>10}")
        print(f"{name:<40}{f['tokens_per_s']:>10.0f}{ratio!s:>28}{matmul / fpt:>10.0f}{f['of_roofline']:>11.0%} "
              f"{memory}{f['first_step_s']:>9.1f}  {reference}")
    profiled = ["swiglu+softmax"] if args.profile == [] else args.profile or []
    kernels = {row: top_kernels(steps[row], device) for row in profiled if row in steps}
    for row, lines in kernels.items():
        print(f"# the 10 {'kernels' if cuda else 'ops'} with the most self time in {row}'s step (share, ms per "
              f"step, name):", *(f"#   {line}" for line in lines), sep="\n")
    harness.write_figures(args, {
        "setup": f"{args.preset}, {args.batch} x {args.seq}", "baseline": args.baseline, "rounds": rounds,
        "matmul_flops": matmul, "variants": table, "seconds": seconds, "tokens": tokens, "top_kernels": kernels,
    }, list(table.values()))


if __name__ == "__main__":
    main()
