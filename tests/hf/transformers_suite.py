"""transformers' common model tests (``tests/test_modeling_common.py`` of its source distribution), importable.

The tests ship in the sdist of the installed transformers only, not in its wheel: ``common_tests()`` downloads that
sdist once through pip (PyPI, the one network CI reaches) into a cache outside the repository, keeps its ``tests/``
and imports the module as the package ``transformers_tests``; nothing of it is copied into this repository. Two
modules it imports are not in the sdist and are stood in for by empty mixins: the generation tests
(``generation/test_utils.py``) and the export tests (``exporters/test_export.py``). Generation is covered by this
repository's own tests instead: ``tests/model/test_generation.py`` (generate() equals the full forward, batched
padded generation, ``inputs_embeds``) and ``tests/model/test_static_decoding.py`` (the static cache).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import transformers

PACKAGE = "transformers_tests"
STAND_INS = {"exporters.test_export": "ExportTesterMixin", "generation.test_utils": "GenerationTesterMixin"}
"""The modules ``test_modeling_common`` imports that the sdist lacks, and the mixin each provides."""


def cache_dir() -> Path:
    """Where the sdist's ``tests/`` is kept: ``$XDG_CACHE_HOME/isollm`` (``~/.cache/isollm``), one per version."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "isollm" / f"transformers-{transformers.__version__}-tests"


def fetch_tests() -> Path:
    """``tests/`` of the installed transformers' sdist, downloaded and extracted once (an atomic rename, so that
    two pytest workers collecting at once both find it whole)."""
    target = cache_dir()
    if (target / "test_modeling_common.py").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"transformers=={transformers.__version__}", "-d", scratch], check=True)
        (sdist,) = Path(scratch).glob("transformers-*.tar.gz")
        prefix = f"transformers-{transformers.__version__}/tests/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix) and m.isfile()]
            for member in members:
                member.name = member.name[len(prefix):]
            archive.extractall(Path(scratch) / "tests", members=members, filter="data")
        try:
            (Path(scratch) / "tests").rename(target)
        except OSError:  # the other worker got there first
            if not (target / "test_modeling_common.py").exists():
                raise
    return target


def common_tests() -> types.ModuleType:
    """``test_modeling_common`` of the installed transformers, imported from the cached sdist."""
    if f"{PACKAGE}.test_modeling_common" in sys.modules:
        return sys.modules[f"{PACKAGE}.test_modeling_common"]
    directory = fetch_tests()
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(directory)]
    sys.modules[PACKAGE] = package
    for module_name, mixin in STAND_INS.items():
        parent = f"{PACKAGE}.{module_name.split('.')[0]}"
        sys.modules.setdefault(parent, types.ModuleType(parent))
        stand_in = types.ModuleType(f"{PACKAGE}.{module_name}")
        setattr(stand_in, mixin, type(mixin, (), {}))
        sys.modules[stand_in.__name__] = stand_in
    spec = importlib.util.spec_from_file_location(f"{PACKAGE}.test_modeling_common",
                                                  directory / "test_modeling_common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

