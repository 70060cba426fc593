"""Run a script in a fresh interpreter that cannot import ``llm``: a user with only torch + transformers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

WITHOUT_LLM = textwrap.dedent("""
    import importlib.abc, sys

    class NoLLM(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "llm" or name.startswith("llm."):
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, NoLLM())
    try:
        import llm
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("llm is importable: the test would prove nothing")
""")
"""Hides the editable install of ``llm``; the repository is neither the working directory nor on the path."""

TRUST_PROMPT = "Do you wish to run the custom code?"
"""transformers' interactive question when remote code is met without ``trust_remote_code``."""


def run_without_llm(script: str, *args: str, cwd: Path, asks: bool = False) -> subprocess.CompletedProcess[str]:
    """``script`` after ``WITHOUT_LLM``, offline, stdin closed (a batch job); fails with its output, or if it asks
    transformers' remote-code question (``TRUST_PROMPT``) where ``asks`` is False or does not where it is True."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(cwd / "modules"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", WITHOUT_LLM + textwrap.dedent(script), *args], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert (TRUST_PROMPT in done.stdout + done.stderr) == asks, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def stderr_besides_progress(done: subprocess.CompletedProcess[str]) -> list[str]:
    """What ``done`` printed on stderr besides transformers' "Loading weights" progress bar: warnings."""
    lines = done.stderr.replace("\r", "\n").splitlines()
    return [line for line in lines if line.strip() and not line.startswith("Loading weights")]
