"""Sweep files: a grid of config overrides expanded into named runs, each config resolved and checked for a fair
comparison (``llm.cli.sweep`` prints, runs or submits them).

A sweep file (``launch/sweeps/*.yaml``)::

    name: ffn-attn                      # slurm job name and array-script file name
    configs: [configs/sizes/tiny.yaml]  # base config files of every run (relative to the checkout root)
    files:                              # optional axes over config files: axis -> {label: file}
      size: {tiny: configs/sizes/tiny.yaml, 83m: configs/sizes/83m.yaml}
    grid:                               # axes over dotted config keys: key -> list of values
      model.ffn: [swiglu, isogmlp]
      seed: [0, 1, 2]
    overrides: {train.max_tokens: 1000000}    # fixed for every run
    run_name: "{size}-{model.ffn}-s{seed}"    # placeholders: the axes
    command: python train.py                  # what --mode local runs for one config
    slurm: {nodes: 1, gpus_per_node: 8, time: "24:00:00", accelerate_config: launch/accelerate/ddp.yaml}

Slurm array tasks ignore ``command``: they run launch/slurm/train.sbatch with ``slurm.accelerate_config``.
A local ``accelerate launch`` command names the same config through an interpolation,
``--config_file ${slurm.accelerate_config}``, so the file is named once.

The runs are the cartesian product of all axes (``files`` first, then ``grid``, in file order). Every
run's config is resolved with ``load_config`` before anything starts, so a typo fails the whole sweep
at once, and the runs must agree on everything that makes a comparison fair (same data
order, same validation tokens, same token budget): the whole ``data`` section and the fields in
``COMPARISON_INVARIANTS``. A ``data.*`` grid axis is therefore refused, except ``DATA_AXES`` (how the same
windows are scored: ``data.document_masking``).

Runs start in the checkout the sweep is invoked from (``--root``, else the checkout of launch/sweep.py when run
through it, else the one holding the current directory), never in the installed ``llm`` package's location: with
one environment shared by two clones, each clone's sweeps train its own code and write its own runs/.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field, replace
from operator import attrgetter
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from llm.config import RunConfig, load_config

COMPARISON_INVARIANTS = ("train.global_batch_tokens", "train.max_tokens", "train.max_steps")
"""Run-config fields (besides the whole ``data`` section) that every run of a sweep must share."""
DATA_AXES = ("data.document_masking",)
"""``data`` fields a sweep may vary: they change how the same windows are scored, not which windows."""
SWEEP_KEYS = ("name", "configs", "files", "grid", "overrides", "run_name", "command", "slurm")
SLURM_DEFAULTS: dict[str, Any] = {"nodes": 1, "gpus_per_node": 8, "cpus_per_task": 64, "time": "24:00:00",
                                  "partition": None, "max_parallel": 0,
                                  "accelerate_config": "launch/accelerate/ddp.yaml"}
"""``slurm:`` keys; ``max_parallel`` 0 means no limit on array tasks running at once."""
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.]*)\}")


@dataclass
class Run:
    """One point of the grid: its name, the config files it merges and the overrides on top."""

    name: str
    configs: list[str]
    overrides: list[str]
    axes: dict[str, str] = field(default_factory=dict)
    """Axis -> the value (or file label) this run takes, as it appears in the name."""
    config: RunConfig | None = None
    """Its resolved config (``check_comparable``)."""

    def train_args(self) -> list[str]:
        """Arguments of train.py: ``--config FILE ... key=value ... name=<run name>``."""
        files = [arg for path in self.configs for arg in ("--config", path)]
        return [*files, *self.overrides, f"name={self.name}"]


@dataclass
class Sweep:
    name: str
    runs: list[Run]
    command: list[str]
    slurm: dict[str, Any]
    source: Path
    root: Path
    """The checkout the runs start in (config paths are relative to it)."""

    def commands(self) -> list[list[str]]:
        return [[*self.command, *run.train_args()] for run in self.runs]

    def only(self, names: list[str]) -> Sweep:
        """This sweep cut to the runs named (grid order kept); ``ValueError`` listing the valid names."""
        valid = [run.name for run in self.runs]
        if unknown := [name for name in names if name not in valid]:
            raise ValueError(f"--only: no run named {', '.join(unknown)} in {self.source}; "
                             f"valid names: {', '.join(valid)}")
        return replace(self, runs=[run for run in self.runs if run.name in names])


def find_checkout(start: Path) -> Path:
    """The isollm checkout holding ``start``: the nearest directory up with train.py and llm/__init__.py."""
    start = start.resolve()
    for directory in (start, *start.parents):
        if (directory / "train.py").is_file() and (directory / "llm" / "__init__.py").is_file():
            return directory
    raise FileNotFoundError(f"{start} is not inside an isollm checkout (a directory with train.py and llm/); "
                            "run from one or pass --root")


def with_own_interpreter(command: list[str]) -> list[str]:
    """``command`` started from the environment of the interpreter running the sweep, whatever is on PATH:
    ``python`` is this interpreter, and a console script (``accelerate``, ``torchrun``) the one installed beside it,
    so ``.venv/bin/python launch/sweep.py`` trains with ``.venv`` without activating it."""
    program, *args = command
    if program in ("python", "python3"):
        return [sys.executable, *args]
    beside = Path(sys.executable).parent / program
    return [str(beside) if "/" not in program and beside.is_file() else program, *args]


def format_value(value: Any) -> str:
    """A YAML scalar as an OmegaConf dotlist value (``true``, ``null``, ``[1, 2]``; a float as Python writes it:
    ``3e-4`` in the file is ``0.0003``, in overrides and in a ``{train.lr}`` run name alike)."""
    return str(value) if isinstance(value, str | float) else json.dumps(value, separators=(",", ":"))


def _fail(path: Path, key: str, message: str) -> ValueError:
    return ValueError(f"{path}: {key}: {message}")


def _resolve_file(path: Path, key: str, file: str, root: Path) -> str:
    """Config paths are relative to the checkout root (as in train.py's --config); check they exist."""
    resolved = Path(file) if Path(file).is_absolute() else root / file
    if not resolved.is_file():
        raise _fail(path, key, f"no such config file: {resolved}")
    return file


def _render_name(path: Path, template: str, axes: dict[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        if match.group(1) not in axes:
            raise _fail(path, "run_name", f"placeholder {{{match.group(1)}}} is not an axis "
                        f"(axes: {', '.join(axes) or 'none'})")
        return axes[match.group(1)]

    return PLACEHOLDER.sub(substitute, template)


def expand(spec: dict[str, Any], path: Path, root: Path) -> list[Run]:
    """The cartesian product of the ``files`` and ``grid`` axes as named runs (names checked unique); config
    files are relative to the checkout ``root``."""
    configs = [_resolve_file(path, "configs", f, root) for f in spec.get("configs") or []]
    files: dict[str, dict[str, str]] = spec.get("files") or {}
    grid: dict[str, list[Any]] = spec.get("grid") or {}
    overrides = [f"{key}={format_value(value)}" for key, value in (spec.get("overrides") or {}).items()]
    for axis, choices in files.items():
        if not isinstance(choices, dict) or not choices:
            raise _fail(path, f"files.{axis}", "expected a non-empty mapping label -> config file")
        for label, file in choices.items():
            _resolve_file(path, f"files.{axis}.{label}", file, root)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise _fail(path, f"grid.{key}", "expected a non-empty list of values")
        if key == "name" or (key.startswith("data.") and key not in DATA_AXES) or key == "data":
            raise _fail(path, f"grid.{key}", "runs of a comparison must share the data order and "
                        "validation tokens (and are named by run_name); put it under overrides instead")
    if set(files) & set(grid):
        raise _fail(path, "files", f"axes {sorted(set(files) & set(grid))} are also grid keys")

    labels = {axis: list(choices) for axis, choices in files.items()}
    labels.update({key: [format_value(v) for v in values] for key, values in grid.items()})
    template = spec.get("run_name") or "-".join(f"{{{a}}}" for a in labels) or str(spec["name"])
    runs: list[Run] = []
    for point in itertools.product(*labels.values()):
        axes = dict(zip(labels, point, strict=True))
        runs.append(Run(_render_name(path, template, axes), [*configs, *(files[a][axes[a]] for a in files)],
                        [*overrides, *(f"{key}={axes[key]}" for key in grid)], axes))
    names = [run.name for run in runs]
    if duplicates := sorted({n for n in names if names.count(n) > 1}):
        raise _fail(path, "run_name", f"{template!r} gives several runs the same name ({duplicates[0]!r}); "
                    "include every axis with more than one value")
    return runs


def check_comparable(runs: list[Run], path: Path, root: Path) -> list[RunConfig]:
    """Resolve every run's config (fails on any bad key or value) and check they form a fair comparison."""
    resolved: list[RunConfig] = []
    for run in runs:
        try:
            files = [str(root / f) for f in run.configs]
            run.config = load_config(files, [*run.overrides, f"name={run.name}"])
        except ValueError as err:
            raise ValueError(f"{path}: run {run.name}: {err}") from None
        resolved.append(run.config)
    first, reference = resolved[0], runs[0].name
    for run, config in zip(runs[1:], resolved[1:], strict=True):
        diff = [k for k, v in asdict(config.data).items()
                if asdict(first.data)[k] != v and f"data.{k}" not in DATA_AXES]
        if diff:
            raise ValueError(f"{path}: runs {reference} and {run.name} differ in data.{diff[0]}: every run "
                             "of a comparison must see the same data order and validation tokens")
        for key in COMPARISON_INVARIANTS:
            if (was := attrgetter(key)(first)) != (now := attrgetter(key)(config)):
                raise ValueError(f"{path}: runs {reference} and {run.name} differ in {key} ({was} vs {now}): "
                                 "the token budget must match")
    return resolved


def load_sweep(path: str | Path, check: bool = True, root: Path | None = None) -> Sweep:
    """Read a sweep file, expand its grid and (``check``) resolve and compare every run's config; its runs
    start in the checkout ``root`` (default: the one holding the current directory)."""
    path = Path(path)
    root = find_checkout(Path.cwd() if root is None else Path(root))  # a wrong --root fails here, not later
    if not path.is_file():
        raise FileNotFoundError(f"no such sweep file: {path}")
    try:
        spec = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as err:  # yaml and omegaconf raise several types; all mean "not a valid sweep file"
        raise ValueError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    if unknown := sorted(set(spec) - set(SWEEP_KEYS)):
        raise _fail(path, unknown[0], f"unknown key; expected one of: {', '.join(SWEEP_KEYS)}")
    if not spec.get("name") or not re.fullmatch(r"[A-Za-z0-9_.-]+", str(spec["name"])):
        raise _fail(path, "name", f"expected letters, digits, '_', '.', '-', got {spec.get('name')!r}")
    slurm = {**SLURM_DEFAULTS, **(spec.get("slurm") or {})}
    if unknown := sorted(set(slurm) - set(SLURM_DEFAULTS)):
        raise _fail(path, f"slurm.{unknown[0]}", f"unknown key; expected one of: {', '.join(SLURM_DEFAULTS)}")
    runs = expand(spec, path, root)
    if check:
        check_comparable(runs, path, root)
    command = with_own_interpreter(shlex.split(str(spec.get("command") or "python train.py")))
    return Sweep(str(spec["name"]), runs, command, slurm, path, root)
