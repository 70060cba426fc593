"""Expand a sweep file into runs and print them, run them here, or submit a Slurm array (llm/cli/sweep.py).

    python launch/sweep.py launch/sweeps/ffn_attn.yaml --mode print|local|slurm [--dry-run] [--only NAME ...] [-j N]

The runs use this checkout (the one holding this file), whatever checkout the environment installed ``llm`` from.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's llm, not an installed one from another clone

from llm.cli.sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(root=ROOT))
