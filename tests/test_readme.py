"""Every command of the fenced shell blocks of README.md and of the reference pages in docs/ (``docs/*.md``, in name
order after the README) runs as written on a fresh copy of the checkout beside the shipped FineWeb sample
(``../shared/data/fineweb-sample``), the ones after the README's ``ACTIVATE`` line (every docs page's) in the
activated ``.venv`` (as a reader's shell runs them) and nothing from the test's own environment on PATH.

The commands are read from the pages themselves, so this test follows them as they change: a new command runs here,
or is listed in ``EXCLUDED`` with the reason it cannot (a GPU, a cluster, the network or the hub). ``.venv`` stands
for the one ``make demo`` installs: a virtual environment reading this interpreter's packages, with the project's
console scripts. Runs are shortened only where they train: every ``train.py`` that the ``.venv``'s python starts
(typed, in a loop, or launched by a sweep) gets ``SHORTEN`` appended at its start, and the sweeps' grids are cut to
``SWEEP_GRID`` in the copy. The model shrinks but the data settings stay as written (the validation set is the
configs' own), so a config that asks for more validation tokens than the sample holds fails here. The runs share one
copy, so a command reads what the ones before it wrote (the tokenizer, runs/). The links between the pages are
checked in tests/test_docs.py.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import time
import venv
from pathlib import Path

import pytest
import tomllib
import yaml
from tiny import fineweb_files

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(page.relative_to(REPO)) for page in (REPO / "docs").glob("*.md"))]
"""The pages whose commands run, in this order: the README, then the reference pages (not docs/results/, whose
commands reproduce hours of training)."""
ACTIVATE = "source .venv/bin/activate"
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.MULTILINE | re.DOTALL)

EXCLUDED = {  # a command's start -> why it does not run here
    "make demo": "installs .venv from PyPI (network); scripts/demo.py's console: tests/launch/test_demo.py",
    "make test": "the whole suite, this test included",
    "scripts/slurm_local.sh": "brings up or tears down the 2-node Slurm that the suite's slurm tests run on "
    "(make test does, as root)",
    "export SLURM_CONF": "the Slurm cluster's config, for the slurm tests",
    ".venv/bin/python -m pytest": "the slurm tests, which make test runs",
    "mkdir -p logs && export ACCELERATE_USE_CPU=1": "what tests/slurm submits to the cluster (Slurm commands below)",
    "sbatch": "submits to a Slurm cluster: tests/slurm",
    "scancel": "signals a Slurm job: tests/slurm",
    "scontrol": "a Slurm job's pids: tests/slurm",
    "python launch/sweep.py SWEEP.yaml --mode slurm": "a job array on a Slurm cluster: tests/slurm",
    "python eval.py compare 'runs/sw-*'": "the table of that job array's runs: tests/slurm",
    "python train.py --config configs/experiments/fineweb-83m.yaml": "streams FineWeb and the Qwen3 tokenizer from "
    "the hub (network), and trains 83m parameters (GPU)",
    "python train.py name=83m-swiglu-s0 resume=true": "continues the FineWeb run above (GPU); resume by name: "
    "tests/train/test_cli.py",
    "launch/torchrun.sh 8": "8 GPUs; 2 CPU processes through the same launchers: tests/launch",
    "mkdir -p logs && sbatch": "submits to a Slurm cluster: tests/slurm",
    "isollm-data plan HuggingFaceFW/fineweb": "reads FineWeb's file list from the hub (network); plan on the local "
    "sample: docs/data.md's command",
    "python eval.py some-user/some-isollm-model": "a hub model (network)",
    "python eval.py lm-eval": "hellaswag's data set comes from the hub (network); lm-eval: tests/eval/test_lm_eval.py",
    "huggingface-cli login": "a hub account",
    "isollm-hub push": "uploads to the hub (isollm-hub push with the upload replaced: tests/hf/test_push.py)",
}

SHORTEN = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
    "model.num_key_value_heads=1", "model.head_dim=16", "train.max_steps=2", "train.max_tokens=0",
    "train.warmup_steps=1", "train.global_batch_tokens=4096", "train.log_every=1", "train.eval_every=2",
    "train.checkpoint_every=2", "train.isotropy_samples=256", "trackers=[]",
]
"""Appended to every ``python train.py``: a 2-layer width-32 model for 2 steps, data settings untouched."""

SWEEP_GRID = {"launch/sweeps/lr-tune-cpu.yaml": {"model.ffn": ["isogmlp"], "train.lr": [1e-3, 2e-3]},
              "launch/sweeps/cpu_sample.yaml": {"model.ffn": ["swiglu", "isogmlp"]}}
"""The sweeps the pages launch, cut to these grid values (20 runs would take minutes even shortened)."""


def readme_commands(text: str) -> list[str]:
    """The command lines of the fenced shell blocks, continuation lines joined, comment lines dropped."""
    lines = [line.strip() for block in SHELL_BLOCK.findall(text) for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def page_commands() -> list[str]:
    """Every page's commands, in ``PAGES`` order."""
    return [command for page in PAGES for command in readme_commands((REPO / page).read_text())]


def excluded(command: str) -> str | None:
    return next((why for start, why in EXCLUDED.items() if command.startswith(start)), None)


def test_the_readme_commands_are_found_and_every_exclusion_names_one() -> None:
    readme = readme_commands((REPO / "README.md").read_text())
    assert ACTIVATE in readme, "the README no longer says to activate .venv"
    # every command that needs the project's environment comes after the README activates it
    assert not [c for c in readme[: readme.index(ACTIVATE)] if excluded(c) is None]
    assert any(command.startswith("python train.py --config configs/experiments/small-cpu") for command in readme)
    commands = page_commands()
    assert len(commands) > len(readme), "no docs page has a command"
    assert any(c.startswith("isollm-data verify data_cache/prepared") for c in commands)  # docs/data.md's
    stale = [start for start in EXCLUDED if not any(command.startswith(start) for command in commands)]
    assert not stale, f"EXCLUDED names commands no page has: {stale}"


def fresh_copy(root: Path) -> Path:
    """The checkout's files as a clone has them (tracked and new, not ignored: no runs/, data_cache/, .venv), with
    ``../shared`` beside it; ``SWEEP_GRID`` applied."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    clone = root / "isollm"
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    (root / "shared").symlink_to(REPO.parent / "shared")
    for sweep, grid in SWEEP_GRID.items():
        spec = yaml.safe_load((clone / sweep).read_text())
        spec["grid"].update(grid)
        (clone / sweep).write_text(yaml.safe_dump(spec))
    return clone


def demo_venv(clone: Path) -> None:
    """``clone/.venv`` as ``make demo`` leaves it, from this interpreter's packages: its python appends ``SHORTEN`` to
    ``train.py``'s arguments, and ``bin/`` holds pyproject.toml's console scripts."""
    venv.create(clone / ".venv", symlinks=True)
    packages = next((clone / ".venv" / "lib").glob("python*/site-packages"))
    # site reads a venv's .pth files twice; the module they import runs once
    (packages / "readme_test.py").write_text(
        f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n"
        f"import sys; sys.argv[0].endswith('train.py') and sys.argv.extend({SHORTEN!r})\n")
    (packages / "readme_test.pth").write_text("import readme_test\n")
    scripts = tomllib.loads((clone / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, function = target.split(":")
        script = clone / ".venv" / "bin" / name
        script.write_text(f"#!{clone / '.venv' / 'bin' / 'python'}\nimport sys\nfrom {module} import {function}\n"
                          f"sys.exit({function}())\n")
        script.chmod(0o755)


@pytest.mark.slow
def test_every_readme_and_docs_command_runs_as_written(tmp_path: Path) -> None:
    fineweb_files()  # skips without the shared sample
    commands = [c for c in page_commands() if excluded(c) is None]
    clone = fresh_copy(tmp_path)
    demo_venv(clone)
    env = {**os.environ, "PYTHONPATH": str(clone), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg", "PATH": "/usr/bin:/bin"}
    activated = False
    for command in commands:
        activated = activated or command == ACTIVATE
        started = time.perf_counter()
        done = subprocess.run(["bash", "-c", f"{ACTIVATE} && {command}" if activated else command], cwd=clone,
                              env=env, capture_output=True, text=True)
        print(f"{time.perf_counter() - started:6.1f} s  {command}")
        assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert (clone / "runs" / "cpu-comparison" / "comparison.md").is_file()
    assert (clone / "runs" / "cpu-comparison" / "plan.csv").is_file()  # the README's comparison plans its seeds
