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

from llm.sweep import REPO_ROOT, expand, load_sweep, main, slurm_array_script

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
    from llm.sweep import check_comparable

    sweep = load_sweep(sweep_file(), check=False)
    configs = check_comparable(sweep.runs, Path("sweep.yaml"))
    assert {c.data.seed for c in configs} == {7}
    assert {(c.model.num_hidden_layers, c.model.ffn, c.model.attn_scoring, c.seed) for c in configs} == {
        (n, f, a, s) for n in (2, 4) for f in ("swiglu", "isogmlp") for a in ("softmax", "iso_tanh")
        for s in (0, 1, 2)}


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


SHIPPED = sorted((REPO_ROOT / "launch" / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_sweeps_resolve(path: Path) -> None:
    sweep = load_sweep(path)
    assert len({run.name for run in sweep.runs}) == len(sweep.runs) > 1


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
                   "run_name": "{f}{k.x}"}, tmp_path / "s.yaml")
    assert [r.name for r in runs] == ["A1", "A2", "B1", "B2"]
    assert json.dumps(runs[0].axes) == '{"f": "A", "k.x": "1"}'
