"""fla's chunked linear-attention kernel (flash-linear-attention, ``pip install fla-core``) as torch custom ops.

fla's entry point ``chunk_linear_attn`` is ``torch.compiler.disable``-d, so a compiled layer that called it broke
its graph in two around every iso_tanh attention. Here its forward and backward kernels are two ops
(``torch.library.custom_op``, in this module's namespace) with fake implementations for their shapes and the
backward registered as the forward's gradient: ``torch.compile`` traces a layer through them whole
(``fullgraph=True``), forward and backward, and calls fla's Triton kernels as opaque functions.

fla's kernels are its module-level functions ``chunk_simple_gla_fwd`` / ``chunk_simple_gla_bwd`` (linear attention
is simple GLA without a gate, which is what ``chunk_linear_attn`` calls), pinned by pyproject's ``fla-core<0.7``.
They are fla's internals, not its documented API, so a release that renames or reshapes them must fail loudly:
the import below raises rather than falling back to torch, and ``tests/model/fla_interpreted.py`` runs these ops,
forward and backward, through Triton's CPU interpreter against the fp64 reference in every CI run.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# fla's chunk length (its own default): the kernels tile the sequence by it.
FLA_CHUNK = 64

# The ops' namespace, from this module's name, as lm_head.py's: the hub's copy of this file
# (``trust_remote_code``) registers its own ops beside this package's in the same process.
OP_NAMESPACE = re.sub(r"\W", "_", __name__)


@functools.cache
def _fla() -> dict[str, Callable[..., Any]] | None:
    """fla's forward, backward and varlen chunk-index functions, or None where fla cannot run.

    Imported on first use, not with this module: importing fla takes seconds, and a CPU run never uses it.
    """
    try:
        import fla  # noqa: F401
    except (ImportError, RuntimeError):  # no fla, no triton, or triton without a GPU driver: torch serves
        return None
    from fla.ops.simple_gla.chunk import chunk_simple_gla_bwd, chunk_simple_gla_fwd  # an ImportError here is
    from fla.ops.utils import prepare_chunk_indices  # a changed fla: fail loudly (module docstring)

    return {"fwd": chunk_simple_gla_fwd, "bwd": chunk_simple_gla_bwd, "chunk_indices": prepare_chunk_indices}


def _varlen(q: torch.Tensor, doc_starts: torch.Tensor | None) -> dict[str, Any]:
    """fla's varlen arguments for packed documents: the rows flattened into one sequence cut at every document
    start and every row start (``cu_seqlens``, one host sync), so each document's sums start from zero."""
    if doc_starts is None:
        return {"cu_seqlens": None, "chunk_indices": None}
    cuts = doc_starts.clone()
    cuts[:, 0] = True  # every row starts a sequence of its own
    cu_seqlens = F.pad(cuts.flatten().nonzero().flatten(), (0, 1), value=cuts.numel())
    return {"cu_seqlens": cu_seqlens, "chunk_indices": _fla()["chunk_indices"](cu_seqlens, FLA_CHUNK)}


def _on_device(x: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """x's GPU as the current one: Triton launches there (fla's own ``input_guard`` does the same)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _kernel_layout(doc_starts: torch.Tensor | None, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous ``[B, T, H, *]`` tensors, flattened to ``[1, B T, H, *]`` for the varlen kernels."""
    return [(x if doc_starts is None else x.flatten(0, 1)[None]).contiguous() for x in xs]


@torch.library.custom_op(f"{OP_NAMESPACE}::fla_linear_attn", mutates_args=())
def fla_linear_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    initial_state: torch.Tensor | None, doc_starts: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``o_i = sum_{j<=i} scale (q_i . k_j) v_j + scale q_i^T initial_state`` on ``[B, T, H, K]`` q, k and
    ``[B, T, H, V]`` v; returns ``(o [B, T, H, V] in q's dtype, final state [B, H, K, V] in fp32)``.

    ``doc_starts`` (``[B, T]`` bool, no ``initial_state``): the sums restart at every True and at every row
    start; the final state is then empty (fla's varlen kernels return none that iso_tanh could use).
    """
    qf, kf, vf = _kernel_layout(doc_starts, q, k, v)
    with _on_device(q):
        o, final = _fla()["fwd"](q=qf, k=kf, v=vf, g=None, g_gamma=None, scale=scale, initial_state=initial_state,
                                 output_final_state=doc_starts is None, **_varlen(q, doc_starts),
                                 chunk_size=FLA_CHUNK)
    final = q.new_empty(0, dtype=torch.float32) if final is None else final.float()
    return o.to(q.dtype).view(*q.shape[:-1], v.shape[-1]), final


@fla_linear_attn.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, initial_state: torch.Tensor | None,
      doc_starts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    o = q.new_empty(*q.shape[:-1], v.shape[-1])
    if doc_starts is not None:
        return o, q.new_empty(0, dtype=torch.float32)
    return o, q.new_empty(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)


@torch.library.custom_op(f"{OP_NAMESPACE}::fla_linear_attn_backward", mutates_args=())
def fla_linear_attn_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             initial_state: torch.Tensor | None, doc_starts: torch.Tensor | None,
                             grad_out: torch.Tensor, grad_final: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fla_linear_attn``'s gradients ``(dq, dk, dv, d initial_state)``, the last empty without an initial state.

    fla recomputes the chunk states from q, k and v here rather than keep them from the forward, as its own
    autograd function does.
    """
    qf, kf, vf, do = _kernel_layout(doc_starts, q, k, v, grad_out)
    with _on_device(q):
        dq, dk, dv, _, dh0 = _fla()["bwd"](q=qf, k=kf, v=vf, g=None, g_gamma=None, initial_state=initial_state,
                                           do=do, dht=grad_final, scale=scale, **_varlen(q, doc_starts),
                                           chunk_size=FLA_CHUNK)
    d_initial = q.new_empty(0) if initial_state is None else dh0.to(initial_state.dtype)
    return dq.to(q.dtype).view_as(q), dk.to(k.dtype).view_as(k), dv.to(v.dtype).view_as(v), d_initial


@fla_linear_attn_backward.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, initial_state: torch.Tensor | None,
      doc_starts: torch.Tensor | None, grad_out: torch.Tensor, grad_final: torch.Tensor | None
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    d_initial = q.new_empty(0) if initial_state is None else torch.empty_like(initial_state)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), d_initial


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, ctx.scale, initial_state, doc_starts = inputs
    ctx.save_for_backward(q, k, v, initial_state, doc_starts)
    ctx.set_materialize_grads(False)  # an unused final state passes no gradient, not a zero-filled one


def _backward(ctx: Any, grad_out: torch.Tensor | None, grad_final: torch.Tensor | None
              ) -> tuple[torch.Tensor | None, ...]:
    q, k, v, initial_state, doc_starts = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    if grad_final is not None and grad_final.numel() == 0:
        grad_final = None
    dq, dk, dv, d_initial = fla_linear_attn_backward(q, k, v, ctx.scale, initial_state, doc_starts, grad_out,
                                                     grad_final)
    return dq, dk, dv, None, (None if initial_state is None else d_initial), None


fla_linear_attn.register_autograd(_backward, setup_context=_setup_context)


def fla_chunk_linear_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          initial_state: torch.Tensor | None = None, doc_starts: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fla_linear_attn`` with iso_tanh's ``LinearAttention`` signature: the final state is None with
    ``doc_starts``."""
    o, final = fla_linear_attn(q, k, v, scale, initial_state, doc_starts)
    return o, (None if doc_starts is not None else final)


def fla_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None:
    """``fla_chunk_linear_attn`` where fla can run (fla-core and triton installed), else None."""
    return fla_chunk_linear_attn if _fla() is not None else None
