"""What the GPU check (scripts/gpu_check.py) reads from its training runs and bench figures, and checks in them:
the runs' engines, losses and memory against the plan, the resume, and the performance targets its stage table
names (each target's rows named explicitly, with its reference: no row name is parsed).

    python scripts/gpu_runs.py versions                 # python, torch, the GPU, the packages the check uses
    python scripts/gpu_runs.py truncate RUN COPY STEP   # COPY = RUN without its checkpoints after STEP
"""

from __future__ import annotations

import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

# The check's scripts run as `python scripts/NAME.py`, which puts scripts/ first on the path, not the repository
# root that holds bench and llm: without this, they would need PYTHONPATH (or import another checkout's llm).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.paired import PairedRatio, median_interval, paired_ratio, verdict

Row = tuple[str, str, str]
"""A line of the report's targets table: what, the figure, the verdict ("-" where the row has no target)."""


@dataclass
class Run:
    """What the check reads from a training run's metrics.jsonl."""

    meta: dict
    """The last meta row (a resumed run's is the resume's)."""
    losses: dict[int, float]
    last: dict
    """The last train row."""


def read_run(run_dir: Path) -> Run:
    from llm.eval.runs import read_metrics  # compare's reader: a line cut short by a killed run is skipped

    rows = read_metrics(run_dir)
    train = [r for r in rows if r["kind"] == "train"]
    return Run([r for r in rows if r["kind"] == "meta"][-1], {r["step"]: r["loss"] for r in train}, train[-1])


def versions() -> None:
    import torch
    from pins import installed  # a sibling: this runs as a script, from scripts/

    print(f"python {platform.python_version()}; torch {torch.__version__}, cuda {torch.version.cuda}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"gpu {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs")
    have = installed()
    for dist in ("transformers", "accelerate", "tokenizers", "triton", "datasets", "deepspeed", "fla-core",
                 "liger-kernel", "omegaconf", "numpy"):
        print(dist, have.get(dist, "MISSING"))


def truncate(run: Path, copy: Path, step: int) -> None:
    """``copy`` = ``run`` without its checkpoints after ``step``: resuming it repeats the steps after ``step``."""
    shutil.copytree(run, copy)
    for d in (copy / "checkpoints").glob("step_*"):
        if int(d.name.split("_")[-1]) > step:
            shutil.rmtree(d)
    if not (copy / "checkpoints" / f"step_{step:08d}").is_dir():
        raise SystemExit(f"truncate: {run} has no checkpoint at step {step}")


PLAN_MODES = {"single": "single", "ddp": "ddp", "fsdp2-full_shard": "fsdp2", "fsdp2-shard_grad_op": "fsdp2",
              "deepspeed-zero2": "zero2", "deepspeed-zero3": "zero3"}
"""The ``isollm-params --plan`` mode of each engine a run can record."""


def planned_mib(run: Run) -> str:
    """``llm.memory_plan``'s estimate for the run's model, engine and shape (to set against its measured peak)."""
    from llm.memory_plan import plan_memory
    from llm.model import ModelConfig

    mode = PLAN_MODES.get(run.meta["engine"])
    if mode is None:
        return "-"
    config = run.meta["config"]
    plan = plan_memory(ModelConfig(**config["model"]), mode, run.meta["world_size"],
                       config["train"]["micro_batch_size"], config["data"]["seq_len"],
                       "bf16" if run.meta["mixed_precision"] == "bf16" else "fp32",
                       optimizer=config["train"].get("optimizer", "adamw"))
    return f"{plan.total / 2**20:.0f} MiB"


def engine_table(runs: dict[str, Run]) -> list[str]:
    lines = ["| run | engine asked | engine that ran | mixed precision | first loss | last loss | tokens/s | "
             "peak memory | plan estimate |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in runs.items():
        first = run.losses[min(run.losses)]
        lines.append(f"| {name} | {run.meta.get('engine_requested') or 'data parallel'} | {run.meta.get('engine')} | "
                     f"{run.meta.get('mixed_precision')} | {first:.4f} | {run.last['loss']:.4f} | "
                     f"{run.last['tokens_per_s']:.0f} | {run.last['peak_mem_bytes'] / 2**20:.0f} MiB "
                     f"({run.last['peak_mem_kind']}) | {planned_mib(run)} |")
    return lines


def loss_checks(runs: dict[str, Run], tolerance: tuple[float, float], compared: tuple[str, ...],
                reference: str = "ddp") -> list[tuple[str, bool, str]]:
    """The ``compared`` runs against the ``reference`` one (FSDP2 and ZeRO-3 and compiled runs against eager
    DDP; the FP8 head against bf16's): the same first-step loss (same weights, same batch) and the same mean
    loss over the last 10 steps, within ``tolerance`` (bf16 rounding differs between engines and kernels). A
    compared run missing fails."""
    first_tol, tail_tol = tolerance
    if reference not in runs:
        return [(f"{reference} run for the loss comparison", False, "it did not finish")]
    ref = runs[reference].losses
    checks = []
    for name in compared:
        if name not in runs:
            checks.append((f"{name} losses agree with {reference}", False, "the run did not finish"))
            continue
        losses, tail = runs[name].losses, sorted(ref)[-10:]
        first = abs(losses[1] - ref[1])
        ref_tail = sum(ref[s] for s in tail) / len(tail)
        rel = abs(sum(losses[s] for s in tail) / len(tail) - ref_tail) / ref_tail
        checks.append((f"{name} losses agree with {reference}", first <= first_tol and rel <= tail_tol,
                       f"step 1: abs. diff {first:.2e} (<= {first_tol}); last 10 steps' mean: rel. diff {rel:.2e} "
                       f"(<= {tail_tol})"))
    return checks


def resume_check(original: Run, resumed: Run, step: int, tolerance: float) -> tuple[str, bool, str]:
    """The resumed run restarted from the checkpoint at ``step`` and repeated the original's later losses. A
    run that found no checkpoint trains from step 0 and (deterministic) repeats them too: its meta row's
    ``resumed_from`` tells the two apart."""
    steps = [s for s in sorted(original.losses) if s > step]
    what = f"resume from step {step} repeats steps {step + 1}-{max(original.losses)}"
    missing = [s for s in steps if s not in resumed.losses]
    if missing or not steps:
        return (what, False, f"missing steps {missing[:5]}")
    worst = max(abs(original.losses[s] - resumed.losses[s]) for s in steps)
    source = resumed.meta.get("resumed_from")
    from_step = source is not None and Path(source).name == f"step_{step:08d}"
    return (what, worst <= tolerance and from_step,
            f"max abs. loss diff {worst:.2e} (<= {tolerance}); resumed from {source}")


@dataclass(frozen=True)
class Target:
    """A target resting on one bench_train_step run's rows (``kind``): "ratio", ``row``'s tokens/s over
    ``over``'s, paired per round (at least ``value``; with ``floor``, the median at least ``value`` and the
    interval's lower end at least ``floor``); "mfu", ``row``'s MFU at least ``value``; "memory", ``row``'s step
    peak at most ``over``'s. ``value`` None: reported, no verdict. A row missing from the run is left out."""

    kind: str
    row: str
    over: str | None = None
    value: float | None = None
    floor: float | None = None


def _percent(r: PairedRatio) -> str:
    return f"{r.median:.1%} [{r.low:.1%}, {r.high:.1%}]" if r.low is not None else f"{r.median:.1%} ({r})"


def bench_targets(run: dict, targets: tuple[Target, ...]) -> list[Row]:
    """``targets`` against a bench_train_step ``--json`` (its every round's seconds: each ratio paired here)."""
    rows, figures, at = [], run["variants"], f" ({run['setup']})"
    per_token = {name: [s / run["tokens"][name] for s in seconds] for name, seconds in run["seconds"].items()}
    for t in [t for t in targets if t.row in figures and (t.over is None or t.over in figures)]:
        aim = "" if t.value is None else f" >= {t.value:.0%}" if t.kind == "mfu" else f" >= {t.value}x"
        aim += "" if t.floor is None else f", lower end >= {t.floor}"
        if t.kind == "mfu":  # per round, of the datasheet; where there is none (CPU) of the measured matmul rate
            f = figures[t.row]
            of, share = ("the datasheet", f["mfu"]) if f["mfu"] is not None else ("the matmul rate", f["of_roofline"])
            mfu = median_interval([share / f["tokens_per_s"] / s for s in per_token[t.row]])
            rows.append((f"{t.row} MFU{aim} of {of}{at}", _percent(mfu), verdict(mfu, t.value) if t.value else "-"))
        elif t.kind == "ratio":
            ratio = paired_ratio(per_token[t.row], per_token[t.over])
            rows.append((f"{t.row} over {t.over}{aim}{at}", str(ratio),
                         verdict(ratio, t.value, t.floor) if t.value else "-"))
        elif figures[t.row]["step_peak_mib"] is not None:
            mine, theirs = figures[t.row]["step_peak_mib"], figures[t.over]["step_peak_mib"]
            rows.append((f"{t.row}'s step peak memory <= {t.over}'s{at}", f"{mine:.0f} MiB vs {theirs:.0f} MiB",
                         "met" if mine <= theirs else "NOT met"))
    return rows


def reference_rows(run: dict) -> list[Row]:
    """Every row of a bench_train_step run over the reference row it names (its ``reference``), no verdict."""
    return bench_targets(run, tuple(Target("ratio", name, f["reference"]) for name, f in run["variants"].items()
                                    if f["reference"] not in (None, name)))


def attention_targets(by_length: dict, from_t: int) -> list[Row]:
    """From ``from_t`` on, every iso_tanh form faster than SDPA (paired per round) with no more memory; at every
    length, whether ``FLA_MIN_LENGTH`` picks the faster of the compiled forms (paired)."""
    from llm.model.attention import FLA_MIN_LENGTH  # here: llm imports torch and transformers, ~10 s of each check run

    rows = []
    for t, impls in by_length.items():
        for linear in [impl for impl in impls if impl != "sdpa" and int(t) >= from_t]:
            ratio = paired_ratio(impls[linear]["seconds"], impls["sdpa"]["seconds"])
            rows.append((f"iso_tanh ({linear}) faster than SDPA at T={t}", str(ratio), verdict(ratio, 1.0)))
            memory = impls[linear]["mib"] / max(impls["sdpa"]["mib"], 1e-9)
            rows.append((f"iso_tanh ({linear}) memory <= SDPA's at T={t}", f"{memory:.2f}x",
                         "met" if memory <= 1 else "NOT met"))
        if {"chunked_compiled", "fla_compiled"} <= impls.keys():  # CUDA's choice (attention.py)
            picked, other = (("fla_compiled", "chunked_compiled") if int(t) >= FLA_MIN_LENGTH else
                             ("chunked_compiled", "fla_compiled"))
            ratio = paired_ratio(impls[picked]["seconds"], impls[other]["seconds"])
            rows.append((f"iso_tanh's form at T={t}: FLA_MIN_LENGTH={FLA_MIN_LENGTH} picks {picked}, at least as "
                         f"fast as {other}", str(ratio), verdict(ratio, 1.0)))
    if not any(int(t) >= from_t for t in by_length):
        rows.append((f"iso_tanh faster than SDPA from T={from_t}", "no such T measured", "-"))
    return rows


def generate_targets(contexts: dict, from_context: int) -> list[Row]:
    """iso_tanh's decoding at least as fast as softmax's (paired per token) from ``from_context`` on."""
    return [(f"iso_tanh decodes >= softmax's tokens/s at context {context} ({cache} cache)", str(ratio),
             verdict(ratio, 1.0)) for context, scorings in contexts.items() if int(context) >= from_context
            for cache, row in scorings["iso_tanh"].items() for ratio in [PairedRatio(**row["vs_softmax"])]]


if __name__ == "__main__" and sys.argv[1:] == ["versions"]:
    versions()
elif __name__ == "__main__" and sys.argv[1:2] == ["truncate"] and len(sys.argv) == 5:
    truncate(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
elif __name__ == "__main__":
    raise SystemExit("usage:\n" + "\n".join(__doc__.splitlines()[-2:]))
