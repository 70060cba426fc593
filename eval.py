"""Evaluate checkpoints / hub models and compare runs: ``python eval.py --help``.

See ``llm/eval/cli.py`` for the subcommands (compare, lm-eval) and exit codes.
"""

from llm.eval.cli import run

if __name__ == "__main__":
    run()
