"""scripts/gpu_check.sh --dry-run: the GPU check's whole sequence at tiny size on CPU, so that a broken check
is caught before a GPU ever runs it. On CPU every launch config trains as DDP: the runs record and say so,
and their losses (and the resumed half) are bitwise equal."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from tiny import FINEWEB, REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"
PARTS = {
    "compile+attention": ("compile", "attention"),
    "train+batch": ("train", "batch"),
    "the_rest": ("env", "pytest", "headline", "step", "long", "generate", "fp8_loss", "step_more"),
}
"""The dry run's stages in three runs of about equal time (whole, ~5.5 minutes on a quiet 2-core machine; on
2026-12-01 under load these took 1051, 1142 and 1182 s, compile's inductor build and train's four launches the
longest stages), one test each, so that the two workers of ``make test`` share them; together every stage of the
table once (checked below)."""
PASSES = {"compile": 2, "train": 3, "fp8_loss": 1}
"""``| pass |`` rows of the report, per stage: the compiled DDP run and the FP8 head vs eager DDP; fsdp2 and zero3 vs
ddp and the resume; the FP8 head's losses vs bf16's (6 in all)."""
LOGGED = {"env": ("env.log",), "pytest": ("pytest.log",), "step": ("step.log", "step.json"),
          "attention": ("attention.log", "attention.json"), "step_more": ("step_more-1.log", "step_more-1.json"),
          "generate": ("generate.log", "generate.json"), "train": ("train-truncate.log",),
          "compile": ("compile-ddp.log", "compile-ddp_compiled.log")}
"""Files each stage leaves in logs.tar.gz (``logs/``), beside its other logs."""


def sample_present() -> bool:
    return any(any(d.glob("*.parquet")) for d in (REPO / ".whl" / "fineweb-sample", FINEWEB))


def test_the_dry_run_parts_cover_every_stage_once() -> None:
    parts = [stage for stages in PARTS.values() for stage in stages]
    assert sorted(parts) == sorted(s.name for s in gpu_check().STAGES) and len(set(parts)) == len(parts)
    assert sum(PASSES.values()) == 6 and set(PASSES) | set(LOGGED) <= set(parts)


@pytest.mark.slow
@pytest.mark.skipif(not sample_present(), reason=f"no FineWeb sample at {FINEWEB} or .whl/fineweb-sample")
@pytest.mark.parametrize("part", PARTS)
def test_dry_run_passes_every_stage_and_records_the_engines(tmp_path: Path, part: str) -> None:
    stages = PARTS[part]
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    env.pop("OUT", None)
    # A hang guard, not a speed claim: the whole dry run takes about 6 minutes on a quiet 2-core machine and may take
    # several times that beside other jobs; its own stage boxes (gpu_check.DRY_BOX_S) are as generous.
    chosen = [arg for stage in stages for arg in ("--stage", stage)]
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out), *chosen], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=3 * 3600, check=False)
    report = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{report}"
    for stage in stages:  # the FP8 head's stages run on CPU through torch's reference kernel
        assert f"| {stage} | ok |" in report
    # fsdp2 and zero3 vs ddp, the resume, train.compile's run vs eager ddp, and the FP8 head's losses vs bf16's (twice)
    assert report.count("| pass |") == sum(PASSES.get(stage, 0) for stage in stages) and "FAIL" not in report
    if "compile" in stages:
        assert "| ddp_compiled losses agree with ddp | pass |" in report
        assert "| fp8_head losses agree with ddp | pass |" in report
    if "fp8_loss" in stages:
        assert "| fp8_head losses agree with bf16_head | pass |" in report
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "report.md"]

    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {f"logs/{name}" for stage in stages for name in LOGGED.get(stage, ())} <= set(tar.getnames())
    if "train" in stages:
        check_the_engines(out, report, tmp_path)


def check_the_engines(out: Path, report: str, tmp_path: Path) -> None:
    """The train stage's runs: each records the engine its launch config asked for and the one it trained with."""
    with tarfile.open(out / "logs.tar.gz") as tar:
        metas = {name: json.loads(tar.extractfile(f"logs/metrics-{name}.jsonl").read().decode().splitlines()[0])
                 for name in ("ddp", "fsdp2", "deepspeed_zero3")}
    assert {name: (m["engine_requested"], m["engine"]) for name, m in metas.items()} == {
        "ddp": (None, "ddp"), "fsdp2": ("fsdp2-full_shard", "ddp"), "deepspeed_zero3": ("deepspeed-zero3", "ddp")}
    assert "fsdp2 said: `engine: the launch configuration asked for fsdp2-full_shard, but this run trains with ddp" \
        in report
    saved = {p.parents[2].name: json.loads(p.read_text())["engine"]
             for p in tmp_path.glob("isollm-gpu-check-*/train/*/checkpoints/*/trainer.json")}
    assert set(saved.values()) == {"ddp"} and {"ddp", "fsdp2", "deepspeed_zero3"} <= saved.keys()


def test_needs_an_output_folder() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and "OUTDIR" in done.stderr


def test_gpu_mode_needs_a_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole GPU check does not fit one 10-minute device call: each call names its part."""
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and "--part 1|2|3|4|5" in done.stderr
    module = gpu_check()
    parts = {s.part for s in module.STAGES}
    assert parts == {0, 1, 2, 3, 4, 5} and [s.name for s in module.STAGES if s.part == 0] == ["env"]
    for part in parts - {0}:  # each part, with env, within one call's budget
        assert sum(s.box_s for s in module.STAGES if s.part in (0, part)) <= module.GPU_BUDGET_S


def test_part_one_proves_correctness_and_measures_the_headline_within_480_s() -> None:
    """The first device call, env included, within 480 s of boxes: the GPU tests, every engine compiled against
    eager DDP, the FP8 head's loss and speed against bf16's, and the headline rows against the fair Qwen3 row."""
    module = gpu_check()
    first = [s for s in module.STAGES if s.part in (0, 1)]
    assert sum(s.box_s for s in first) <= 480
    argvs = [argv for s in first for _, argv in s.commands(module.GPU)]
    assert ["-m", "pytest", "-m", "gpu"] in [argv[1:5] for argv in argvs]
    trains = {next(a for a in argv if a.startswith("name=")): argv for argv in argvs if "train.py" in argv}
    launched = {name: (argv[argv.index("--config_file") + 1], "train.compile=true" in argv,
                       "model.lm_head_precision=fp8" in argv) for name, argv in trains.items()}
    assert launched == {"name=ddp": ("launch/accelerate/ddp.yaml", False, False),
                        "name=ddp_compiled": ("launch/accelerate/ddp.yaml", True, False),
                        "name=fsdp2": ("launch/accelerate/fsdp2.yaml", True, False),
                        "name=deepspeed_zero3": ("launch/accelerate/deepspeed_zero3.yaml", True, False),
                        "name=fp8_head": ("launch/accelerate/ddp.yaml", False, True)}
    [bench] = [" ".join(argv) for argv in argvs if "bench/bench_train_step.py" in argv]
    assert "--preset 134m --seq 2048 --batch 32 --variants swiglu+softmax isogmlp+softmax swiglu+iso_tanh " \
           "--qwen3 liger --extra-row swiglu+softmax fp8-head swiglu+softmax lm_head_precision=fp8" in bench


@pytest.mark.parametrize("command", ["python scripts/gpu_check.py --list", "python scripts/gpu_runs.py versions"])
def test_documented_commands_run_as_written_without_pythonpath(command: str) -> None:
    """The scripts' docstrings' commands, from the repository root with no PYTHONPATH: Python puts scripts/ on
    the path, so the scripts add the root themselves (bench and llm, this checkout's)."""
    argv = command.split()
    assert command in (REPO / argv[1]).read_text()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("| part | stage | box s |" if "--list" in argv else "python ")


def test_the_dry_run_is_not_bounded_by_the_gpu_boxes(tmp_path: Path) -> None:
    """A loaded CPU may run a stage many times slower than a GPU's box allows: the dry run's box is a hang guard
    (``DRY_BOX_S``), so a stage whose GPU box is shorter than its command still passes there, and on a GPU it
    is stopped at its box."""
    module = gpu_check()
    stage = module.Stage("slow", 1, 0.5, lambda m: [("slow", [sys.executable, "-c", "import time; time.sleep(2)"])])
    (tmp_path / "logs").mkdir()
    far = time.monotonic() + 3600
    assert module.run_stage(stage, module.DRY, tmp_path, None, far) == ("ok", [])
    status, notes = module.run_stage(stage, module.GPU, tmp_path, None, far)
    assert status == "timeout" and "the stage's time box" in notes[0]


def gpu_check():
    """scripts/gpu_check.py as a module (it imports gpu_runs as a sibling)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        return script_module("gpu_check")
    finally:
        sys.path.remove(str(REPO / "scripts"))


def script_module(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_resume_check_needs_the_half_way_checkpoint_and_the_same_losses() -> None:
    """On CPU a run that found no checkpoint and trained from step 0 repeats the original's losses bitwise:
    only the meta row's ``resumed_from`` shows it did not resume."""
    check = script_module("gpu_runs")
    losses = {step: 6.0 - step / 10 for step in range(1, 21)}
    original = check.Run({"resumed_from": None}, losses, {})

    def resumed(source: str | None, shift: float = 0.0):
        return check.Run({"resumed_from": source}, {s: v + shift for s, v in losses.items()}, {})

    half = "runs/ddp-resume/checkpoints/step_00000010"
    assert check.resume_check(original, resumed(half), 10, 1e-5)[1]
    assert not check.resume_check(original, resumed(None), 10, 1e-5)[1]
    assert not check.resume_check(original, resumed("runs/ddp-resume/checkpoints/step_00000005"), 10, 1e-5)[1]
    assert not check.resume_check(original, resumed(half, shift=1e-4), 10, 1e-5)[1]
    missing = check.Run({"resumed_from": half}, {s: v for s, v in losses.items() if s != 15}, {})
    assert check.resume_check(original, missing, 10, 1e-5)[1:] == (False, "missing steps [15]")


def test_loss_checks_fail_an_engine_whose_losses_drift() -> None:
    check = script_module("gpu_runs")
    losses = {step: 6.0 - step / 10 for step in range(1, 21)}
    runs = {name: check.Run({}, dict(losses), {}) for name in ("ddp", "fsdp2", "deepspeed_zero3")}
    compared = ("fsdp2", "deepspeed_zero3")
    assert [ok for _, ok, _ in check.loss_checks(runs, (0.02, 0.02), compared)] == [True, True]
    runs["deepspeed_zero3"].losses[20] += 1.0  # the last-10 mean moves by 0.1 on 4.45: 2.2% > 2%
    runs["fsdp2"].losses[1] += 0.03
    assert [ok for _, ok, _ in check.loss_checks(runs, (0.02, 0.02), compared)] == [False, False]
    del runs["fsdp2"]
    assert check.loss_checks(runs, (0.02, 0.02), compared)[0] == ("fsdp2 losses agree with ddp", False,
                                                                   "the run did not finish")


ROUNDS = (1.0, 1.1, 0.9, 1.05, 0.95, 1.0)
"""A row's seconds per round, as a factor of its base (six rounds: the fewest with an interval)."""


def _bench_json(rows: dict[str, tuple[float, float | None, tuple[float, ...]]], setup: str = "134m, 32 x 2048",
                mfu: float | None = 0.4) -> str:
    """A bench_train_step --json with rows ``name: (seconds per step, step MiB, per-round factors)``, 10,000
    tokens a step, at ``mfu`` for its median tokens/s."""
    seconds = {name: [base * f for f in factors] for name, (base, _, factors) in rows.items()}
    return json.dumps({"setup": setup, "variants": {
        name: {"tokens_per_s": statistics.median(10_000 / s for s in seconds[name]), "mfu": mfu, "of_roofline": 0.5,
               "step_peak_mib": mib, "first_step_s": 9.0, "reference": next(iter(rows))}
        for name, (_, mib, _) in rows.items()},
        "seconds": seconds, "tokens": dict.fromkeys(rows, 10_000)})


def targets(module, stage: str, logs: Path) -> str:
    return "\n".join(f"| {what} | {value} | {met} |" for what, value, met in
                     next(s for s in module.STAGES if s.name == stage).targets(logs))


def test_targets_are_met_only_where_the_paired_interval_clears_them(tmp_path: Path) -> None:
    """A ratio whose interval straddles its target is "not resolved"; ratios are paired here from every
    round's seconds, each over the reference the stage table names, and MFU carries its per-round interval."""
    module = gpu_check()
    even = (1.0,) * 6
    (tmp_path / "step.json").write_text(_bench_json({
        "swiglu+softmax": (0.10, 900.0, ROUNDS),
        "isogmlp+softmax": (0.10 / 0.96, 950.0, ROUNDS),  # 0.96x in every round: [0.96, 0.96]
        "iso_ln+softmax": (0.10 / 0.96, 950.0, (1.0, 1.1 * 1.04, 0.9, 1.05, 0.95, 1.0)),  # one round 4% slower
        "iso_mlp+softmax": (0.10 / 0.9, 950.0, ROUNDS),
        "transformers Qwen3 + Liger FLCE": (0.13, 900.0, ROUNDS),
        "swiglu+softmax packed": (0.10 / 0.98, 900.0, (1.0, 1.1, 0.9, 1.05, 0.95 * 1.03, 1.0 * 0.98))}))
    (tmp_path / "long-0.json").write_text(_bench_json({"swiglu+softmax": (1.0, 3000.0, even),
                                                        "swiglu+iso_tanh": (1 / 1.4, 2000.0, even)},
                                                       setup="134m, 1 x 16384"))
    (tmp_path / "headline.json").write_text(_bench_json({"swiglu+softmax": (0.10, 900.0, ROUNDS),
                                                       "swiglu+softmax fp8-head": (0.10 / 1.2, 800.0, ROUNDS)}))
    (tmp_path / "batch-0.json").write_text(_bench_json({"swiglu+softmax": (0.10, 900.0, ROUNDS),
                                                         "swiglu+softmax batch 48": (0.10 / 1.1, 1300.0, ROUNDS)}))
    rows = "\n".join(targets(module, stage, tmp_path) for stage in ("step", "long", "headline", "batch"))
    at = "(134m, 32 x 2048)"
    # MFU per round: 40% at the median tokens/s, so 40% x median / round's seconds: [36.4%, 44.4%] over 6 rounds
    assert f"| swiglu+softmax MFU >= 40% of the datasheet {at} | 40.0% [36.4%, 44.4%] | not resolved |" in rows
    assert f"| swiglu+softmax fp8-head MFU >= 45% of the datasheet {at} | 40.0% [36.4%, 44.4%] | NOT met |" in rows
    assert f"| swiglu+softmax fp8-head over swiglu+softmax {at} | 1.200x [1.200, 1.200] | - |" in rows
    assert f"| isogmlp+softmax over swiglu+softmax >= 0.95x, lower end >= 0.93 {at} | 0.960x [0.960, 0.960] | met |" \
        in rows
    assert f"| iso_ln+softmax over swiglu+softmax >= 0.95x, lower end >= 0.93 {at} | 0.960x [0.923, 0.960] | " \
           "not resolved |" in rows
    assert f"| iso_mlp+softmax over swiglu+softmax >= 0.95x, lower end >= 0.93 {at} | 0.900x [0.900, 0.900] | " \
           "NOT met |" in rows
    assert f"| swiglu+softmax over transformers Qwen3 + Liger FLCE >= 1.2x {at} | 1.300x [1.300, 1.300] | met |" in rows
    assert "transformers Qwen3 (loss compiled)" not in rows  # a row the run lacks: left out
    assert f"| swiglu+softmax packed over swiglu+softmax >= 0.97x {at} | 0.980x [0.951, 1.000] | not resolved |" \
        in rows
    assert f"| swiglu+softmax batch 48 over swiglu+softmax {at} | 1.100x [1.100, 1.100] | - |" in rows
    assert "over swiglu+softmax batch" not in rows and "swiglu+softmax over swiglu+softmax" not in rows
    long = "swiglu+softmax (134m, 1 x 16384)"
    assert f"| swiglu+iso_tanh over {long.replace(' (', ' >= 1.0x (')} | 1.400x [1.400, 1.400] | met |" in rows
    assert "| swiglu+iso_tanh's step peak memory <= swiglu+softmax's (134m, 1 x 16384) | 2000 MiB vs 3000 MiB | " \
           "met |" in rows


def test_targets_read_the_form_choice_decoding_and_step_more_figures(tmp_path: Path) -> None:
    """The report's targets from the attention, generate and step_more stages' JSON: whether ``FLA_MIN_LENGTH``
    picks the faster iso_tanh form at each length (paired per round), iso_tanh's decoding against softmax's from
    16k, the extra steps."""
    module = gpu_check()

    def impl(ms: float, mib: float) -> dict:
        return {"ms": ms, "mib": mib, "seconds": [ms / 1e3 * f for f in ROUNDS]}

    form = {"sdpa": impl(4.0, 100.0), "chunked_compiled": impl(3.0, 90.0)}
    (tmp_path / "attention.json").write_text(json.dumps({
        "2048": {**form, "fla_compiled": impl(5.0, 80.0)}, "16384": {**form, "fla_compiled": impl(2.0, 120.0)}}))
    paired = {"median": 0.9, "low": 0.85, "high": 0.95, "rounds": 32}
    decode = {"softmax": {"static": {"tokens_per_s": 100.0}}, "iso_tanh": {"static": {"vs_softmax": paired}}}
    (tmp_path / "generate.json").write_text(json.dumps({"4096": decode, "16384": decode}))
    (tmp_path / "step_more-1.json").write_text(json.dumps({"setup": "250m, 8 x 2048", "variants": {
        "swiglu+softmax": {"of_roofline": 0.41, "first_step_s": 31.0}}}))
    rows = "\n".join(targets(module, stage, tmp_path) for stage in ("attention", "generate", "step_more"))
    from llm.model.attention import FLA_MIN_LENGTH

    picks = f"FLA_MIN_LENGTH={FLA_MIN_LENGTH} picks"
    assert f"| iso_tanh's form at T=2048: {picks} chunked_compiled, at least as fast as fla_compiled | 1.667x " \
           "[1.667, 1.667] | met |" in rows
    assert f"| iso_tanh's form at T=16384: {picks} fla_compiled, at least as fast as chunked_compiled | 1.500x " \
           "[1.500, 1.500] | met |" in rows
    assert "| iso_tanh (fla_compiled) faster than SDPA at T=16384 | 2.000x [2.000, 2.000] | met |" in rows
    assert "| iso_tanh (fla_compiled) memory <= SDPA's at T=16384 | 1.20x | NOT met |" in rows
    assert "| iso_tanh decodes >= softmax's tokens/s at context 16384 (static cache) | 0.900x [0.850, 0.950] " \
           "| NOT met |" in rows
    assert "context 4096" not in rows
    assert "| swiglu+softmax at 250m, 8 x 2048: MFU of the measured matmul rate, compile s | 41.0%, 31 s | - |" in rows
