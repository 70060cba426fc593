"""The GPU check: a table of stages (``STAGES``: name, device call, time box, commands, what each measures and
the targets it decides), run in order through scripts/gpu_check.sh, and the report generated from that table.

    python scripts/gpu_check.py --part 1 OUTDIR     # on one CUDA GPU: the stages of device call 1 (of 5)
    python scripts/gpu_check.py --dry-run OUTDIR    # every stage at tiny size on CPU (fp32, no fla)
    python scripts/gpu_check.py --list              # the table, as docs/performance.md shows it

Part 1 proves correctness and measures the headline within 480 s of boxes: the GPU tests, every engine with
``train.compile`` and the FP8 head against eager DDP, then the headline rows at 134m, 32 x 2048 (swiglu, isogmlp,
swiglu+iso_tanh, the FP8 head) against the fair Qwen3 row. Then every step row, long context and attention
(part 2), generation and the micro batch, the launch configs with a resume, and the FP8 head's loss over 200
steps and the larger sizes. Each part is one device call within ``GPU_BUDGET_S``. A stage whose command fails or
runs out of its box is recorded and the next command and stage still run. The boxes are set from the GPU checks
of 2026-11-25/26 (one H100 and one H200: ~18 s to import torch and the package, a step stage of ~10 compiled rows
123-182 s, nine GPU tests 100 s with their collection, fla's autotuning ~40 s in each attention worker's
process; each box cites its figure in gpu_stages.py). Every bench_train_step run times its rows
in paired rounds and gives each ratio with its 95% interval; a target is met only where the interval clears it.

OUTDIR receives report.md and logs.tar.gz (every command's output, the bench figures as JSON and the training
runs' metrics.jsonl): two files, within what a lent machine sends back.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from gpu_stages import DRY, DRY_BOX_S, GPU, GPU_BUDGET_S, REPO, STAGES, Mode, Stage


def run_stage(stage: Stage, mode: Mode, work: Path, data: Path | None, deadline: float) -> tuple[str, list[str]]:
    """The stage's commands in order (each into ``logs/<label>.log``), then its checks: status and report lines."""
    logs, status, notes, done = work / "logs", "ok", [], set()
    end = min(deadline, time.monotonic() + (stage.box_s if mode.gpu else DRY_BOX_S))
    commands = stage.commands(mode)
    if data is None and any("{data}" in arg for _, argv in commands for arg in argv):
        return "skipped", ["- no FineWeb sample (.whl/fineweb-sample or ../shared/data/fineweb-sample)"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **mode.env}
    for label, argv in commands:
        argv = [a.replace("{logs}", str(logs)).replace("{work}", str(work)).replace("{data}", str(data)) for a in argv]
        left = end - time.monotonic()
        with open(logs / f"{label}.log", "w") as out:
            print(f"$ {' '.join(argv)}", file=out, flush=True)
            try:
                code = subprocess.run(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=max(left, 0.1), check=False).returncode
                note = f"exit code {code}"
            except subprocess.TimeoutExpired:
                code, note, status = None, f"stopped after {max(left, 0):.0f} s (the stage's time box)", "timeout"
        if code == 0:
            done.add(label)
        else:  # a timeout stays the stage's status
            status = "failed" if status == "ok" else status
            notes.append(f"- `{label}`: {note}")
        if stage.tail:
            text = (logs / f"{label}.log").read_text().splitlines()
            notes += ["```", *[line[:300] for line in text[-stage.tail:]], "```"]
    if stage.checks:
        lines, ok = stage.checks(mode, work, done)
        notes += lines
        status = "failed" if status == "ok" and not ok else status
    return status, notes


def write_report(out: Path, mode: Mode, results: list[tuple[Stage, str, float, list[str]]], logs: Path,
                 data: Path | None, started: float, part: int | None) -> None:
    """report.md: the stages (what each measures and decides) with their status, the targets, each stage's notes."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                            check=False).stdout.strip() or "unknown (no git)"
    lines = [f"# GPU check ({'gpu' if mode.gpu else 'dry-run'}{f', part {part}' if part else ''})", "",
             f"{now}, commit {commit}, host {platform.node()}, {time.monotonic() - started:.0f} s in all. "
             f"Data: {data or 'none'}.", "", "| stage | status | seconds | measures | decides |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {s.name} | {status} | {seconds:.0f} | {' | '.join(s.describe())} |"
              for s, status, seconds, _ in results]
    lines += ["", "## Targets", "", *([] if mode.gpu else [
        "Dry run: tiny sizes on CPU, so these figures say nothing about the targets; the table is built as on the "
        "GPU.", ""]), "| target | measured | |", "| --- | --- | --- |"]
    lines += [f"| {what} | {value} | {met} |" for s, *_ in results if s.targets for what, value, met in s.targets(logs)]
    for s, status, _, notes in results:
        lines += ["", f"## {s.name}: {status}", "", *notes]
    lines += ["", "Raw output of every stage and each training run's metrics.jsonl: logs.tar.gz."]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parts = sorted({s.part for s in STAGES} - {0})
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?", help="folder for report.md and logs.tar.gz")
    parser.add_argument("--dry-run", action="store_true", help="every stage at tiny size on CPU, fp32, no fla")
    parser.add_argument("--part", type=int, choices=parts, help="on a GPU (required there): one device call's stages")
    parser.add_argument("--stage", action="append", choices=[s.name for s in STAGES], help="only these (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the stage table (markdown) and exit")
    parser.add_argument("--data", type=Path, help="FineWeb sample folder (default: .whl/fineweb-sample, else "
                                                  "../shared/data/fineweb-sample)")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a fresh one in $TMPDIR)")
    args = parser.parse_args(argv)
    if args.list:
        print("| part | stage | box s | measures | decides |\n| --- | --- | --- | --- | --- |")
        print("\n".join(f"| {s.part or 'all'} | {s.name} | {s.box_s:.0f} | {' | '.join(s.describe())} |"
                        for s in STAGES))
        return 0
    mode = DRY if args.dry_run else GPU
    if args.out is None:
        parser.error("give OUT, the folder for report.md and logs.tar.gz")
    if mode.gpu:
        import torch

        if not torch.cuda.is_available():
            parser.exit(2, "gpu_check: error: no CUDA device; use --dry-run on a CPU machine\n")
        if args.part is None and args.stage is None:
            parser.exit(2, f"gpu_check: error: --part: give one of {parts} (one device call each)\n")
    chosen = args.stage or [s.name for s in STAGES if not args.part or s.part in (0, args.part)]
    candidates = [args.data] if args.data else [REPO / ".whl" / "fineweb-sample",
                                                REPO.parent / "shared" / "data" / "fineweb-sample"]
    data = next((d.resolve() for d in candidates if d.is_dir() and any(d.glob("*.parquet"))), None)
    if args.data and data is None:
        parser.exit(2, f"gpu_check: error: --data {args.data}: no *.parquet files there\n")
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"isollm-gpu-check-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    started = time.monotonic()
    deadline = started + (GPU_BUDGET_S if mode.gpu else len(chosen) * DRY_BOX_S)
    results = []
    for stage in [s for s in STAGES if s.name in chosen]:
        start = time.monotonic()
        try:
            status, notes = run_stage(stage, mode, work, data, deadline)
        except Exception as err:  # a broken stage is reported; the next one still runs
            status, notes = "failed", [f"- the check itself failed: {type(err).__name__}: {err}"]
        results.append((stage, status, time.monotonic() - start, notes))
        print(f"gpu_check: {stage.name}: {status} ({results[-1][2]:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, mode, results, work / "logs", data, started, args.part)
    with tarfile.open(args.out / "logs.tar.gz", "w:gz") as tar:
        tar.add(work / "logs", arcname="logs")
    print(f"gpu_check: report {args.out / 'report.md'}; logs {args.out / 'logs.tar.gz'}")
    return 0 if all(status in ("ok", "skipped") for _, status, _, _ in results) else 1  # a skip says why


if __name__ == "__main__":
    raise SystemExit(main())
