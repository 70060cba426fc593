"""Training signals logged on every run: gradient-norm statistics, isotropy, FLOPs / MFU, layer reports."""

from .layers import layer_report

__all__ = ["layer_report"]
