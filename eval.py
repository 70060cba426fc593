"""Evaluate checkpoints / hub models and compare runs: ``python eval.py --help``.

See ``llm/cli/eval.py`` for the subcommands (compare, lm-eval) and exit codes.
"""

from llm.cli.eval import run

if __name__ == "__main__":
    run()
