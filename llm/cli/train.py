"""``python train.py --config configs/X.yaml [--config more.yaml] key.sub=value ...``, or
``python train.py name=NAME resume=true [key.sub=value ...]`` to continue a run from its own config.yaml.

Exit codes: 0 done (or stopped by SIGTERM/SIGINT after checkpointing), 1 the run failed (non-finite steps
or parameters, a checkpoint or run-directory file that could not be written: the lock, a metrics row; every
rank stops with the same line), 2 bad configuration, arguments or data inputs (a missing or unreadable file, a
checkpoint that does not fit this launch, a run directory locked by another run, ``resume=true`` over
checkpoints none of which is usable, ``name=NAME resume=true`` of no run), reported as one ``error: <field>:
<message>`` line before any training step. A skipped checkpoint is one ``warning:`` line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from llm.config import RunConfig, load_config, read_yaml
from llm.data.errors import DataError
from llm.errors import one_line_warnings, stderr_line
from llm.model.config import ConfigError
from llm.train.checkpoint_files import CheckpointError, checkpoint_names

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Pretrain an isollm decoder (configs merged left to right, then overrides).")
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML config; repeat to merge several (later files win)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="dotted overrides, e.g. model.ffn=isogmlp train.lr=1e-3 resume=true")
    return parser


def _report(err: BaseException) -> None:
    """One ``error:`` line. An error re-raised from a DataLoader worker carries the worker's traceback in
    its message; its last line is the original one-line message."""
    lines = [line for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    message = lines[-1].split(": ", 1)[1] if len(lines) > 1 and ": " in lines[-1] else lines[-1]
    stderr_line(f"error: {message}")


def _keys(node: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of a nested mapping's leaves."""
    return [leaf for key, value in node.items()
            for leaf in (_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])]


def _check_saved(saved: Path) -> None:
    """A run's config.yaml against the one its newest checkpoint saved (written by the same or older code): a file
    cut inside a section, its headers intact, would be filled from today's defaults, so a key the checkpoint's holds
    and the file lacks is refused; a missing file beside checkpoints is refused too, naming where to restore it from."""
    ckpt_dir = saved.parent / "checkpoints"
    found = [ckpt_dir / name / "config.yaml" for name in checkpoint_names(ckpt_dir)]
    if not found:
        return
    if not saved.is_file():
        raise ConfigError("config", f"{saved} is missing, but the run holds {len(found)} checkpoint(s): restore it "
                                    f"(e.g. copy {found[0]}) to resume")
    have = set(_keys(OmegaConf.to_container(read_yaml(saved))))
    sections = {key.split(".")[0] for key in have}  # a whole section missing is load_config's to name
    for reference in found:  # the newest that reads (the resume skips a damaged checkpoint too)
        try:
            want = _keys(OmegaConf.to_container(read_yaml(reference)))
        except ConfigError:
            continue
        if missing := [key for key in want if key not in have and key.split(".")[0] in sections]:
            more = f" and {len(missing) - 1} more key(s)" if len(missing) > 1 else ""
            raise ConfigError("config", f"{saved} lacks {missing[0]}{more}, which the checkpoint config {reference} "
                                        f"holds (the file is damaged): restore it from there")
        return


def _load(files: list[str], overrides: list[str]) -> RunConfig:
    """The config of ``files`` and ``overrides``. Without files, ``resume=true`` (or restart) and ``name=NAME`` start
    from the run directory's own config.yaml (``out_dir``/NAME/config.yaml) when it exists, the overrides applied on
    top; a run not begun yet is configured by the overrides alone when they name its data (``data.source`` or
    ``data.prepared``): without them, NAME is taken for a run to continue, and its missing config.yaml is an error."""
    given = dict(override.split("=", 1) for override in overrides if "=" in override)
    resuming = given.get("resume", "").lower() in ("true", "yes", "on", "restart")  # true to the config too
    if files or not resuming or "name" not in given:
        return load_config(files, overrides)
    out_dir = given.get("out_dir", RunConfig.out_dir)
    saved = Path(out_dir, given["name"], "config.yaml")
    _check_saved(saved)
    if not saved.is_file() and not given.keys() & {"data.source", "data.prepared"}:
        raise ConfigError("name", f"no run {given['name']!r} to resume: {saved.absolute()} does not exist (a new "
                                  "run with resume=true: give its --config, data.source or data.prepared)")
    if not saved.is_file():
        return load_config(files, overrides)
    # the run continues where its config was found, whatever out_dir it was saved with (a moved run directory)
    return load_config([str(saved)], [f"out_dir={out_dir}", *overrides], saved_run=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)  # overrides may follow options
    try:
        config = _load(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        _report(err)
        return 2
    from llm.train.step import TrainingError  # heavy imports after the arguments are known good
    from llm.train.trainer import fit

    try:
        fit(config)
    except (ConfigError, DataError, FileNotFoundError) as err:
        _report(err)
        return 2
    except (TrainingError, CheckpointError, OSError) as err:  # OSError: a write fit does not name itself
        _report(err)
        return 1
    return 0


def _record_exit(code: int) -> None:
    """Under launch/supervise.sh (``ISOLLM_EXIT_DIR`` set), write this rank's exit code and the node's rank count
    there: it exits 0 when every rank did, whatever the launcher's own status after a signal."""
    if directory := os.environ.get("ISOLLM_EXIT_DIR"):
        rank, ranks = os.environ.get("LOCAL_RANK", "0"), os.environ.get("LOCAL_WORLD_SIZE", "1")
        Path(directory, f"rank{rank}").write_text(f"{code} {ranks}\n")


def run() -> None:
    """Entry point: exit with ``main``'s code. Multi-process runs end with ``os._exit`` (after flushing):
    about a quarter of 2-process gloo runs otherwise abort at interpreter exit after finishing, and
    ``os._exit`` avoided it in 10 runs of 10 (verified on CPU, torch 2.13)."""
    one_line_warnings()
    code = main()
    _record_exit(code)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
