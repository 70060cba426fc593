"""Training signals logged on every run: gradient-norm statistics, isotropy, FLOPs / MFU, layer reports."""

from .flops import flops_per_token, matmul_weights, measure_matmul_flops, mfu, peak_flops
from .gradnorm import GradNormTracker
from .isotropy import basis_alignment, effective_rank, isoscore, isotropy_metrics, mean_cosine_similarity
from .layers import flatten_for_tracker, layer_report

__all__ = [
    "GradNormTracker",
    "basis_alignment",
    "effective_rank",
    "flatten_for_tracker",
    "flops_per_token",
    "isoscore",
    "isotropy_metrics",
    "layer_report",
    "matmul_weights",
    "mean_cosine_similarity",
    "measure_matmul_flops",
    "mfu",
    "peak_flops",
]
