"""The GPU check's table of stages (``STAGES``), one declared stage function each: its name, device call, time box,
checks and targets in the declaration, its commands (a function of the mode: the GPU's sizes and the dry run's
side by side) in the body, and what it measures and decides in its docstring, from which scripts/gpu_check.py's
report (and ``--list``, docs/performance.md's table) is generated."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gpu_runs
from gpu_runs import Row, Target

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
GPU_BUDGET_S = 555
"""Seconds for one part's stages: a device call's 10 minutes less the machine's start-up."""
DRY_BOX_S = 3600
"""Every dry-run stage's box. The dry run checks that each stage works, not how fast: on a CPU shared with other
jobs a stage may take many times its usual time, and that must not fail it (tests/launch/test_gpu_check.py
runs it). The box is only there to stop a hang."""
COMPARED = ("ddp", "fsdp2", "deepspeed_zero3")
"""Launch configs whose losses must agree; the other single-GPU configs run after the resume."""
FP8_HEAD = "lm_head_precision=fp8"
FP8_LOSS_TOLERANCE = (0.05, 0.005)
"""The FP8 head's loss against bf16's: |difference| at step 1, relative difference of the last 10 steps' mean."""
Command = tuple[str, list[str]]
"""A log label and its argv; ``{logs}``, ``{work}`` and ``{data}`` in it are the folders of this check."""


@dataclass(frozen=True)
class Mode:
    """What differs between the GPU check and its CPU dry run."""

    gpu: bool
    bench: tuple[str, ...]
    """Every bench_train_step run's device, precision, compilation and rounds."""
    train: tuple[str, ...]
    """Every train.py run's overrides (size, steps, checkpoints)."""
    steps: int
    tolerance: tuple[float, float]
    """Engines' losses against DDP's: |difference| at step 1, relative difference of the last 10 steps' mean."""
    resume_tolerance: float
    env: dict[str, str]
    """Environment variables of every command."""

    def pick(self, gpu: list[str], dry: list[str]) -> list[str]:
        return gpu if self.gpu else dry


def _train(*model: str, steps: int, seq: int, micro: int, val_tokens: int) -> tuple[str, ...]:
    return (*model, f"data.seq_len={seq}", f"train.micro_batch_size={micro}",
            f"train.global_batch_tokens={seq * micro}", f"train.max_steps={steps}",
            f"train.checkpoint_every={steps // 2}", "train.keep_checkpoints=2", f"train.warmup_steps={steps // 10}",
            "train.lr=1e-3", "train.log_every=1", f"train.eval_every={steps}", "train.isotropy_samples=128",
            "data.val_bucket=50", f"data.val_tokens={val_tokens}", "trackers=[]")


GPU = Mode(True, ("--device", "cuda", "--dtype", "bf16", "--compile", "--rounds", "10"),
           _train("--config", "configs/sizes/134m.yaml", steps=100, seq=1024, micro=8, val_tokens=16384), 100,
           (0.02, 0.02), 0.05,
           # fla autotunes each kernel on first use (~50 s); later processes reuse triton's on-disk cache
           {"TRITON_CACHE_AUTOTUNING": "1"})
DRY = Mode(False, ("--device", "cpu", "--dtype", "fp32", "--preset", "tiny", "--rounds", "6", "--threads", "1"),
           _train("model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
                  "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.max_position_embeddings=64",
                  "train.precision=fp32", steps=20, seq=32, micro=2, val_tokens=1024), 20,
           (1e-5, 1e-5), 1e-5, {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"})


def bench_step(label: str, m: Mode, *args: str) -> Command:
    return label, [PY, "bench/bench_train_step.py", *m.bench, *args, "--json", f"{{logs}}/{label}.json"]


def train(stage: str, config: str, name: str, m: Mode, *overrides: str) -> Command:
    """train.py through ``launch/accelerate/<config>.yaml``, one process, on the FineWeb sample."""
    return f"{stage}-{name}", [PY, "-m", "accelerate.commands.launch", "--config_file",
                               f"launch/accelerate/{config}.yaml", "--num_processes", "1", "train.py", *m.train,
                               "data.source={data}", "data.cache_dir={work}/cache", f"out_dir={{work}}/{stage}",
                               f"name={name}", *overrides]


def check_table(checks: list[tuple[str, bool, str]]) -> tuple[list[str], bool]:
    return (["", "| check | result | detail |", "| --- | --- | --- |",
             *[f"| {what} | {'pass' if ok else 'FAIL'} | {detail} |" for what, ok, detail in checks]],
            all(ok for _, ok, _ in checks))


def finished(work: Path, stage: str, done: set[str]) -> dict:
    """The training runs of ``stage`` whose command succeeded."""
    names = [label.removeprefix(f"{stage}-") for label in sorted(done) if label.startswith(f"{stage}-")]
    return {name: gpu_runs.read_run(work / stage / name) for name in names
            if (work / stage / name / "metrics.jsonl").is_file()}


def train_checks(m: Mode, work: Path, done: set[str]) -> tuple[list[str], bool]:
    """FSDP2's and ZeRO-3's losses against DDP's, the resume from half-way, and (on a GPU) each run's engine."""
    runs = finished(work, "train", done)
    for name in runs:
        shutil.copy(work / "train" / name / "metrics.jsonl", work / "logs" / f"metrics-{name}.jsonl")
    checks = gpu_runs.loss_checks(runs, m.tolerance, COMPARED[1:])
    if "ddp" in runs:
        checks.append(gpu_runs.resume_check(runs["ddp"], runs["ddp-resume"], m.steps // 2, m.resume_tolerance)
                      if "ddp-resume" in runs else ("resume from half-way", False, "the resumed run did not finish"))
    if m.gpu:  # on CPU Accelerate drops FSDP, DeepSpeed: the table and the runs say so
        checks += [(f"{name} trains with the engine its config asked for",
                    run.meta["engine_requested"] in (None, run.meta["engine"]),
                    f"asked {run.meta['engine_requested']}, ran {run.meta['engine']}") for name, run in runs.items()]
    said = [f"- {name} said: `{line.strip()}`" for name in runs
            for line in (work / "logs" / f"train-{name}.log").read_text().splitlines() if line.startswith("engine:")]
    table, ok = check_table(checks)
    return [*gpu_runs.engine_table(runs), "", *said, *table], ok


Checks = Callable[[Mode, Path, set[str]], tuple[list[str], bool]]
"""Report lines and whether they pass, from what a stage's commands (``done``: those that succeeded) left."""


Compared = tuple[str, Callable[[Mode], tuple[str, ...]], tuple[float, float] | None]
"""A reference run, the runs whose losses are checked against its, and the tolerance (None: the mode's)."""


def loss_stage(stage: str, *groups: Compared) -> Checks:
    """A stage's check: each group's compared runs' losses against its reference's."""
    def checks(m: Mode, work: Path, done: set[str]) -> tuple[list[str], bool]:
        runs = finished(work, stage, done)
        table, ok = check_table([row for reference, compared, tolerance in groups for row in gpu_runs.loss_checks(
            runs, tolerance or m.tolerance, compared(m), reference)])
        return [*gpu_runs.engine_table(runs), *table], ok
    return checks


def json_targets(pattern: str, targets: Callable[..., list[Row]], *args: object) -> Callable[[Path], list[Row]]:
    """The target rows ``targets(run, *args)`` gives for each of the logs' JSON files matching ``pattern``."""
    return lambda logs: [row for path in sorted(logs.glob(pattern))
                         for row in targets(json.loads(path.read_text()), *args)]


@dataclass(frozen=True)
class Stage:
    """A row of the table: ``commands`` (a function of the mode) and its docstring, which says what the stage
    measures and, after "Decides:", the targets it decides (the report's stage table shows both)."""

    name: str
    part: int
    """The device call that runs it (0: every call)."""
    box_s: float
    """Seconds on a GPU (the dry run: ``DRY_BOX_S``)."""
    commands: Callable[[Mode], list[Command]]
    checks: Checks | None = None
    targets: Callable[[Path], list[Row]] | None = None
    """The report's target rows, from the stage's JSON in the logs folder."""
    tail: int = 0
    """Lines of each command's output in the report."""

    def describe(self) -> tuple[str, str]:
        """(what it measures, the targets it decides), from ``commands``' docstring."""
        measures, _, decides = " ".join(self.commands.__doc__.split()).partition(" Decides: ")
        return measures, decides or "-"


STAGES: list[Stage] = []


def stage(name: str, part: int, box_s: float, **more: object) -> Callable[[Callable], Callable]:
    """Declares the decorated commands function as the next row of ``STAGES``."""
    def declare(commands: Callable[[Mode], list[Command]]) -> Callable[[Mode], list[Command]]:
        STAGES.append(Stage(name, part, box_s, commands, **more))
        return commands
    return declare


VARIANTS = ("swiglu+softmax", "isogmlp+softmax", "iso_ln+softmax", "iso_mlp+softmax", "swiglu+iso_tanh")
SCORINGS = ("swiglu+softmax", "swiglu+iso_tanh")
"""swiglu with each attention scoring: the rows timed on packed documents and at long context."""
QWEN3 = (*(Target("ratio", "swiglu+softmax", f"transformers Qwen3 {q}", 1.2) for q in ("+ Liger FLCE",
                                                                                     "(loss compiled)")),
         Target("ratio", "swiglu+softmax", "transformers Qwen3 (loss eager, outside)"))
HEADLINE = (Target("mfu", "swiglu+softmax", value=0.40),
            *(Target("ratio", v, "swiglu+softmax", 0.95, 0.93) for v in VARIANTS[1:]), *QWEN3,
            *(Target("ratio", f"{v} packed", v, 0.97) for v in SCORINGS))


def packed(mean: int) -> list[str]:
    """swiglu with each scoring on packed documents of ``mean`` tokens on average, each over its unpacked row."""
    return [a for v in SCORINGS for a in ("--extra-row", f"{v} packed", v, f"packed_docs={mean}")]


def sized(m: Mode, preset: str, seq: int, batch: int, dry_seq: int, dry_batch: int) -> list[str]:
    return m.pick(["--preset", preset, "--seq", str(seq), "--batch", str(batch)],
                  ["--seq", str(dry_seq), "--batch", str(dry_batch)])


def short(m: Mode, times: int = 1) -> list[str]:
    """A run of ``times`` x a fifth of the mode's steps, checkpointed and evaluated at its end only."""
    return [f"train.{key}={m.steps // 5 * times}" for key in ("max_steps", "checkpoint_every", "eval_every")]


# Each box: the stage's time on the last GPU checks (docs/performance.md, "GPU results"), or its parts' times where
# it never ran whole. Part 1's, env's included, add up to 480 s: the first device call proves and measures first.
@stage("env", 0, 25, tail=20)  # ~18 s to import torch and the package (H100, 2026-11-25)
def env_commands(m: Mode) -> list[Command]:
    """Versions, the GPU, and `pip check`: every installed package's requirements met (the carried wheels'
    against the image's)."""
    return [("env", [PY, "scripts/gpu_runs.py", "versions"]), ("env-pip-check", [PY, "-m", "pip", "check"])]


@stage("pytest", 1, 100, tail=15)  # 9 passed in 74 s after ~25 s of collection (H100, 2026-11-26)
def pytest_commands(m: Mode) -> list[Command]:
    """`pytest -m gpu`: fla compiled and eager, the FP8 head, static decoding, the compiled document mask.
    Decides: the GPU tests pass."""
    return [("pytest", [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"])]


# eager DDP, compiled DDP and FSDP2 done, compiled ZeRO-3 at step 14 of 20 in 200 s (H200, 2026-11-26); the FP8
# run is eager, mostly start-up (~20 s): a tight box, the first to grow if part 1 gets more room
@stage("compile", 1, 230, checks=loss_stage("compile", ("ddp", lambda m: m.pick(("ddp_compiled", *COMPARED[1:]),
                                                                                ("ddp_compiled",)), None),
                                            ("ddp", lambda m: ("fp8_head",), FP8_LOSS_TOLERANCE)))
def compile_commands(m: Mode) -> list[Command]:
    """train.py with `train.compile=true` through DDP, FSDP2 and ZeRO-3 (dry run: DDP), 20 steps (dry run: 4),
    an eager DDP run, and an eager DDP run with the FP8 head. Decides: each compiled engine's losses agree with
    eager DDP's; the FP8 head's with bf16's (0.05 at step 1, 0.5% over the last 10 steps)."""
    compiled = m.pick([("ddp", "ddp_compiled"), *((c, c) for c in COMPARED[1:])], [("ddp", "ddp_compiled")])
    return [train("compile", "ddp", "ddp", m, *short(m)),
            *(train("compile", c, n, m, *short(m), "train.compile=true") for c, n in compiled),
            train("compile", "ddp", "fp8_head", m, *short(m), f"model.{FP8_HEAD}")]


FP8_ROWS = (Target("mfu", "swiglu+softmax fp8-head", value=0.45),
            Target("ratio", "swiglu+softmax fp8-head", "swiglu+softmax"))
LONG = (Target("ratio", "swiglu+iso_tanh", "swiglu+softmax", 1.0),
        Target("memory", "swiglu+iso_tanh", "swiglu+softmax"))


# 5 of the step stage's ~10 compiled rows, which took 123-182 s (H100 and H200, 2026-11-25/26): ~18 s of imports,
# 3-18 s to compile each of our rows, 44-63 s for Qwen3 compiled whole
@stage("headline", 1, 125, tail=20, targets=json_targets("headline.json", gpu_runs.bench_targets,
                                                         (*HEADLINE, *FP8_ROWS)))
def headline_commands(m: Mode) -> list[Command]:
    """134m at 32 x 2048: swiglu, isogmlp with softmax, swiglu+iso_tanh, swiglu+softmax with the FP8 head,
    transformers Qwen3 + Liger FLCE (the fair Qwen3 row that fits at 32), paired. Decides: MFU >= 40%;
    isogmlp and iso_tanh >= 0.95x swiglu (lower end >= 0.93); >= 1.2x Qwen3; the FP8 head's MFU >= 45%."""
    return [bench_step("headline", m, *sized(m, "134m", 2048, 32, 32, 2), "--variants", "swiglu+softmax",
                       "isogmlp+softmax", "swiglu+iso_tanh", *m.pick(["--qwen3", "liger"], ["--qwen3", "loss-inside"]),
                       "--extra-row", "swiglu+softmax fp8-head", "swiglu+softmax", FP8_HEAD)]


# 123-182 s for ~10 compiled rows (H100 and H200, 2026-11-25/26)
@stage("step", 2, 170, tail=30, targets=json_targets("step.json", gpu_runs.bench_targets, HEADLINE))
def step_commands(m: Mode) -> list[Command]:
    """134m at 32 x 2048: swiglu, isogmlp, iso_ln, iso_mlp with softmax, swiglu+iso_tanh, swiglu with each
    scoring on packed documents, transformers Qwen3 + Liger FLCE (the Qwen3 row that fits at 32): tokens/s, MFU,
    the step's peak memory, compile seconds; also step.csv. Decides: MFU >= 40%; every FFN >= 0.95x swiglu (lower
    end >= 0.93); >= 1.2x Qwen3; packed >= 0.97x."""
    return [bench_step("step", m, *sized(m, "134m", 2048, 32, 32, 2), "--variants", *VARIANTS,
                       *m.pick(["--qwen3", "liger", *packed(700)], ["--qwen3", "loss-inside", "liger", *packed(8),
                                                                     "--profile"]), "--csv", "{logs}/step.csv")]


# not run yet: 2 x 2 compiled rows at 16k and 32k, fla's first call autotuning (~50 s, H100, 2026-11-25)
@stage("long", 2, 90, tail=12, targets=json_targets("long-*.json", gpu_runs.bench_targets, LONG))
def long_commands(m: Mode) -> list[Command]:
    """swiglu+softmax against swiglu+iso_tanh at 1 x 16k and 1 x 32k (dry run: 128): step time paired, each
    step's peak memory. Decides: iso_tanh's step faster than softmax's, with no higher peak."""
    return [bench_step(f"long-{i}", m, *sized(m, "134m", t, 1, t, 1), "--qwen3", "--variants", *SCORINGS,
                       "--set", f"model.max_position_embeddings={t}")
            for i, t in enumerate(m.pick([16384, 32768], [128]))]


# 4 of 5 lengths in 250 s, each worker autotuning fla (H100, 2026-11-25); the workers now share triton's cache
@stage("attention", 2, 240, tail=10, targets=json_targets("attention.json", gpu_runs.attention_targets, 8192))
def attention_commands(m: Mode) -> list[Command]:
    """bench/bench_attention.py: fwd+bwd time (paired) and memory of iso_tanh through fla's custom ops eager and
    compiled and the compiled chunked form, against SDPA (flash), B=4, 8 heads of 64, T = 2k-32k. Decides:
    iso_tanh faster than SDPA from 8k with no more memory; FLA_MIN_LENGTH picks the faster form."""
    return [("attention", [PY, "bench/bench_attention.py", *m.pick(
        ["--device", "cuda", "--dtype", "bf16", "--impls", "sdpa,chunked_compiled,fla,fla_compiled", "--batch", "4",
         "--heads", "8", "--lengths", "2048,4096,8192,16384,32768"],
        ["--impls", "sdpa,chunked", "--lengths", "128", "--rounds", "6", "--threads", "1"]),
        "--json", "{logs}/attention.json"])]


# 70 s (H100, 2026-11-26)
@stage("generate", 3, 170, tail=12, targets=json_targets("generate.json", gpu_runs.generate_targets, 16384))
def generate_commands(m: Mode) -> list[Command]:
    """bench/bench_generate.py: 134m, decode tokens/s (paired per token) and state, softmax's KV cache against
    iso_tanh's state, each growing and static (one CUDA graph per token), context 4k-32k. Decides: iso_tanh
    decodes at least as fast as softmax from 16k."""
    return [("generate", [PY, "bench/bench_generate.py", *m.pick(
        ["--device", "cuda", "--dtype", "bf16", "--preset", "134m", "--contexts", "4096", "8192", "16384", "32768",
         "--new-tokens", "32"], ["--preset", "tiny", "--contexts", "64", "128", "--new-tokens", "6", "--threads", "1"]),
        "--json", "{logs}/generate.json"])]


def batch_targets(logs: Path) -> list[Row]:
    """Each micro batch's row and the Muon row over swiglu+softmax at 32 (reported: the fastest micro batch that
    fits is the finding, and Muon's cost); at 8, swiglu+softmax over each Qwen3 row."""
    return [*json_targets("batch-0.json", gpu_runs.reference_rows)(logs),
            *json_targets("batch-1.json", gpu_runs.bench_targets, QWEN3)(logs)]


# not run yet: 4 compiled rows at 32-64 x 2048 (Muon's at 32), then 4 at 8 x 2048 with Qwen3 compiled whole (44-63 s
# each); the box took 30 s of generate's
@stage("batch", 3, 330, tail=20, targets=batch_targets)
def batch_commands(m: Mode) -> list[Command]:
    """swiglu+softmax at micro batch 32, 48 and 64 x 2048 and with `train.optimizer=muon` at 32 (tokens/s paired,
    step peak: Muon's step against AdamW's, one optimizer step per micro batch); then at 8 x 2048 against
    transformers' Qwen3 with its loss outside its graph, inside it, and Liger FLCE. Decides: >= 1.2x each fair
    Qwen3 row (the micro batches and Muon: reported)."""
    batches = [a for n in m.pick([48, 64], [3, 4]) for a in ("--extra-row", f"swiglu+softmax batch {n}",
                                                              "swiglu+softmax", f"batch={n}")]
    return [bench_step("batch-0", m, *sized(m, "134m", 2048, 32, 32, 2), "--qwen3", "--variants", "swiglu+softmax",
                       *batches, "--extra-row", "swiglu+softmax muon", "swiglu+softmax", "optimizer=muon"),
            bench_step("batch-1", m, *sized(m, "134m", 2048, 8, 32, 2), "--variants", "swiglu+softmax",
                       *m.pick([], ["--qwen3", "loss-outside", "loss-inside"]))]


# its part, env included, in 366 s (H100, 2026-11-25)
@stage("train", 4, 470, checks=train_checks)
def train_commands(m: Mode) -> list[Command]:
    """train.py, 100 steps of 134m (dry run: 20) on the FineWeb sample, through ddp, fsdp2, deepspeed_zero3, a
    resume of the DDP run from half-way, then single_gpu and deepspeed_zero2; each run's peak memory beside
    `isollm-params --plan`'s. Decides: the engines' losses agree; the resume repeats the steps; each run used the
    engine its config asked for."""
    return [*(train("train", c, c, m) for c in COMPARED),
            ("train-truncate", [PY, "scripts/gpu_runs.py", "truncate", "{work}/train/ddp", "{work}/train/ddp-resume",
                                str(m.steps // 2)]),
            train("train", "ddp", "ddp-resume", m, "resume=true"),
            *(train("train", c, c, m) for c in m.pick(["single_gpu", "deepspeed_zero2"], []))]


# not run yet: two eager DDP runs of 200 steps x 8k tokens (eager DDP: 62-90k tokens/s, 2026-11-25/26)
@stage("fp8_loss", 5, 120, checks=loss_stage("fp8_loss", ("bf16_head", lambda m: ("fp8_head",), FP8_LOSS_TOLERANCE)))
def fp8_loss_commands(m: Mode) -> list[Command]:
    """train.py through DDP, 200 steps (dry run: 40), with bf16's LM head and the FP8 head. Decides: the FP8
    head's loss within 0.5% of bf16's."""
    return [train("fp8_loss", "ddp", name, m, *short(m, 10), *extra) for name, extra in
            (("bf16_head", []), ("fp8_head", [f"model.{FP8_HEAD}"]))]


# 166 s at 3 rounds (H100, 2026-11-26); now 10
@stage("step_more", 5, 320, tail=40, targets=json_targets("step_more-*.json", lambda run: [
    (f"{name} at {run['setup']}: MFU of the measured matmul rate, compile s",
     f"{f['of_roofline']:.1%}, {f['first_step_s']:.0f} s", "-") for name, f in run["variants"].items()]))
def step_more_commands(m: Mode) -> list[Command]:
    """250m at 8 x 2048 (tokens/s, MFU, compile s); isogmlp+softmax and swiglu+iso_tanh at 134m x 8 with their
    top 10 kernels, iso_tanh also with full-fp32 matmuls (`tf32=false`)."""
    return [*m.pick([bench_step("step_more-0", m, "--preset", "250m", "--seq", "2048", "--batch", "8", "--qwen3",
                                "--variants", "swiglu+softmax")], []),
            bench_step("step_more-1", m, *sized(m, "134m", 2048, 8, 32, 4), "--qwen3", "--variants",
                       *m.pick(["isogmlp+softmax"], []), "swiglu+iso_tanh", "--extra-row", "swiglu+iso_tanh no-tf32",
                       "swiglu+iso_tanh", "tf32=false", "--profile",
                       *m.pick(["isogmlp+softmax", "swiglu+iso_tanh"], ["swiglu+iso_tanh no-tf32"]))]
