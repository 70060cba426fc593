"""Expand a sweep file into runs and print them, run them here, or submit a Slurm array (llm/cli/sweep.py).

    python launch/sweep.py launch/sweeps/ffn_attn.yaml --mode print|local|slurm [--dry-run] [--only NAME ...] [-j N]
"""

import sys

from llm.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())
