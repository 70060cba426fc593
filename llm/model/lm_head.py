"""The LM head, and its next-token cross-entropy fused so that the ``[N, V]`` logits are never held whole.

Training spends a large share of a small model's step on the vocabulary: the logits (``N x V`` fp32,
64 MiB for 2,048 tokens and a vocabulary of 8,192; 10 GiB for 16k tokens and Qwen3's 151,936), their
log-softmax, and the gradient of both. ``linear_cross_entropy`` walks the tokens in chunks of
``chunk_rows``: each chunk's logits, log-softmax and gradient ``softmax - onehot`` live only while that
chunk's two gradient matmuls run, and the gradients of the hidden states and of the weight are
accumulated during the forward pass (the fused linear cross-entropy of Liger-Kernel, Hsu et al. 2024).
The backward pass then only scales them by the incoming gradient.

The result equals ``F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=...)`` (the mean
over targets != ``ignore_index``), in value and in gradient: tests/model/test_lm_head.py checks it in fp64.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100
"""Targets equal to this are left out of the mean (transformers' convention)."""

LOGITS_PER_CHUNK = {"cpu": 2**21, "cuda": 2**26}
"""Logits computed at once, per device type. CPU: 8 MiB in fp32, a chunk that stays in cache while it is
used. CUDA: 256 MiB, so that the weight-gradient matmul of each chunk (inner dimension = its tokens)
stays large and the ``[V, d]`` gradient is read and written a few dozen times per step, not hundreds."""

MIN_CHUNK_ROWS = 128
"""Floor on the tokens per chunk, so that the chunk matmuls stay efficient for large vocabularies."""


def default_chunk_rows(vocab_size: int, device: torch.device) -> int:
    per_chunk = LOGITS_PER_CHUNK.get(device.type, LOGITS_PER_CHUNK["cuda"])
    return max(MIN_CHUNK_ROWS, per_chunk // vocab_size)


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``; gradients computed in the forward."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int,
                chunk_rows: int, with_grad: bool) -> Tensor:
        # Softmax statistics in at least fp32 (fp64 stays fp64), as F.cross_entropy(logits.float()) does.
        stats_dtype = torch.promote_types(hidden.dtype, torch.float32)
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, 0)[:, None]
        total = hidden.new_zeros((), dtype=stats_dtype)
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) \
            if with_grad else None
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h, target, keep = hidden[rows], safe_targets[rows], valid[rows, None]
            log_probs = torch.log_softmax((h @ weight.T).to(stats_dtype), dim=-1)
            total -= torch.where(keep, log_probs.gather(1, target), 0).sum()
            if not with_grad:
                continue
            # d(-log p_target)/d logits = softmax - onehot; ignored rows are zeroed through h and grad_h,
            # which are d wide, rather than through the V-wide logits.
            grad_logits = log_probs.exp_().scatter_add_(1, target, torch.full_like(target, -1, dtype=stats_dtype))
            grad_logits = grad_logits.to(weight.dtype)
            torch.mul(grad_logits @ weight, keep, out=grad_hidden[rows])
            h_kept = h * keep
            if grad_weight.dtype == grad_logits.dtype:
                grad_weight.addmm_(grad_logits.T, h_kept)
            else:  # half-precision matmul, accumulated over chunks in fp32
                grad_weight += grad_logits.T @ h_kept
        count = valid.sum()
        if with_grad:
            ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count
        return (grad_hidden * scale.to(grad_hidden.dtype), (grad_weight * scale).to(ctx.weight_dtype),
                None, None, None, None)


@torch.compiler.disable  # runs eagerly under torch.compile: matmul-bound, and its loop would unroll
def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX,
                         chunk_rows: int | None = None) -> Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index)`` without the whole logits.

    ``hidden``: ``[..., d]``; ``weight``: ``[V, d]``; ``targets``: ``hidden.shape[:-1]``. Under autocast
    the matmuls run in the autocast dtype, as ``nn.Linear`` would, and the softmax in fp32.
    """
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets: expected shape {tuple(hidden.shape[:-1])} (one per hidden state), "
                         f"got {tuple(targets.shape)}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(), ignore_index,
                                         chunk_rows or default_chunk_rows(weight.shape[0], hidden.device),
                                         with_grad)


class LMHead(nn.Linear):
    """``nn.Linear(hidden, vocab)`` without bias that can also return the fused loss directly.

    ``forward(hidden)`` gives logits; ``forward(hidden, targets)`` gives the mean cross-entropy through
    ``linear_cross_entropy``. The loss goes through this module's call (rather than reading ``weight``
    from outside) so that wrappers which gather parameters in forward hooks (DeepSpeed ZeRO-3) see it.
    """

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: Tensor, targets: Tensor | None = None) -> Tensor:
        if targets is None:
            return F.linear(hidden, self.weight)
        return linear_cross_entropy(hidden, self.weight, targets)
