"""Argument types shared by the command-line tools (``eval.py``, ``isollm-data``, ``launch/sweep.py``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(low: float, kind: type = int) -> Callable[[str], float]:
    """An argparse ``type`` accepting ``kind`` values >= ``low`` (argparse then prints a one-line error)."""
    def parse(text: str) -> float:
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a value >= {low}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value" messages
    return parse
