"""Evaluate a checkpoint (loss, perplexity, bits per byte, isotropy, samples), compare runs, plot, lm-eval.

Entry point: ``eval.py`` (``llm.cli.eval``).
"""
