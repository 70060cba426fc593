"""The sweep launcher: grid expansion, run names, fairness checks, and the three modes (print / local /
slurm, whose array script is executed here with a stand-in train.sbatch to read back each task's args)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny import REPO

from llm.cli.sweep import main, slurm_array_script
from llm.cli.sweep_spec import expand, load_sweep

TINY = {"model": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 2, "num_key_value_heads": 1},
        "data": {"source": "corpus/", "seq_len": 32}, "train": {"max_steps": 10, "global_batch_tokens": 256}}


def write(path: Path, content: dict) -> Path:
    path.write_text(yaml.safe_dump(content, sort_keys=False))
    return path


@pytest.fixture
def sweep_file(tmp_path: Path):
    """``sweep_file(**changes)``: a 2 sizes x 2 ffn x 2 attn x 3 seeds sweep over tmp config files."""
    base = write(tmp_path / "base.yaml", TINY)
    small = write(tmp_path / "small.yaml", {"model": {"num_hidden_layers": 2}})
    big = write(tmp_path / "big.yaml", {"model": {"num_hidden_layers": 4}})

    def make(**changes: object) -> Path:
        spec = {
            "name": "cmp",
            "configs": [str(base)],
            "files": {"size": {"s": str(small), "b": str(big)}},
            "grid": {"model.ffn": ["swiglu", "isogmlp"], "model.attn_scoring": ["softmax", "iso_tanh"],
                     "seed": [0, 1, 2]},
            "overrides": {"data.seed": 7, "train.lr": 1e-3},
            "run_name": "{size}-{model.ffn}-{model.attn_scoring}-s{seed}",
            **changes,
        }
        return write(tmp_path / "sweep.yaml", {k: v for k, v in spec.items() if v is not None})

    return make


def test_grid_expands_to_the_product_with_unique_names(sweep_file) -> None:
    sweep = load_sweep(sweep_file())
    assert len(sweep.runs) == 2 * 2 * 2 * 3
    names = [run.name for run in sweep.runs]
    assert names[:4] == ["s-swiglu-softmax-s0", "s-swiglu-softmax-s1", "s-swiglu-softmax-s2",
                         "s-swiglu-iso_tanh-s0"]
    assert names[-1] == "b-isogmlp-iso_tanh-s2" and len(set(names)) == len(names)
    run = sweep.runs[-1]
    assert run.configs[-1].endswith("big.yaml")  # the size file is merged after the base files
    assert run.overrides == ["data.seed=7", "train.lr=0.001", "model.ffn=isogmlp",
                             "model.attn_scoring=iso_tanh", "seed=2"]
    assert run.train_args()[-1] == "name=b-isogmlp-iso_tanh-s2"


def test_every_run_resolves_with_the_same_data_and_its_own_variant(sweep_file) -> None:
    from llm.cli.sweep_spec import check_comparable

    sweep = load_sweep(sweep_file(), check=False)
    configs = check_comparable(sweep.runs, Path("sweep.yaml"), sweep.root)
    assert {c.data.seed for c in configs} == {7}
    assert {(c.model.num_hidden_layers, c.model.ffn, c.model.attn_scoring, c.seed) for c in configs} == {
        (n, f, a, s) for n in (2, 4) for f in ("swiglu", "isogmlp") for a in ("softmax", "iso_tanh")
        for s in (0, 1, 2)}


def test_document_masking_is_the_one_data_axis(sweep_file) -> None:
    """Masked and unmasked runs score the same windows: a sweep may compare them."""
    from llm.cli.sweep_spec import check_comparable

    grid = {"model.ffn": ["swiglu", "isogmlp"], "data.document_masking": [True, False], "seed": [0]}
    sweep = load_sweep(sweep_file(files=None, grid=grid, run_name="{model.ffn}-mask{data.document_masking}"),
                       check=False)
    configs = check_comparable(sweep.runs, Path("sweep.yaml"), sweep.root)
    assert [(c.model.ffn, c.data.document_masking) for c in configs] == [
        ("swiglu", True), ("swiglu", False), ("isogmlp", True), ("isogmlp", False)]


@pytest.mark.parametrize(("changes", "message"), [
    ({"grid": {"data.seed": [0, 1]}}, "grid.data.seed: runs of a comparison must share the data order"),
    ({"run_name": "{model.ffn}-s{seed}"}, "run_name: '{model.ffn}-s{seed}' gives several runs the same name"),
    ({"run_name": "{ffn}"}, "run_name: placeholder {ffn} is not an axis"),
    ({"grid": {"model.ffn": []}}, "grid.model.ffn: expected a non-empty list"),
    ({"grid": {"model.ffn": ["swiglu", "nope"]}, "run_name": "{size}-{model.ffn}"},
     "run s-nope: model.ffn: unknown value 'nope'"),
    ({"overrides": {"train.lrr": 1}}, "train.lrr"),
    ({"configs": ["no/such.yaml"]}, "configs: no such config file"),
    ({"slurm": {"gpus": 8}}, "slurm.gpus: unknown key"),
    ({"launcher": "x"}, "launcher: unknown key"),
])
def test_bad_sweeps_fail_with_one_line_naming_the_key(sweep_file, changes: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        load_sweep(sweep_file(**changes))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_runs_that_would_see_different_data_are_refused(sweep_file, tmp_path: Path) -> None:
    """A size file that changes seq_len changes the validation tokens: not a fair comparison."""
    write(tmp_path / "big.yaml", {"model": {"num_hidden_layers": 4}, "data": {"seq_len": 64}})
    with pytest.raises(ValueError, match=r"differ in data\.seq_len: every run"):
        load_sweep(sweep_file())
    write(tmp_path / "big.yaml", {"train": {"max_steps": 20}})
    with pytest.raises(ValueError, match=r"differ in train\.max_steps \(10 vs 20\)"):
        load_sweep(sweep_file())


def test_expand_without_template_names_runs_by_all_axes(sweep_file) -> None:
    sweep = load_sweep(sweep_file(run_name=None, files=None))
    assert sweep.runs[0].name == "swiglu-softmax-0"


SHIPPED = sorted((REPO / "launch" / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_sweeps_resolve(path: Path) -> None:
    sweep = load_sweep(path)
    assert len({run.name for run in sweep.runs}) == len(sweep.runs) > 1
    # local runs use `command`, Slurm tasks slurm.accelerate_config: the one config, named once
    if "--config_file" in sweep.command:
        assert sweep.command[sweep.command.index("--config_file") + 1] == sweep.slurm["accelerate_config"]


def test_print_and_local_modes(sweep_file, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "ran"
    marker.mkdir()
    # A stand-in for train.py: records the run name it was given.
    record = f"import sys, pathlib; pathlib.Path({str(marker)!r}, sys.argv[-1][5:]).touch()"
    path = sweep_file(command=shlex.join([sys.executable, "-c", record]),
                      grid={"model.ffn": ["swiglu", "isogmlp"]}, files=None, run_name="r-{model.ffn}")
    assert main([str(path), "--mode", "print"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [shlex.split(line)[-1] for line in lines] == ["name=r-swiglu", "name=r-isogmlp"]
    assert main([str(path), "--mode", "local", "--dry-run"]) == 0
    assert not any(marker.iterdir())
    assert main([str(path), "--mode", "local"]) == 0
    assert sorted(p.name for p in marker.iterdir()) == ["r-isogmlp", "r-swiglu"]


def test_slurm_array_script_gives_each_task_its_run(sweep_file, tmp_path: Path) -> None:
    sweep = load_sweep(sweep_file(slurm={"nodes": 4, "max_parallel": 5, "partition": "gpu"}))
    out_dir = str(tmp_path / "out")
    assert main([str(sweep.source), "--mode", "slurm", "--dry-run", "--script-dir", out_dir]) == 0
    script = (tmp_path / "out" / "cmp.sbatch").read_text()
    assert script == slurm_array_script(sweep)
    for directive in ("--array=0-23%5", "--nodes=4", "--ntasks-per-node=1", "--partition=gpu", "--requeue",
                      "--signal=B:USR1@600"):
        assert f"#SBATCH {directive}\n" in script
    # Execute the array script for two tasks with a stand-in train.sbatch that echoes its arguments.
    fake = tmp_path / "submit"
    (fake / "launch" / "slurm").mkdir(parents=True)
    (fake / "launch" / "slurm" / "train.sbatch").write_text(
        'printf "%s\\n" "$ACCELERATE_CONFIG" "$GPUS_PER_NODE" "$@"\n')
    for task in (0, 23):
        out = subprocess.run(["bash", str(tmp_path / "out" / "cmp.sbatch")], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(fake),
                                  "SLURM_ARRAY_TASK_ID": str(task)}, timeout=30, check=True).stdout
        accelerate_config, gpus, *args = out.splitlines()
        assert (accelerate_config, gpus) == ("launch/accelerate/ddp.yaml", "8")
        assert args == sweep.runs[task].train_args()
    missing = subprocess.run(["bash", str(tmp_path / "out" / "cmp.sbatch")], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(fake),
                                  "SLURM_ARRAY_TASK_ID": "24"}, timeout=30)
    assert missing.returncode == 2 and "no run for array task 24" in missing.stderr


def test_expand_order_is_files_then_grid_in_file_order(tmp_path: Path) -> None:
    a, b = write(tmp_path / "a.yaml", {}), write(tmp_path / "b.yaml", {})
    runs = expand({"name": "x", "files": {"f": {"A": str(a), "B": str(b)}}, "grid": {"k.x": [1, 2]},
                   "run_name": "{f}{k.x}"}, tmp_path / "s.yaml", REPO)
    assert [r.name for r in runs] == ["A1", "A2", "B1", "B2"]
    assert json.dumps(runs[0].axes) == '{"f": "A", "k.x": "1"}'


# A stand-in for train.py: `fake_train.py LOG NEED train-args...` appends its run name to LOG/started,
# waits (up to 20 s) until NEED runs have started, records how many were running when it began, and
# appends its name to LOG/done. A run that never sees NEED started exits 1.
FAKE_TRAIN = """
import fcntl, sys, time
from pathlib import Path

log, need, name = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[-1].removeprefix("name=")

def lines(file):
    return (log / file).read_text().split() if (log / file).exists() else []

def append(file, text):
    with open(log / file, "a") as out:
        fcntl.flock(out, fcntl.LOCK_EX)
        out.write(text + "\\n")

def wait_for(file):  # until `need` runs have written to it
    while len(lines(file)) < need:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.01)

append("started", name)
print(f"fake run {name}", flush=True)
sys.stderr.write(f"progress {name} 1\\rprogress {name} 2\\r\\n")
sys.stderr.flush()
deadline = time.monotonic() + 20
wait_for("started")
append("ready", name)
wait_for("ready")  # a barrier: the count below sees every run that overlaps, none of them done yet
append("running", f"{name}={len(lines('started')) - len(lines('done'))}")
append("done", name)
"""


@pytest.fixture
def fake_sweep(sweep_file, tmp_path: Path):
    """``fake_sweep(need)``: a 4-run sweep (r-<ffn>-s<seed>) whose command is FAKE_TRAIN logging to tmp."""
    script, log = tmp_path / "fake_train.py", tmp_path / "log"
    script.write_text(FAKE_TRAIN)
    log.mkdir()

    def make(need: int) -> tuple[Path, Path]:
        command = shlex.join([sys.executable, str(script), str(log), str(need)])
        return sweep_file(command=command, files=None, grid={"model.ffn": ["swiglu", "isogmlp"], "seed": [0, 1]},
                          run_name="r-{model.ffn}-s{seed}"), log

    return make


def test_jobs_runs_at_most_n_at_once(fake_sweep, capfd: pytest.CaptureFixture[str]) -> None:
    # the first two runs wait for each other: they finish only if two run at once
    path, log = fake_sweep(need=2)
    assert main([str(path), "--mode", "local", "-j", "2"]) == 0
    assert sorted((log / "done").read_text().split()) == ["r-isogmlp-s0", "r-isogmlp-s1", "r-swiglu-s0",
                                                          "r-swiglu-s1"]
    running = dict(line.split("=") for line in (log / "running").read_text().split())
    assert max(int(n) for n in running.values()) == 2
    lines = capfd.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in lines if line.startswith("[") and "/4]" in line.split()[0]) == [
        "[1/4]", "[2/4]", "[3/4]", "[4/4]"]  # whole lines, whatever order the threads printed them in
    for name in ("r-swiglu-s0", "r-swiglu-s1", "r-isogmlp-s0", "r-isogmlp-s1"):
        # stdout and stderr alike, progress redraws (\r) included, each line prefixed with its run's name
        own = [line for line in lines if line.startswith(f"[{name}] ")]
        assert sorted(own) == sorted(f"[{name}] {text} {name}{end}" for text, end in
                                     (("fake run", ""), ("progress", " 1"), ("progress", " 2")))
    assert len(lines) == 4 + 4 * 3  # nothing unprefixed


def test_jobs_default_is_one_run_after_another(fake_sweep) -> None:
    path, log = fake_sweep(need=1)
    assert main([str(path), "--mode", "local"]) == 0
    assert (log / "started").read_text().split() == ["r-swiglu-s0", "r-swiglu-s1", "r-isogmlp-s0",
                                                      "r-isogmlp-s1"]
    assert (log / "running").read_text().split() == ["r-swiglu-s0=1", "r-swiglu-s1=1", "r-isogmlp-s0=1",
                                                      "r-isogmlp-s1=1"]


def test_jobs_must_be_positive_and_local(fake_sweep, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = fake_sweep(need=1)
    for argv, message in ((["--mode", "local", "-j", "0"], "argument -j/--jobs: expected a value >= 1, got 0"),
                          (["--mode", "print", "-j", "2"], "--jobs applies to --mode local only")):
        with pytest.raises(SystemExit) as exit_info:
            main([str(path), *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_jobs_refuse_a_multi_process_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    """Two `accelerate launch` runs side by side would each take every GPU and the same port."""
    sweep = REPO / "launch" / "sweeps" / "ffn_attn.yaml"
    assert main([str(sweep), "--mode", "local", "--dry-run", "-j", "2"]) == 2
    assert "is a multi-process launcher; -j runs single-process commands" in capsys.readouterr().err
    assert main([str(sweep), "--mode", "local", "--dry-run", "-j", "1"]) == 0


def test_only_runs_the_named_runs_in_grid_order(fake_sweep, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path, log = fake_sweep(need=1)
    only = ["--only", "r-isogmlp-s1", "r-swiglu-s0"]
    assert main([str(path), "--mode", "print", *only]) == 0
    assert [shlex.split(line)[-1] for line in capsys.readouterr().out.splitlines()] == [
        "name=r-swiglu-s0", "name=r-isogmlp-s1"]
    assert main([str(path), "--mode", "local", *only]) == 0
    assert (log / "started").read_text().split() == ["r-swiglu-s0", "r-isogmlp-s1"]
    assert main([str(path), "--mode", "slurm", "--dry-run", "--script-dir", str(tmp_path / "out"), *only]) == 0
    script = (tmp_path / "out" / "cmp.sbatch").read_text()
    assert "#SBATCH --array=0-1\n" in script and "# r-isogmlp-s1\n" in script and "r-swiglu-s1" not in script


def test_only_with_an_unknown_name_lists_the_valid_ones(fake_sweep, capsys: pytest.CaptureFixture[str]) -> None:
    path, log = fake_sweep(need=1)
    assert main([str(path), "--mode", "local", "--only", "r-swiglu-s0", "r-nope"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --only: no run named r-nope in {path}; valid names: r-swiglu-s0, r-swiglu-s1, "
                   "r-isogmlp-s0, r-isogmlp-s1\n")
    assert not (log / "started").exists()


def test_runs_start_in_the_checkout_the_sweep_is_invoked_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    """Another clone's sweep reads its own configs and runs there: from inside it (any subfolder), with --root
    from anywhere, and launch/sweep.py always in its own checkout; outside any checkout without --root: an error."""
    clone = tmp_path / "clone"
    (clone / "llm").mkdir(parents=True)
    (clone / "configs").mkdir()
    (clone / "llm" / "__init__.py").write_text("")
    (clone / "train.py").write_text("")
    write(clone / "configs" / "base.yaml", TINY)
    command = shlex.join([sys.executable, "-c", "import os; print(os.getcwd())"])
    sweep = write(tmp_path / "sweep.yaml", {"name": "cwd", "configs": ["configs/base.yaml"], "grid": {"seed": [0, 1]},
                                            "run_name": "s{seed}", "command": command})

    def ran_in() -> set[str]:
        return {line for line in capfd.readouterr().out.splitlines() if not line.startswith("[1/2]")
                and not line.startswith("[2/2]")}

    monkeypatch.chdir(clone / "llm")
    assert main([str(sweep), "--mode", "local", "-j", "2"]) == 0
    assert ran_in() == {f"[s0] {clone.resolve()}", f"[s1] {clone.resolve()}"}
    monkeypatch.chdir(tmp_path)
    assert main([str(sweep), "--mode", "local", "-j", "2"]) == 2
    assert "is not inside an isollm checkout" in capfd.readouterr().err
    assert main([str(sweep), "--mode", "local", "-j", "2", "--root", str(clone)]) == 0
    assert ran_in() == {f"[s0] {clone.resolve()}", f"[s1] {clone.resolve()}"}
    assert load_sweep(sweep, root=clone).root == clone.resolve()
    with pytest.raises(ValueError, match=r"no such config file: .*configs/base.yaml"):
        load_sweep(sweep, root=REPO)  # the clone's config is not in this checkout
    with pytest.raises(FileNotFoundError, match="is not inside an isollm checkout"):
        load_sweep(sweep, root=tmp_path)  # a --root that is no checkout is refused at once

    shipped = REPO / "launch" / "sweeps" / "ffn_attn.yaml"
    done = subprocess.run([sys.executable, str(REPO / "launch" / "sweep.py"), str(shipped), "--mode", "print"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("name=") == len(load_sweep(shipped, check=False, root=REPO).runs)


def test_the_runs_start_with_the_sweeps_own_interpreter(sweep_file, tmp_path: Path) -> None:
    """``.venv/bin/python launch/sweep.py`` trains with that environment without an activated venv: locally
    ``python`` is this interpreter, and a Slurm task finds its ``python`` and ``accelerate`` first on PATH."""
    sweep = load_sweep(sweep_file(command="python train.py"))
    assert sweep.commands()[0][:2] == [sys.executable, "train.py"]
    fake = tmp_path / "submit"
    (fake / "launch" / "slurm").mkdir(parents=True)
    (fake / "launch" / "slurm" / "train.sbatch").write_text("command -v python\n")
    (tmp_path / "array.sbatch").write_text(slurm_array_script(sweep))
    found = subprocess.run(["bash", str(tmp_path / "array.sbatch")], capture_output=True, text=True, check=True,
                           env={"PATH": "/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(fake), "SLURM_ARRAY_TASK_ID": "0"},
                           timeout=30).stdout.strip()
    assert Path(found).parent == Path(sys.executable).parent


def test_a_finished_sweep_run_again_starts_nothing(sweep_file, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose directory holds its last step's checkpoint (10 steps here) is complete: not started again; one
    without it (step 5 only) is."""
    started = tmp_path / "started"
    record = f"import sys, pathlib; pathlib.Path({str(started)!r}).write_text(sys.argv[-1])"
    path = sweep_file(command=shlex.join([sys.executable, "-c", record]), grid={"model.ffn": ["swiglu", "isogmlp"]},
                      files=None, run_name="r-{model.ffn}", overrides={"out_dir": str(tmp_path / "runs")})
    for name, step in (("r-swiglu", 10), ("r-isogmlp", 5)):
        (tmp_path / "runs" / name / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
    assert main([str(path), "--mode", "local"]) == 0
    assert started.read_text() == "name=r-isogmlp"
    assert "r-swiglu: complete" in capsys.readouterr().out
    (tmp_path / "runs" / "r-isogmlp" / "checkpoints" / "step_00000010").mkdir()
    started.unlink()
    for mode in ("local", "slurm"):
        assert main([str(path), "--mode", mode, "--script-dir", str(tmp_path)]) == 0
        assert "r-isogmlp: complete" in (out := capsys.readouterr().out) and "nothing to start" in out
    assert not started.exists() and not (tmp_path / "cmp.sbatch").exists()
