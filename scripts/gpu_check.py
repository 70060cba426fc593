"""The GPU check's stages, each time-boxed, and its report (run through scripts/gpu_check.sh).

    python scripts/gpu_check.py --part 1 OUTDIR     # on one CUDA GPU: part 1 of 5 (each one device call)
    python scripts/gpu_check.py --dry-run OUTDIR    # every stage at tiny size on CPU (fp32, no fla)

On a GPU the stages come in five parts, each within one device call of 10 minutes (``PARTS``, gpu_modes.py):
1 = the short part (about 6 minutes with the machine's start-up): step (the headline rows, first), fp8
and long; 2 = train; 3 = compile, attention and fp8_loss; 4 = step_more and generate; 5 = pytest and batch; env
runs in each.
The boxes are set from the GPU checks (2026-11-25, one H100 whose host took ~18 s to import torch and the
package; 2026-11-26, one H200 and one H100: a step stage of ~10 compiled rows 123-182 s, nine GPU tests 100 s
with their collection, step_more 166 s, generate 70 s), the attention box from the second (fla autotunes in each
length's process, ~40 s a length); generate's leaves room for fla's autotuning of iso_tanh's prefill from 8k.
Every bench_train_step run times its rows in 10 interleaved rounds and gives each ratio as a paired median with
its 95% interval; the targets table calls a target met only where the interval's lower end clears it.

Stages, in order (a stage that fails or runs out of time is recorded and the next one starts):
  env        versions, the GPU, and whether every carried wheel's requirements are met
  step       bench/bench_train_step.py: the 134m preset at 32 x 2048, bf16, compiled as train.compile does:
             swiglu/isogmlp/iso_ln/iso_mlp+softmax, swiglu+iso_tanh, swiglu with each scoring on packed
             documents, and transformers' Qwen3 with Liger's fused linear cross-entropy (the Qwen3 row that fits
             at 32); tokens/s, paired ratios, MFU (datasheet), the step's peak memory, compile seconds
  fp8        swiglu+softmax and its FP8-head copy (gpu_modes.FP8_HEAD), paired; skipped until the field exists
  long       swiglu+softmax and swiglu+iso_tanh at 1 x 16k and 1 x 32k: step time, paired, and peak memory
  pytest     ``pytest -m gpu``
  batch      the micro batch: swiglu+softmax at 32, 48 and 64 x 2048 in one process (tokens/s paired, peak
             memory); then at 8 x 2048 against transformers' Qwen3 with its loss outside its compiled graph (an
             upper bound), inside it (the fair row) and with Liger's fused linear cross-entropy
  train      train.py, 100 steps (dry run: 20) on the FineWeb sample with the offline Qwen3 tokenizer, through each
             launch/accelerate/*.yaml with one process (DDP, FSDP2 and ZeRO-3 first), then a resume from the
             DDP run's half-way checkpoint; checks that DDP, FSDP2 and ZeRO-3 losses agree, that each run used
             the engine its config asked for, and that the resumed steps repeat the original ones; each run's
             measured peak memory stands beside ``isollm-params --plan``'s estimate for it
  step_more  bench/bench_train_step.py beyond the headline, compiled, bf16, seq 2048, without transformers'
             Qwen3: 250m (tokens/s, MFU, compile time); and isogmlp and iso_tanh at 134m x 8, profiled, iso_tanh
             also with its fp32 matmuls in full fp32 (``--no-tf32``): where their time goes, what TF32 gives
  compile    train.py with train.compile=true through DDP, FSDP2 and ZeRO-3 (one process, 20 steps; dry run: DDP
             alone, 4 steps), each run's losses against an eager DDP run's
  attention  bench/bench_attention.py: fwd+bwd time and memory, iso_tanh compiled, chunked and through fla's
             custom ops, against SDPA (flash), T=2k-32k
  fp8_loss   train.py through DDP, 200 steps, with bf16's LM head and with the FP8 head: the losses after
  generate   bench/bench_generate.py: decode tokens/s and state, softmax KV cache against the iso_tanh state,
             each with the growing cache and a static one (one CUDA graph per token), context 4k-32k

OUTDIR receives report.md and logs.tar.gz (every stage's output and the training runs' metrics.jsonl): two
files, within what a lent machine sends back.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar

from gpu_env import environment
from gpu_modes import COMPARED, DRY, FP8_HEAD, FP8_LOSS_TOLERANCE, GPU, PARTS, Mode
from gpu_runs import (
    VARIANTS,
    engine_lines,
    engine_table,
    loss_checks,
    prepare_resume,
    read_run,
    resume_check,
    targets,
)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


@dataclass
class Result:
    stage: str
    status: str = "ok"
    """ok | failed | timeout | skipped"""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    """Markdown lines for the report (tables, checks)."""
    logs: list[Path] = field(default_factory=list)


class Check:
    """Runs the stages of ``mode`` with ``work`` as scratch space; logs go to ``work/logs``."""

    def __init__(self, mode: Mode, work: Path, data: Path | None) -> None:
        self.mode, self.work, self.data = mode, work, data
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + mode.budget_s
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **mode.env}

    def run(self, result: Result, label: str, argv: list[str], stage_end: float) -> bool:
        """Run ``argv`` from the repository root into ``logs/<label>.log`` until ``stage_end``; False (and the
        result marked) when it fails or runs out of time."""
        log = self.logs / f"{label}.log"
        result.logs.append(log)
        left = min(stage_end, self.deadline) - time.monotonic()
        if left <= 1:
            result.status = "timeout"
            result.notes.append(f"- `{label}`: not started, no time left in the stage's box")
            return False
        with open(log, "w") as out:
            out.write(f"$ {' '.join(argv)}\n")
            out.flush()
            try:
                proc = subprocess.run(argv, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=left, check=False)
            except subprocess.TimeoutExpired:
                result.status = "timeout"
                result.notes.append(f"- `{label}`: stopped after {left:.0f} s (the stage's time box)")
                return False
        if proc.returncode:
            result.status = "failed"
            result.notes.append(f"- `{label}`: exit code {proc.returncode}")
            return False
        return True

    # -- stages ----------------------------------------------------------------------------------------------

    def stage_env(self, result: Result, end: float) -> None:
        lines, problems = environment(REPO / ".whl")
        (self.logs / "env.log").write_text("\n".join(lines) + "\n")
        result.logs.append(self.logs / "env.log")
        result.notes += ["```", *lines, "```"]
        if problems:
            result.status = "failed"

    def stage_pytest(self, result: Result, end: float) -> None:
        self.run(result, "pytest", [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"], end)
        result.notes += _tail_block(result.logs[-1], 15)

    def stage_step(self, result: Result, end: float) -> None:
        argv = [PY, "bench/bench_train_step.py", *self.mode.step_args, "--variants", *VARIANTS,
                "--json", str(self.logs / "step.json"), "--csv", str(self.logs / "step.csv")]
        self.run(result, "step", argv, end)
        result.notes += _tail_block(result.logs[-1], 30)

    def stage_attention(self, result: Result, end: float) -> None:
        argv = [PY, "bench/bench_attention.py", *self.mode.attention_args, "--json", str(self.logs / "attention.json")]
        self.run(result, "attention", argv, end)
        result.notes += _tail_block(result.logs[-1], 10)

    def bench_runs(self, result: Result, end: float, label: str, runs: tuple[list[str], ...]) -> None:
        """bench_train_step.py once per argument list, into ``<label>-<i>.log`` and ``<label>-<i>.json``."""
        for i, args in enumerate(runs):
            argv = [PY, "bench/bench_train_step.py", *args, "--json", str(self.logs / f"{label}-{i}.json")]
            self.run(result, f"{label}-{i}", argv, end)
            result.notes += _tail_block(result.logs[-1], 40)

    def stage_step_more(self, result: Result, end: float) -> None:
        self.bench_runs(result, end, "step_more", self.mode.step_more_args)

    def stage_long(self, result: Result, end: float) -> None:
        self.bench_runs(result, end, "long", self.mode.long_args)

    def stage_batch(self, result: Result, end: float) -> None:
        self.bench_runs(result, end, "batch", self.mode.batch_args)

    @staticmethod
    def has_fp8_head(result: Result) -> bool:
        """Whether ModelConfig has the FP8 head's field (``FP8_HEAD``); the stage is marked skipped when not."""
        from llm.model import ModelConfig

        if FP8_HEAD[0] not in {f.name for f in fields(ModelConfig)}:
            result.status = "skipped"
            result.notes.append(f"- ModelConfig has no field `{FP8_HEAD[0]}` yet (the FP8 LM head, lm_head.py; "
                                "scripts/gpu_modes.py FP8_HEAD names it)")
        return result.status != "skipped"

    def stage_fp8(self, result: Result, end: float) -> None:
        """FP8 head rows: swiglu+softmax and its copy with ``FP8_HEAD`` set, paired in one bench run."""
        if self.has_fp8_head(result):
            self.bench_runs(result, end, "fp8", (self.mode.fp8_args,))

    def stage_fp8_loss(self, result: Result, end: float) -> None:
        """train.py twice through DDP, bf16's LM head and the FP8 head, 2 x train_steps steps: the loss after."""
        if not (self.has_data(result) and self.has_fp8_head(result)):
            return
        runs, steps = self.work / "fp8_loss", 2 * self.mode.train_steps
        launch = self.launcher(result, end, runs, "fp8_loss", f"train.max_steps={steps}",
                               f"train.checkpoint_every={steps}", f"train.eval_every={steps}")
        heads = {"bf16_head": [], "fp8_head": [f"model.{FP8_HEAD[0]}={FP8_HEAD[1]}"]}
        done = {name: read_run(runs / name) for name, extra in heads.items() if launch("ddp", f"name={name}", *extra)}
        checks = loss_checks(done, FP8_LOSS_TOLERANCE, ("fp8_head",), reference="bf16_head")
        result.notes += [*engine_table(done), "", "| check | result | detail |", "| --- | --- | --- |",
                         *[f"| {what} | {'pass' if ok else 'FAIL'} | {detail} |" for what, ok, detail in checks]]
        if result.status == "ok" and not all(ok for _, ok, _ in checks):
            result.status = "failed"

    def stage_generate(self, result: Result, end: float) -> None:
        argv = [PY, "bench/bench_generate.py", *self.mode.generate_args, "--json", str(self.logs / "generate.json")]
        self.run(result, "generate", argv, end)
        result.notes += _tail_block(result.logs[-1], 12)

    def has_data(self, result: Result) -> bool:
        """Whether the FineWeb sample is there to train on; the stage is marked skipped when not."""
        if self.data is None:
            result.status = "skipped"
            result.notes.append("- no FineWeb sample (.whl/fineweb-sample or ../shared/data/fineweb-sample)")
        return self.data is not None

    def launcher(self, result: Result, end: float, runs: Path, label: str, *overrides: str) -> Callable[..., bool]:
        """``launch(config, "name=...", *more)``: train.py through ``launch/accelerate/<config>.yaml``, one
        process, on the FineWeb sample, into ``runs``, logged as ``<label>-<name>.log``."""
        base = [*self.mode.train_overrides, f"data.source={self.data}", f"data.cache_dir={self.work / 'cache'}",
                f"out_dir={runs}", *overrides]

        def launch(config: str, *extra: str) -> bool:
            argv = [PY, "-m", "accelerate.commands.launch", "--config_file", f"launch/accelerate/{config}.yaml",
                    "--num_processes", "1", "train.py", *base, *extra]
            return self.run(result, f"{label}-{extra[0].removeprefix('name=')}", argv, end)

        return launch

    def stage_compile(self, result: Result, end: float) -> None:
        if not self.has_data(result):
            return
        runs = self.work / "compile"
        steps = self.mode.train_steps // 5
        launch = self.launcher(result, end, runs, "compile", f"train.max_steps={steps}",
                               f"train.checkpoint_every={steps}", f"train.eval_every={steps}")
        # on CPU Accelerate drops FSDP and DeepSpeed (the train stage records it): compiling them there proves nothing
        engines = (("ddp", "ddp_compiled"), *(((c, c) for c in COMPARED[1:]) if self.mode.name == GPU.name else ()))
        ran = ["ddp"] if launch("ddp", "name=ddp") else []
        ran += [name for config, name in engines if launch(config, f"name={name}", "train.compile=true")]
        done = {name: read_run(runs / name) for name in ran}
        result.notes += ["Eager DDP against each engine compiled (`train.compile=true`):", "",
                         *engine_table(done), "", "| check | result | detail |", "| --- | --- | --- |"]
        checks = loss_checks(done, self.mode.loss_tolerance, tuple(name for _, name in engines))
        result.notes += [f"| {what} (compiled) | {'pass' if ok else 'FAIL'} | {detail} |"
                         for what, ok, detail in checks]
        if result.status == "ok" and not all(ok for _, ok, _ in checks):
            result.status = "failed"

    def stage_train(self, result: Result, end: float) -> None:
        if not self.has_data(result):
            return
        runs = self.work / "runs"
        launch = self.launcher(result, end, runs, "train")

        ran = [c for c in COMPARED if launch(c, f"name={c}")]
        half = self.mode.train_steps // 2
        resumed = "ddp" in ran and prepare_resume(runs / "ddp", runs / "ddp-resume", half)
        resumed = resumed and launch("ddp", "name=ddp-resume", "resume=true")
        ran += [c for c in self.mode.train_configs if c not in COMPARED and launch(c, f"name={c}")]

        done = {name: read_run(runs / name) for name in [*ran, *(["ddp-resume"] if resumed else [])]}
        for name in done:
            shutil.copy(runs / name / "metrics.jsonl", self.logs / f"metrics-{name}.jsonl")
        result.notes += engine_table(done)
        result.notes += ["", *[f"- {name} said: `{line}`" for name in done
                               for line in engine_lines(self.logs / f"train-{name}.log")]]
        checks = loss_checks(done, self.mode.loss_tolerance)
        if resumed:
            checks.append(resume_check(done["ddp"], done["ddp-resume"], half, self.mode.resume_tolerance))
        if self.mode.name == GPU.name:  # on CPU Accelerate drops FSDP, DeepSpeed: table and runs say so
            checks += [(f"{name} trains with the engine its config asked for",
                        run.meta["engine_requested"] in (None, run.meta["engine"]),
                        f"asked {run.meta['engine_requested']}, ran {run.meta['engine']}")
                       for name, run in done.items()]
        result.notes += ["", "| check | result | detail |", "| --- | --- | --- |"]
        result.notes += [f"| {what} | {'pass' if ok else 'FAIL'} | {detail} |" for what, ok, detail in checks]
        if result.status == "ok" and not all(ok for _, ok, _ in checks):
            result.status = "failed"

    STAGES: ClassVar[dict[str, Callable[[Check, Result, float], None]]] = {
        "env": stage_env, "step": stage_step, "fp8": stage_fp8, "long": stage_long, "train": stage_train,
        "compile": stage_compile, "attention": stage_attention, "fp8_loss": stage_fp8_loss,
        "step_more": stage_step_more,
        "generate": stage_generate, "pytest": stage_pytest, "batch": stage_batch,
    }

    def run_all(self, stages: tuple[str, ...]) -> list[Result]:
        results = []
        for name in stages:
            stage = self.STAGES[name]
            result = Result(name)
            start = time.monotonic()
            try:
                stage(self, result, start + self.mode.boxes[name])
            except Exception as err:  # a broken stage is reported; the next one still runs
                result.status = "failed"
                result.notes.append(f"- the check itself failed: {type(err).__name__}: {err}")
            result.seconds = time.monotonic() - start
            print(f"gpu_check: {name}: {result.status} ({result.seconds:.0f} s)", flush=True)
            results.append(result)
        return results


# -- helpers ---------------------------------------------------------------------------------------------------

def _tail_block(log: Path, lines: int) -> list[str]:
    text = log.read_text().splitlines() if log.exists() else ["(no output)"]
    return ["```", *[line[:300] for line in text[-lines:]], "```"]


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() or "unknown (no git)"


def write_report(out: Path, mode: Mode, results: list[Result], logs: Path, data: Path | None,
                 started: float, part: int | None) -> Path:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# GPU check ({mode.name}{f', part {part} of {len(PARTS)}' if part else ''})", "",
             f"{now}, commit {_commit()}, host {platform.node()}, {time.monotonic() - started:.0f} s in all "
             f"(budget {mode.budget_s:.0f} s). Data: {data or 'none'}.", "",
             "| stage | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {r.stage} | {r.status} | {r.seconds:.0f} |" for r in results]
    lines += ["", "## Targets", ""]
    if mode.name == DRY.name:
        lines += ["Dry run: tiny sizes on CPU, so these figures say nothing about the targets; the table is built "
                  "as on the GPU.", ""]
    lines += targets(logs)
    for r in results:
        lines += ["", f"## {r.stage}: {r.status}", "", *r.notes]
    lines += ["", "Raw output of every stage and each training run's metrics.jsonl: logs.tar.gz."]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for report.md and logs.tar.gz")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU, fp32, no fla")
    parser.add_argument("--part", type=int, choices=sorted(PARTS), default=None,
                        help="on a GPU (required there): which device call's stages to run (see PARTS)")
    parser.add_argument("--stage", action="append", choices=list(Check.STAGES), default=None,
                        help="run these stages instead of a part's (repeatable; env is not added)")
    parser.add_argument("--data", type=Path, default=None,
                        help="FineWeb sample folder (default: .whl/fineweb-sample, else ../shared/data/fineweb-sample)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a fresh one in /tmp)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all stages (default: the mode's)")
    args = parser.parse_args(argv)
    mode = DRY if args.dry_run else GPU
    if args.budget:
        mode = replace(mode, budget_s=args.budget)  # GPU and DRY stay as defined
    if mode.name == GPU.name:
        import torch

        if not torch.cuda.is_available():
            parser.exit(2, "gpu_check: error: no CUDA device; use --dry-run on a CPU machine\n")
        if args.part is None and args.stage is None:
            parser.exit(2, f"gpu_check: error: --part: give one of {sorted(PARTS)} (one device call each)\n")
    stages = tuple(args.stage) if args.stage else PARTS[args.part] if args.part else tuple(Check.STAGES)
    candidates = [args.data] if args.data else [REPO / ".whl" / "fineweb-sample", REPO.parent / "shared" / "data" /
                                                "fineweb-sample"]
    data = next((d.resolve() for d in candidates if d.is_dir() and any(d.glob("*.parquet"))), None)
    if args.data and data is None:
        parser.exit(2, f"gpu_check: error: --data {args.data}: no *.parquet files there\n")
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"isollm-gpu-check-{os.getpid()}"
    if work.exists():
        shutil.rmtree(work)
    started = time.monotonic()
    results = Check(mode, work, data).run_all(stages)
    args.out.mkdir(parents=True, exist_ok=True)
    report = write_report(args.out, mode, results, work / "logs", data, started, args.part)
    with tarfile.open(args.out / "logs.tar.gz", "w:gz") as tar:
        tar.add(work / "logs", arcname="logs")
    print(f"gpu_check: report {report}; logs {args.out / 'logs.tar.gz'}")
    return 0 if all(r.status in ("ok", "skipped") for r in results) else 1  # a skipped stage says why


if __name__ == "__main__":
    raise SystemExit(main())
