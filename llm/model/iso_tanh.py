"""iso_tanh attention's forms (isotropic-deep-learning eq. 16, 28), as functions on ``[B, heads, T, D]``.

The softmax of causal attention is replaced by the isotropic tanh ``f(s) = tanh(|s|) s/|s|`` (eq. 16),
applied to each query's row of scores ``s_i`` over the visible keys ``j <= i`` only. Because the weights
are a per-query scalar times the raw scores,

    out_i = g(|s_i|) sum_{j<=i} s_ij v_j = g(|s_i|) q_i^T S_i / sqrt(D),
    |s_i|^2 = q_i^T G_i q_i / D,   S_i = sum_{j<=i} k_j v_j^T,   G_i = sum_{j<=i} k_j k_j^T,

with ``g(r) = tanh(r) / r`` (``g(0) = 1``). Both running sums are linear attention, so iso_tanh runs in
linear time. The forms, which give the output of the O(T^2) reference from the masked score rows
(``iso_tanh_naive`` in tests/model/reference.py; test_attention.py and test_linear_attention.py, in fp64):

- ``iso_tanh_chunked``: exact scores inside chunks, the running sums between them (training, prefill);
- ``iso_tanh_recurrent``: one token at a time with an O(1) state ``(S, G)`` (generation, no KV cache);
- ``iso_tanh_linear_attention``: through a linear-attention kernel (fla's, fla_kernel.py, on GPU).

The state is kept per KV head: the query heads of a group read the same sums. Internally the two sums
travel as one ``[..., D, 2D]`` matrix ``[S | G] = sum_j k_j [v_j | k_j]^T``, so one matmul with
``[v | k]`` yields both the numerator and ``G q``. The module in attention.py chooses the form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from .acceleration import acceleration
from .isotropic import tanh_ratio

# ``(S, G)``, each ``[B, Hkv, D, D]`` in fp32 (fp64 for fp64 inputs): ``sum_j k_j v_j^T`` and
# ``sum_j k_j k_j^T`` over every token seen so far.
IsoTanhState = tuple[torch.Tensor, torch.Tensor]

# A linear-attention kernel ``(q, k, v, scale, initial_state, doc_starts) -> (o, final_state)`` on ``[B, T, H, K]``
# tensors: ``o_i = sum_{j<=i} scale (q_i.k_j) v_j`` plus the initial state's ``scale q_i^T state``, and the final
# ``state + sum_j k_j v_j^T``; with ``doc_starts`` (``[B, T]`` bool, no initial state) the sums restart at every
# True and every row start, and the final state is None. fla's kernel: fla_kernel.py; the tests' torch one:
# tests/model/test_linear_attention.py.
LinearAttention = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


_R = TypeVar("_R")


def _without_autocast(fn: Callable[..., _R]) -> Callable[..., _R]:
    """Run ``fn`` (whose first argument is ``q``) with autocast off on q's device.

    The running sums must accumulate in fp32: under a bf16 autocast the matmuls below would
    otherwise be recast to bf16 whatever dtype their operands were given.
    """

    @functools.wraps(fn)
    def wrapper(q: torch.Tensor, *args: Any, **kwargs: Any) -> _R:
        with torch.autocast(device_type=q.device.type, enabled=False):
            return fn(q, *args, **kwargs)

    return wrapper


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Validate the shared shape contract; return ``(B, H, Hkv, T, D)``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-d q, k, v [B, heads, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, h, t, d = q.shape
    hkv = k.shape[1]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or h % hkv:
        raise ValueError(f"attention expects k, v [B, Hkv, T, D] with Hkv dividing H; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return b, h, hkv, t, d


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision inputs (the running sums grow with T), fp64 kept for exact tests."""
    return torch.promote_types(dtype, torch.float32)


def _matmul(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` (equal batch shapes) in ``acc``. Two half-precision operands stay half where the device's policy says
    so (``Acceleration.half_operands``: on CUDA), the GEMM accumulating and writing fp32 (``bmm``'s ``out_dtype``): no
    fp32 copies, no TF32. Otherwise both are cast to ``acc`` (the CPU has no ``out_dtype`` kernel), so ``train.tf32``
    rounds only products that have an fp32 operand anyway."""
    if acceleration(a.device).half_operands and a.dtype == b.dtype != acc:
        out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=acc)
        return out.view(*a.shape[:-1], b.shape[-1])
    return a.to(acc) @ b.to(acc)


def _iso_tanh_gain(r2: torch.Tensor) -> torch.Tensor:
    """``g(|s|) = tanh(|s|)/|s|`` from ``r2 = |s|^2`` (isotropic-deep-learning eq. 16 over ``|s|``).

    ``r2`` comes out of a quadratic form and may round to slightly below zero. The clamp to the
    smallest normal keeps ``sqrt`` off its infinite slope at 0: where ``r2 = 0`` the query is zero or
    sees no key, so the numerator and ``d r2/d q`` vanish and a zero gradient through ``r2`` is exact.
    """
    return tanh_ratio(r2.clamp_min(torch.finfo(r2.dtype).tiny).sqrt())


def _check_state(state: IsoTanhState, b: int, hkv: int, d: int) -> IsoTanhState:
    s, g = state
    if s.shape != (b, hkv, d, d) or g.shape != (b, hkv, d, d):
        raise ValueError(f"iso_tanh state must be (S, G), each [B, Hkv, D, D] = {[b, hkv, d, d]}; "
                         f"got {tuple(s.shape)}, {tuple(g.shape)}")
    return s, g


def _pack_state(state: IsoTanhState | None, b: int, hkv: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """``(S, G)`` -> ``[B, Hkv, D, 2D]`` in ``like``'s dtype (zeros when there is no state)."""
    if state is None:
        return like.new_zeros(b, hkv, d, 2 * d)
    return torch.cat(_check_state(state, b, hkv, d), dim=-1).to(like.dtype)


def mask_padding(q: torch.Tensor, k: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """iso_tanh's padding: zero the queries and keys where ``real`` (``[B, T]``) is False.

    A zero key adds nothing to ``S = sum_j k_j v_j^T`` or ``G = sum_j k_j k_j^T``, and a zero query's
    output ``g(|s|) q^T S / sqrt(D)`` is zero: the sums, and so every real token's output, are exactly
    those of the real tokens alone. It holds for any form that computes those sums (naive, chunked,
    recurrent, or fla's kernel, linear in k), so the masking happens once, before the form is chosen.
    """
    keep = real[:, None, :, None]
    return q.masked_fill(~keep, 0.0), k.masked_fill(~keep, 0.0)


def _exclusive_cumsum(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """``y_m = sum_{m' < m} x_m'`` over dim -2 of ``[..., n, F]``, as matmuls.

    ``torch.cumsum`` over a non-innermost dim is slow on CPU (a strided scan; 10-20x a matmul here).
    A strictly-lower-triangular ones matrix does it in one batched matmul, but costs ``n^2 F``; so the
    scan is blocked: exclusive sums inside blocks of ``block`` rows, plus the exclusive sum of the block
    totals (recursively), ``O(n * block * F)`` in all.
    """
    n = x.shape[-2]
    if n <= block:
        return torch.ones(n, n, dtype=x.dtype, device=x.device).tril(-1) @ x
    nb = -(-n // block)
    blocks = F.pad(x, (0, 0, 0, nb * block - n)).unflatten(-2, (nb, block))  # [..., nb, block, F]
    within = _exclusive_cumsum(blocks, block)
    before = _exclusive_cumsum(blocks.sum(-2), block).unsqueeze(-2)
    return (within + before).flatten(-3, -2)[..., :n, :]


def _packed_chunk_sums(kc: torch.Tensor, vkc: torch.Tensor, doc_starts: torch.Tensor, grp: int, acc: torch.dtype,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``iso_tanh_chunked``'s carried sums when documents are packed (``doc_starts`` ``[B, n, c]`` per chunk).

    A query takes sums from earlier chunks only if its document began in one of them: that is the document
    open at the chunk's start, read by the chunk's queries before its first document start. Its sums are
    ``P[c] - P[r]``: ``P`` the exclusive prefix over chunks of each chunk's *tail* sums (its tokens from its
    last document start on; all of them if none starts there), ``r`` the last chunk before c where a
    document starts. Returns ``(before [B, Hkv, n, D, 2D], final [B, Hkv, D, 2D], continues [B, 1, n, grp c,
    1], same [B, 1, n, grp c, c])``: the carried sums, the open document's sums after the last chunk, which
    query rows read the carried sums, and which (query row, key) pairs of a chunk share a document.
    """
    b, hkv, n, c, d = kc.shape
    position = torch.arange(c, device=kc.device)
    first = torch.where(doc_starts, position, c).amin(-1, keepdim=True)  # [B, n, 1]; c: none starts here
    last = torch.where(doc_starts, position, -1).amax(-1, keepdim=True)  # -1: none starts here
    tail = (position >= last).to(kc.dtype)  # [B, n, c]
    tail_sums = _matmul((kc * tail[:, None, ..., None]).transpose(-1, -2), vkc, acc).flatten(-2)  # [B, Hkv, n, 2D^2]
    prefix = _exclusive_cumsum(tail_sums)
    chunk = torch.arange(n, device=kc.device)
    opened = torch.where(doc_starts.any(-1), chunk, 0).cummax(-1).values  # [B, n]: last chunk with a start
    r = F.pad(opened[:, :-1], (1, 0))  # chunk 0 carries nothing: P[0] - P[0]

    def prefix_at(index: torch.Tensor) -> torch.Tensor:  # P[index[b, i]] per row: [B, Hkv, len, 2D^2]
        return prefix.gather(2, index[:, None, :, None].expand(-1, hkv, -1, prefix.shape[-1]))

    before = (prefix - prefix_at(r)).unflatten(-1, (d, 2 * d))
    final = (prefix[:, :, -1:] + tail_sums[:, :, -1:] - prefix_at(opened[:, -1:]))[:, :, 0].unflatten(-1, (d, 2 * d))
    continues = (position < first).repeat(1, 1, grp)[:, None, ..., None]
    document = doc_starts.flatten(1).long().cumsum(-1).view(b, n, c)
    same = (document.repeat(1, 1, grp)[..., None] == document[:, :, None, :])[:, None]
    return before, final, continues, same


@_without_autocast
def iso_tanh_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                     state: IsoTanhState | None = None,
                     doc_starts: torch.Tensor | None = None) -> tuple[torch.Tensor, IsoTanhState]:
    """iso_tanh attention in O(T * (chunk_size + D) * D): exact scores inside each chunk of
    ``chunk_size`` positions, the running ``(S, G)`` for everything before it.

    All chunks are processed at once (no Python loop over T): the per-chunk sums ``k^T [v | k]`` are
    turned into the state before each chunk by an exclusive prefix sum over chunks, which keeps
    ``T / chunk_size`` states of ``D x 2D`` in memory. Sums are accumulated in fp32 (fp64 stays fp64)
    whatever the input dtype; on CUDA the products of two inputs (scores, chunk sums) take them as they are,
    bf16 with fp32 accumulation (``_matmul``). ``out`` is returned in the input dtype, the final state in fp32.

    ``state``: the sums over earlier tokens (``None`` = start of sequence), so a sequence split in
    pieces and fed with the carried state gives the output of the whole.

    ``doc_starts``: ``[B, T]`` bool, True at the first token of each packed document (layout.py), or None.
    Each query then sums over its own document's keys only, so every document's output is its output alone;
    the returned state is the last document's. Packed rows start from no state. The carried sums are
    differences of prefix sums (``_packed_chunk_sums``): exact in fp64, within fp32 rounding of the whole
    row's sums otherwise.
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"iso_tanh_chunked: chunk_size must be a positive integer, got {chunk_size!r}")
    b, h, hkv, t, d = check_qkv(q, k, v)
    grp = h // hkv
    acc = _accumulation_dtype(q.dtype)
    init = _pack_state(state, b, hkv, d, q.new_empty(0, dtype=acc))
    if t == 0:
        return q.new_empty(b, h, 0, d), init.chunk(2, dim=-1)
    c = min(chunk_size, t)
    n = -(-t // c)

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, heads, T, D] -> [B, heads, n, c, D]
        if n * c > t:  # zero keys and values add nothing to any sum; padded queries are dropped
            x = F.pad(x, (0, 0, 0, n * c - t))
        return x.unflatten(2, (n, c))

    # A group's queries share their KV head's keys and state: stack them as the rows of one chunk,
    # [B, Hkv, n, grp * c, D], so every product below is a plain batched matmul without expanding k, v.
    # The 1/sqrt(D) is applied once, in the accumulation dtype: to the fp32 copy of the queries (q_acc, which
    # reads the carried sums) and to the in-chunk scores' fp32 products, never rounded into half-precision queries.
    qc = chunks(q).unflatten(1, (hkv, grp)).transpose(2, 3).flatten(3, 4)
    scale = d**-0.5
    q_acc = qc.to(acc) * scale
    kc, vc = chunks(k), chunks(v)
    vkc = torch.cat([vc, kc], dim=-1)  # [v | k]: one matmul gives S and G together

    position = torch.arange(grp * c, device=q.device) % c
    hidden = torch.arange(c, device=q.device) > position[:, None]  # causal mask inside a chunk
    if doc_starts is None:
        chunk_sums = _matmul(kc.transpose(-1, -2), vkc, acc)  # [B, Hkv, n, D, 2D]
        before = _exclusive_cumsum(chunk_sums.flatten(-2)).unflatten(-1, (d, 2 * d))
        if state is not None:  # without one the sums before the first chunk are zero: nothing to add
            before = before + init[:, :, None]
        final = before[:, :, -1] + chunk_sums[:, :, -1]
        inter = q_acc @ before  # [q^T S | q^T G] / sqrt(D) over the chunks before, per row
    else:
        if state is not None:
            raise ValueError("iso_tanh_chunked: packed documents (doc_starts) start from no state")
        starts = F.pad(doc_starts, (0, n * c - t)).view(b, n, c)
        before, final, continues, same = _packed_chunk_sums(kc, vkc, starts, grp, acc)
        inter = (q_acc @ before) * continues
        hidden = hidden | ~same
    scores = (_matmul(qc, kc.transpose(-1, -2), acc) * scale).masked_fill_(hidden, 0.0)  # [B, Hkv, n, grp * c, c]

    numerator = _matmul(scores, vc, acc) + inter[..., :d]
    r2 = scores.square().sum(-1) + (q_acc * inter[..., d:]).sum(-1)  # |s_i|^2 = q_i^T G_i q_i / D
    out = _iso_tanh_gain(r2).unsqueeze(-1) * numerator
    out = out.unflatten(3, (grp, c)).transpose(2, 3).reshape(b, h, n * c, d)[:, :, :t]
    return out.to(q.dtype), final.chunk(2, dim=-1)


@_without_autocast
def iso_tanh_weights(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The attention weights of eq. 16, ``g(|s_i|) s_ij`` over each query's ``visible`` keys (``[B or 1, 1, Tq, Tk]``
    bool), as a ``[B, H, Tq, Tk]`` matrix in the queries' dtype: the quadratic form, for ``output_attentions`` only
    (``weights @ v`` is the output the linear forms give)."""
    group = q.shape[1] // k.shape[1]
    acc = _accumulation_dtype(q.dtype)
    scores = (q.to(acc) @ k.to(acc).repeat_interleave(group, dim=1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible, 0.0)
    return (_iso_tanh_gain(scores.square().sum(-1, keepdim=True)) * scores).to(q.dtype)


@_without_autocast
def iso_tanh_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       state: IsoTanhState | None) -> tuple[torch.Tensor, IsoTanhState]:
    """iso_tanh attention one token at a time with an O(1) state: generation without a KV cache.

    For each new token: ``S += k_t v_t^T``, ``G += k_t k_t^T``, then ``out_t = g(|s_t|) q_t^T S / sqrt(D)``
    with ``|s_t|^2 = q_t^T G q_t / D``. Same contract and dtypes as ``iso_tanh_chunked``, except that with
    autograd off (generation) the given state is advanced in place: a token then costs the same whatever the
    context, with no copy of the sums. With autograd on, the given state is left as it was.
    """
    b, h, hkv, t, d = check_qkv(q, k, v)
    acc = _accumulation_dtype(q.dtype)
    if state is None:
        sums, g = q.new_zeros(2, b, hkv, d, d, dtype=acc).unbind()
    else:
        sums, g = (x.to(acc) for x in _check_state(state, b, hkv, d))
    add_outer = torch.Tensor.addcmul_ if not torch.is_grad_enabled() else torch.addcmul
    qs = (q.to(acc) * d**-0.5).view(b, hkv, h // hkv, t, d)
    k, v = k.to(acc), v.to(acc)
    outs = []
    for i in range(t):
        k_i = k[:, :, i, :, None]
        sums = add_outer(sums, k_i, v[:, :, i, None, :])
        g = add_outer(g, k_i, k[:, :, i, None, :])
        q_t = qs[:, :, :, i]  # [B, Hkv, grp, D]
        r2 = (q_t * (q_t @ g)).sum(-1, keepdim=True)
        outs.append(_iso_tanh_gain(r2) * (q_t @ sums))
    out = torch.stack(outs, dim=3).reshape(b, h, t, d)
    return out.to(q.dtype), (sums, g)


def iso_tanh_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: IsoTanhState | None,
                              linear_attn: LinearAttention, doc_starts: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, IsoTanhState | None]:
    """iso_tanh through a linear-attention kernel ``LA_i(q, k, v) = sum_{j<=i} (q_i.k_j/sqrt(D)) v_j``.

    One call ``LA(q, k, [v | k])`` gives the numerator ``sum_j s_ij v_j`` and ``G_i q_i / sqrt(D)``,
    whence ``|s_i|^2 = q_i . LA(q, k, k)_i / sqrt(D)``. ``linear_attn`` is fla's kernel (fla_kernel.py)
    on GPU; any ``LinearAttention`` works (the tests pass a plain-torch one). Kernels want
    equal head counts, so k and v are expanded to the query heads and the state back to one per KV head.

    ``doc_starts`` (``[B, T]`` bool, packed documents, no ``state``): the kernel restarts its sums at every
    document start, so each document's sums start from zero; the state returned is then None.
    """
    b, h, hkv, _, d = check_qkv(q, k, v)
    if doc_starts is not None and state is not None:
        raise ValueError("iso_tanh_linear_attention: packed documents (doc_starts) start from no state")
    grp = h // hkv
    acc = _accumulation_dtype(q.dtype)
    init = None if state is None else _pack_state(state, b, hkv, d, q.new_empty(0, dtype=acc))
    if init is not None:
        init = init.repeat_interleave(grp, dim=1)
    vk = torch.cat([v, k], dim=-1).repeat_interleave(grp, dim=1)
    k = vk[..., d:]  # the expanded keys, already in [v | k]
    q_, k_, vk_ = (x.transpose(1, 2) for x in (q, k, vk))  # [B, T, H, *], the kernel's layout
    la, final = linear_attn(q_, k_, vk_, d**-0.5, init, doc_starts)
    la = la.transpose(1, 2).to(acc)  # [B, H, T, 2D]
    r2 = (q.to(acc) * la[..., d:]).sum(-1, keepdim=True) * d**-0.5
    out = _iso_tanh_gain(r2) * la[..., :d]
    if final is None:
        return out.to(q.dtype), None
    return out.to(q.dtype), final.to(acc).view(b, hkv, grp, d, 2 * d)[:, :, 0].chunk(2, dim=-1)
