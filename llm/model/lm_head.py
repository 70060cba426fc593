"""The LM head, and its next-token cross-entropy fused so that the ``[N, V]`` logits are never held whole.

Training spends a large share of a small model's step on the vocabulary: the logits (``N x V``, 10 GiB in fp32
for 16k tokens and Qwen3's 151,936), their log-softmax, and the gradient of both. ``linear_cross_entropy`` walks
the tokens in chunks of ``chunk_rows``: each chunk's logits, log-softmax and gradient ``softmax - onehot`` live
only while that chunk's two gradient matmuls run, and the gradients of the hidden states and of the weight are
accumulated during the forward pass (the fused linear cross-entropy of Liger-Kernel, Hsu et al. 2024). The
backward pass then only scales them by the incoming gradient.

The chunk loop is a ``torch.library`` custom op, so a compiled caller holds it as one opaque node rather than
breaking its graph or unrolling the loop. ``train.compile`` compiles the decoder layers only: the loss op runs
outside them, eagerly, its chunk loop in Python. Where the device's policy compiles (acceleration.py: on CUDA)
each chunk's softmax and gradient run as their own compiled kernel (``chunk_loss_and_grad``) that reads the
half-precision logits and writes their half-precision gradient, with the softmax statistics in fp32 in registers:
no fp32 copy of the chunk's logits.

The result equals ``F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=...)`` (the mean over
targets != ``ignore_index``), in value and in gradient: tests/model/test_lm_head.py checks it in fp64.

``fp8`` (``ModelConfig.lm_head_precision``): each chunk's logits come from a rowwise-scaled FP8 matmul
(``F.scaled_mm``, e4m3 operands, fp32 accumulation, DeepSeek-V3's and torchao's rowwise recipe): the weight (kept in
bf16, the master copy in fp32) quantised once per call, each chunk's hidden states in the chunk loop. The two
gradient matmuls stay bf16, as does everything outside the training loss (logits, evaluation). The CPU runs torch's
reference kernel of the same op (quantised operands, dequantised, fp32 matmul): FP8's numbers at CPU speed.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .acceleration import acceleration, compiled
from .errors import ConfigError

# e4m3's largest finite value (448): each row's largest magnitude is scaled to it.
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max

# Targets equal to this are left out of the mean (transformers' convention).
IGNORE_INDEX = -100

# Most logits computed at once, per device type. CPU: 8 MiB in fp32, a chunk that stays in cache while it is used.
# CUDA: 1 GiB in bf16 (3,533 tokens at Qwen3's vocabulary; the chunk's gradient takes as much again). Each chunk reads
# and writes the ``[V, d]`` fp32 weight gradient once (1.2 GB at d = 1,024, inside its GEMM), so the fewer chunks the
# less of that traffic: 19 chunks at 32 x 2048 where 2**28 took 37, still a small share of an H100's memory.
LOGITS_PER_CHUNK = {"cpu": 2**21, "cuda": 2**29}

# Floor on the tokens per chunk, so that the chunk matmuls stay efficient for large vocabularies.
MIN_CHUNK_ROWS = 128


def default_chunk_rows(tokens: int, vocab_size: int, device: torch.device) -> int:
    """The rows of equal chunks, as few as ``LOGITS_PER_CHUNK`` allows: ``tokens`` split evenly rather than into full
    chunks and a small last one (at 32 x 2048 and Qwen3's vocabulary: 19 chunks of 3,450 rows)."""
    per_chunk = max(MIN_CHUNK_ROWS, LOGITS_PER_CHUNK.get(device.type, LOGITS_PER_CHUNK["cuda"]) // vocab_size)
    rows = -(-tokens // max(1, -(-tokens // per_chunk)))
    return min(per_chunk, -(-rows // 16) * 16)  # whole tensor-core tiles (FP8 GEMMs want multiples of 16)


def quantize_rowwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` ``[rows, d]`` as e4m3 and its fp32 row scales ``[rows, 1]``, ``x ~ x8 * scale``."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    return (x / scale).to(torch.float8_e4m3fn), scale


def fp8_logits(hidden: Tensor, weight8: Tensor, weight_scale: Tensor) -> Tensor:
    """``hidden @ weight.T`` in ``hidden``'s dtype from the quantised weight: FP8 operands, fp32 accumulation."""
    hidden8, hidden_scale = quantize_rowwise(hidden)
    rowwise = F.ScalingType.RowWise
    return F.scaled_mm(hidden8, weight8.T, hidden_scale, rowwise, weight_scale.T, rowwise, output_dtype=hidden.dtype)


def chunk_loss_and_grad(logits: Tensor, target: Tensor, keep: Tensor, with_grad: bool = True
                        ) -> tuple[Tensor, Tensor | None]:
    """One chunk's summed ``-log softmax(logits)[target]`` over the kept rows, and (``with_grad``) its gradient with
    respect to the logits, ``softmax - onehot(target)`` (``[rows, V]`` in the logits' dtype; ignored rows are zeroed
    later, through the ``d``-wide hidden states rather than the ``V``-wide logits). Statistics in at least fp32."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = x.logsumexp(-1, keepdim=True)
    loss = torch.where(keep, lse - x.gather(1, target), 0).sum()
    if not with_grad:
        return loss, None
    probs = (x - lse).exp()
    if torch.compiler.is_compiling():  # fused by the compiler into the one pass that writes the gradient
        columns = torch.arange(x.shape[-1], device=x.device)
        return loss, torch.where(columns == target, probs - 1, probs).to(logits.dtype)
    return loss, probs.scatter_add_(1, target, torch.full_like(target, -1, dtype=probs.dtype)).to(logits.dtype)


# The custom op's namespace, from this module's name: the hub's copy of this file (``trust_remote_code``)
# registers its own op beside this package's in the same process.
OP_NAMESPACE = re.sub(r"\W", "_", __name__)


@torch.library.custom_op(f"{OP_NAMESPACE}::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk_rows: int,
                          with_grad: bool, fp8: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(mean loss, d sum / d hidden, d sum / d weight (at least fp32), number of targets)``; the gradients are
    empty without ``with_grad``. ``hidden`` ``[N, d]``, ``weight`` ``[V, d]`` and ``targets`` ``[N]``."""
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, 0)[:, None]
    stats_dtype = torch.promote_types(hidden.dtype, torch.float32)
    total = hidden.new_zeros((), dtype=stats_dtype)
    grad_hidden = torch.empty_like(hidden) if with_grad else hidden.new_empty(0)
    grad_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) \
        if with_grad else weight.new_empty(0)
    policy = acceleration(hidden.device)
    chunk_fn = compiled(chunk_loss_and_grad, hidden.device, fullgraph=True)
    logits_fn = compiled(fp8_logits, hidden.device, fullgraph=True)
    weight8 = quantize_rowwise(weight) if fp8 else None
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        h, keep = hidden[rows], valid[rows, None]
        logits = logits_fn(h, *weight8) if weight8 is not None else h @ weight.T
        loss, grad_logits = chunk_fn(logits, safe_targets[rows], keep, with_grad)
        total += loss
        if grad_logits is None:
            continue
        torch.mul(grad_logits @ weight, keep, out=grad_hidden[rows])
        h_kept = h * keep
        if grad_weight.dtype == grad_logits.dtype:
            grad_weight.addmm_(grad_logits.T, h_kept)
        elif policy.half_operands:  # half-precision operands accumulated in fp32 inside the GEMM's own epilogue
            torch.addmm(grad_weight, grad_logits.T, h_kept, out_dtype=grad_weight.dtype, out=grad_weight)
        else:  # CPU has no out_dtype kernel: a half-precision matmul, then an fp32 add
            grad_weight += grad_logits.T @ h_kept
    count = valid.sum()
    return total / count, grad_hidden, grad_weight, count  # no target: 0 / 0, NaN, as F.cross_entropy gives


@_linear_cross_entropy.register_fake
def _(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk_rows: int,
      with_grad: bool, fp8: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grad_weight_dtype = torch.promote_types(weight.dtype, torch.float32)
    return (hidden.new_empty((), dtype=torch.promote_types(hidden.dtype, torch.float32)),
            torch.empty_like(hidden) if with_grad else hidden.new_empty(0),
            torch.empty_like(weight, dtype=grad_weight_dtype) if with_grad else weight.new_empty(0),
            targets.new_empty((), dtype=torch.long))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    _, grad_hidden, grad_weight, count = output
    ctx.save_for_backward(grad_hidden, grad_weight, count)
    ctx.weight_dtype = inputs[1].dtype
    # The three other outputs get no gradient: without this autograd zero-fills one of each shape per backward,
    # a [V, d] fp32 tensor among them (622 MB at Qwen3's vocabulary and d = 1,024), and _backward gets None.
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_loss: Tensor | None, *_: Tensor | None) -> tuple[Tensor | None, ...]:
    if grad_loss is None:
        return None, None, None, None, None, None, None
    grad_hidden, grad_weight, count = ctx.saved_tensors
    # With no target (all ignored, rows of one token) both sums are exactly zero and so is F.cross_entropy's
    # gradient: dividing by the count of 0 would make every gradient 0 * inf = NaN.
    scale = grad_loss / count.clamp_min(1)
    return (grad_hidden * scale.to(grad_hidden.dtype), (grad_weight * scale).to(ctx.weight_dtype),
            None, None, None, None, None)


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def check_fp8_device(device: torch.device) -> None:
    """Refuse ``lm_head_precision=fp8`` on a GPU without FP8 tensor cores (CUDA capability below 8.9)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError("lm_head_precision", f"fp8 needs FP8 tensor cores (CUDA capability 8.9+: L4, H100), "
                          f"which {torch.cuda.get_device_name(device)} lacks; use bf16")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX,
                         chunk_rows: int | None = None, fp8: bool = False) -> Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index)`` without the whole logits.

    ``hidden``: ``[..., d]``; ``weight``: ``[V, d]``; ``targets``: ``hidden.shape[:-1]``. Under autocast
    the matmuls run in the autocast dtype, as ``nn.Linear`` would, and the softmax in fp32. ``fp8``: the logits
    from FP8 operands (module docstring); refused on a GPU without FP8 tensor cores.
    """
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets: expected shape {tuple(hidden.shape[:-1])} (one per hidden state), "
                         f"got {tuple(targets.shape)}")
    if fp8:
        check_fp8_device(hidden.device)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device_type, enabled=False):
        rows = chunk_rows or default_chunk_rows(targets.numel(), weight.shape[0], hidden.device)
        loss, *_ = _linear_cross_entropy(hidden.flatten(0, -2), weight, targets.flatten(), ignore_index, rows,
                                         with_grad, fp8)
    return loss


class LMHead(nn.Linear):
    """``nn.Linear(hidden, vocab)`` without bias that can also return the fused loss directly.

    ``forward(hidden)`` gives logits; ``forward(hidden, targets)`` gives the mean cross-entropy through
    ``linear_cross_entropy``. The loss goes through this module's call (rather than reading ``weight``
    from outside) so that wrappers which gather parameters in forward hooks (DeepSpeed ZeRO-3) see it.
    """

    def __init__(self, hidden_size: int, vocab_size: int, precision: str = "bf16") -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        self.fp8 = precision == "fp8"

    def forward(self, hidden: Tensor, targets: Tensor | None = None) -> Tensor:
        if targets is None:
            return F.linear(hidden, self.weight)
        return linear_cross_entropy(hidden, self.weight, targets, fp8=self.fp8)
