"""Errors as the user reads them: one line."""

from __future__ import annotations

__all__ = ["one_line"]


def one_line(err: BaseException) -> str:
    """``Type: first line`` of an exception (torch and safetensors errors span several lines)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
