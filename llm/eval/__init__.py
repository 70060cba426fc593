"""Evaluate a checkpoint (loss, perplexity, bits per byte, isotropy, samples), compare runs, plot, lm-eval.

Entry point: ``eval.py`` (``llm.cli.eval``).
"""

from llm.eval.compare import Comparison, compare_runs
from llm.eval.evaluate import EvalReport, evaluate_checkpoint, format_report, resolve_checkpoint
from llm.eval.plots import write_plots
from llm.eval.report import format_table, write_comparison
from llm.eval.runs import RunRecord, load_run

__all__ = [
    "Comparison",
    "EvalReport",
    "RunRecord",
    "compare_runs",
    "evaluate_checkpoint",
    "format_report",
    "format_table",
    "load_run",
    "resolve_checkpoint",
    "write_comparison",
    "write_plots",
]
