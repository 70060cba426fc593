"""Errors as the user reads them: one line."""

from __future__ import annotations

import sys
import warnings

__all__ = ["IsollmWarning", "one_line", "one_line_warnings", "stderr_line"]


class IsollmWarning(UserWarning):
    """A warning of ours (a skipped checkpoint, a data cache rebuilt, a retried read): the command lines print it
    as one ``warning:`` line, not Python's file:line plus a line of source."""


def one_line_warnings() -> None:
    """Make every ``IsollmWarning`` print as ``warning: <message>`` (the command lines call this at start)."""
    default = warnings.formatwarning

    def format_warning(message, category, filename, lineno, line=None) -> str:
        if issubclass(category, IsollmWarning):
            return f"warning: {message}\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = format_warning


def one_line(err: BaseException) -> str:
    """``Type: first line`` of an exception (torch and safetensors errors span several lines)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def stderr_line(line: str) -> None:
    """``line`` and its newline to stderr in one write. ``print`` writes them separately, and with unbuffered
    output (``PYTHONUNBUFFERED``) the lines of ranks sharing torchrun's stderr can then interleave."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()
