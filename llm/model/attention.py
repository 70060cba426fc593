"""Attention scoring: what turns rotary-embedded q, k, v into the attended values.

``ATTN_SCORING_REGISTRY`` maps ``ModelConfig.attn_scoring`` to a module built as ``cls(config)`` and
called as ``forward(q, k, v, past=None, use_cache=False, padding_mask=None, documents=None, implementation=None,
weights=None) -> (out, present)``
(its static ``document_mask(doc_starts)`` builds the mask ``documents`` carries; ``static_state(present,
capacity)`` turns a prompt's state into a static cache's, which ``static_step(q, k, v, state, step) -> out``
then advances in place, one token per row, as the ``cache.DecodeStep`` it is given says) with

- ``q``: ``[B, H, T, D]``, ``k`` and ``v``: ``[B, Hkv, T, D]`` (grouped-query: query head ``h`` reads
  KV head ``h // (H // Hkv)``, as ``scaled_dot_product_attention(enable_gqa=True)`` does);
- causal attention with scores ``q.k / sqrt(D)``; ``out``: ``[B, H, T, D]`` in the input dtype;
- ``present``: an opaque per-layer state, ``None`` unless ``use_cache``. The modelling code stores it
  and hands it back as ``past`` with the next tokens only; their queries follow the past's keys;
- ``padding_mask``: ``[B, T_past + T]`` bool, True at real tokens, or None when every token is real.
  A padded key is seen by no query, and a padded query's output is zero, so each row of a padded batch
  gives what its real tokens give alone (left or right padding).
- ``documents``: the documents packed into each row (``layout.PackedDocuments``: their starts and the mask the
  scoring's ``document_mask`` built from them once per forward), or None. A query then sees the keys of its own
  document only, so each document gives what it gives alone. It comes without a past or a padding mask
  (training and scoring packed windows).
- ``implementation``: the transformers ``attn_implementation`` to run, one of the scoring's ``IMPLEMENTATIONS``
  (None: the first, its default); ``weights``: a list the attention weights ``[B, H, T, T_past + T]`` are appended
  to (``output_attentions``), None when not asked: they are computed only then.

Variants (``ModelConfig.attn_scoring``):

- ``softmax``: ``softmax(q k^T / sqrt(D)) v`` through ``F.scaled_dot_product_attention`` (flash on CUDA), packed
  documents through FlexAttention's block-sparse kernel on CUDA; the state is the KV cache ``(k, v)``. Its
  implementations: ``sdpa`` (that default), ``eager`` (the scores as a matrix, softmax in at least fp32, as
  transformers' eager attention) and ``flex_attention`` (FlexAttention with a block mask of the visible keys).
- ``iso_tanh`` (isotropic-deep-learning eq. 28): the softmax replaced by the isotropic tanh of eq. 16
  over each query's visible scores; linear time through the running sums ``S = sum_j k_j v_j^T`` and
  ``G = sum_j k_j k_j^T`` (the forms are in iso_tanh.py). The state is ``(S, G)``, O(1) per layer. One
  implementation, ``eager`` (its own forms; SDPA and FlexAttention compute a softmax); its attention weights are
  eq. 16's ``g(|s_i|) s_ij``, in the quadratic form (``iso_tanh_weights``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .acceleration import acceleration, compiled
from .cache import DecodeStep
from .fla_kernel import fla_kernel
from .iso_tanh import (
    IsoTanhState,
    check_qkv,
    iso_tanh_chunked,
    iso_tanh_linear_attention,
    iso_tanh_recurrent,
    iso_tanh_weights,
    mask_padding,
)
from .layout import PackedDocuments, same_document

if TYPE_CHECKING:
    from .config import ModelConfig

# SDPA kernels for one-token decoding: every backend but cuDNN, which builds an execution plan for each new
# key length, i.e. for every generated token. Measured on one H100 (torch 2.11, 134m, bf16, 2k context):
# 70-90 ms per token with the default choice, 22 ms with these (docs/performance.md, GPU results).
DECODE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# iso_tanh's form on CUDA, compiled or not: fla's kernel from this many positions on, the chunked form below. 8,192
# is where fla's kernel overtook flash attention on an H100 (docs/performance.md, second GPU check), not a measured
# crossover against the chunked form: it must be set from ``bench/bench_attention.py`` on a GPU (fla against
# ``chunked_compiled``, with bf16 operands), which has not run since fla became a custom op (fla_kernel.py).
FLA_MIN_LENGTH = 8192


def document_block_mask(doc_starts: torch.Tensor) -> BlockMask:
    """FlexAttention's block-sparse form of the block-diagonal causal mask of ``doc_starts`` (``[B, T]``). Where the
    device's policy compiles (on CUDA; inlined inside a compiled caller) ``create_block_mask`` is compiled, as
    torchtitan builds its masks: uncompiled it evaluates the mask on every ``(query, key)`` pair at once, a dense
    ``[B, 1, T, T]`` transient (1 GiB at 4 x 16k); compiled, block by block. Nothing in it reads a value back: no
    host sync."""
    document = doc_starts.long().cumsum(-1)

    def same_document_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (document[b, q] == document[b, kv]) & (q >= kv)

    b, t = doc_starts.shape
    create = compiled(create_block_mask, doc_starts.device)
    return create(same_document_causal, b, None, t, t, device=doc_starts.device)


def _check_padding_mask(mask: torch.Tensor, q: torch.Tensor, keys: int | None) -> torch.Tensor:
    """Validate a ``[B, T_past + T]`` padding mask for queries ``q`` and ``keys`` keys (None: any past)."""
    b, _, t, _ = q.shape
    if (mask.dim() != 2 or mask.shape[0] != b or mask.shape[1] < t or mask.dtype != torch.bool
            or (keys is not None and mask.shape[1] != keys)):
        want = f"[{b}, {keys if keys is not None else f'past + {t}'}]"
        raise ValueError(f"padding_mask must be a bool tensor {want}; got {mask.dtype} {tuple(mask.shape)}")
    return mask


def visible_keys(tq: int, tk: int, device: torch.device, padding_mask: torch.Tensor | None = None,
                 documents: PackedDocuments | None = None) -> torch.Tensor:
    """``[B or 1, 1, Tq, Tk]`` bool: the keys each query sees (query i at key position ``i + Tk - Tq``), in its own
    document, real keys only; a padded query keeps its causal keys (a row with none would be 0/0 in a softmax)."""
    visible = torch.ones(tq, tk, dtype=torch.bool, device=device).tril(diagonal=tk - tq)[None, None]
    if documents is not None:
        visible = visible & same_document(documents.starts)[:, None]
    if padding_mask is not None:
        real_query = padding_mask[:, None, tk - tq:, None]
        visible = visible & (padding_mask[:, None, None, :] | ~real_query)
    return visible


class SoftmaxScoring(nn.Module):
    """``softmax(q k^T / sqrt(D)) v``, causal, through ``F.scaled_dot_product_attention``.

    ``past`` / ``present`` is the KV cache ``(k, v)``, each ``[B, Hkv, T_past, D]``. With a past the
    new queries are the last positions (bottom-right causal alignment).
    """

    IMPLEMENTATIONS: ClassVar[tuple[str, ...]] = ("sdpa", "eager", "flex_attention")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()

    @staticmethod
    def document_mask(doc_starts: torch.Tensor) -> BlockMask | torch.Tensor:
        """The block-diagonal causal mask: FlexAttention's block mask where the device's policy says so (on CUDA),
        which skips the blocks no query sees; elsewhere a dense ``[B, 1, T, T]`` bool mask for SDPA."""
        if acceleration(doc_starts.device).block_mask:
            return document_block_mask(doc_starts)
        return same_document(doc_starts).tril()[:, None]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None, use_cache: bool = False,
                padding_mask: torch.Tensor | None = None, documents: PackedDocuments | None = None,
                implementation: str | None = None, weights: list[torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        check_qkv(q, k, v)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        tq, tk = q.shape[2], k.shape[2]
        block_mask = documents.attention_mask if documents is not None else None
        block_mask = block_mask if isinstance(block_mask, BlockMask) else None  # packed documents on CUDA
        real = _check_padding_mask(padding_mask, q, tk) if padding_mask is not None else None
        if weights is not None or implementation == "eager":  # weights: the eager path's
            out = self.eager(q, k, v, visible_keys(tq, tk, q.device, real, documents), weights)
        elif block_mask is not None:  # block-sparse, which no SDPA kernel is: FlexAttention (training names it)
            out = self.flex(q, k, v, block_mask)
        elif implementation == "flex_attention":
            out = self.flex(q, k, v, visible_keys(tq, tk, q.device, real, documents))
        elif documents is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=documents.attention_mask, enable_gqa=True)
        elif real is not None:  # causal attention over the real keys only
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible_keys(tq, tk, q.device, real),
                                                 enable_gqa=True)
        elif tq == tk:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif tq == 1:  # one new token sees every key
            with sdpa_kernel(DECODE_SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:  # SDPA's is_causal aligns top-left when Tq != Tk; query i sits at key position i + tk - tq
            visible = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        if real is not None:  # zero at padded queries, so that a padded query reaches no real token
            out = out.masked_fill(~real[:, None, tk - tq:, None], 0.0)
        return out, ((k, v) if use_cache else None)

    @staticmethod
    def static_state(present: tuple[torch.Tensor, torch.Tensor], capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's ``(k, v)`` moved into buffers of ``capacity`` slots ``[B, Hkv, capacity, D]``, the keys in at
        least fp32 (the scores' precision), cast once here rather than the whole buffer at every step."""
        keys, values = present
        free = (0, 0, 0, capacity - keys.shape[2])
        return F.pad(keys.to(torch.promote_types(keys.dtype, torch.float32)), free), F.pad(values, free)

    @staticmethod
    def static_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                    step: DecodeStep) -> torch.Tensor:
        """One new token per row written into the buffers at the step's slot, in place; it sees the step's visible
        slots. The query heads of a KV head attend as one row of queries, through plain matmuls over every slot,
        scores and softmax in fp32 and the weights then in the values' dtype, as flash attention keeps them: no SDPA
        kernel for a key mask splits the keys over the GPU, and the one it chose took 34 ms per token at 32k on an
        H100."""
        keys, values = state
        keys.index_copy_(2, step.slot, k.to(keys.dtype))
        values.index_copy_(2, step.slot, v)
        b, h, _, d = q.shape
        grouped = q.reshape(b, k.shape[1], -1, d).to(keys.dtype) * d**-0.5  # [B, Hkv, H / Hkv, D]
        scores = (grouped @ keys.transpose(-1, -2)).masked_fill_(~step.visible, -math.inf)
        return (scores.softmax(-1).to(v.dtype) @ values).reshape(b, h, 1, d)

    @staticmethod
    def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
              weights: list[torch.Tensor] | None) -> torch.Tensor:
        """transformers' eager attention: ``softmax(q k^T / sqrt(D))`` as a ``[B, H, Tq, Tk]`` matrix over the
        ``visible`` keys, in at least fp32 and then the queries' dtype (appended to ``weights`` if given), times
        ``v``."""
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        stats = torch.promote_types(q.dtype, torch.float32)
        probs = scores.masked_fill(~visible, -math.inf).softmax(-1, dtype=stats).to(q.dtype)
        if weights is not None:
            weights.append(probs)
        return probs @ v

    @staticmethod
    def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | BlockMask) -> torch.Tensor:
        """FlexAttention over the ``visible`` keys (``visible_keys``, made a block mask here, or a block mask already)
        compiled into its fused kernel where the device's policy compiles (on CUDA; uncompiled it materialises the
        scores)."""
        if not isinstance(visible, BlockMask):
            dense = visible.expand(q.shape[0], -1, -1, -1)

            def seen(b: torch.Tensor, h: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
                return dense[b, 0, query, key]

            visible = create_block_mask(seen, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
        return compiled(flex_attention, q.device, dynamic=False)(q, k, v, block_mask=visible, enable_gqa=True)


class IsoTanhScoring(nn.Module):
    """iso_tanh attention (isotropic-deep-learning eq. 28); ``past`` / ``present`` is ``(S, G)``.

    Training and prefill: ``iso_tanh_chunked`` with ``config.iso_tanh_chunk_size``, or fla's chunked
    linear-attention kernel on CUDA from ``FLA_MIN_LENGTH`` positions on (a custom op: compiled layers trace
    it). A single token after a past (generation): ``iso_tanh_recurrent``.
    """

    IMPLEMENTATIONS: ClassVar[tuple[str, ...]] = ("eager",)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.chunk_size = config.iso_tanh_chunk_size
        self.linear_attn = fla_kernel() if torch.cuda.is_available() else None

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}"

    @staticmethod
    def document_mask(doc_starts: torch.Tensor) -> None:
        """None: iso_tanh restarts its sums at the document starts themselves."""
        return None

    @staticmethod
    def static_state(present: IsoTanhState, capacity: int) -> IsoTanhState:
        """``(S, G)`` as they are: their size does not grow."""
        return present

    @staticmethod
    def static_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: IsoTanhState,
                    step: DecodeStep) -> torch.Tensor:
        """The recurrent form, which advances ``(S, G)`` in place without autograd; a padded token adds nothing."""
        return iso_tanh_recurrent(*mask_padding(q, k, step.real), v, state)[0]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: IsoTanhState | None = None,
                use_cache: bool = False, padding_mask: torch.Tensor | None = None,
                documents: PackedDocuments | None = None, implementation: str | None = None,
                weights: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, IsoTanhState | None]:
        if weights is not None:
            return self.quadratic(q, k, v, use_cache, padding_mask, documents, past, weights)
        kernel = self.linear_attn if acceleration(q.device).fla and q.shape[2] >= FLA_MIN_LENGTH else None
        if documents is not None:  # packed documents: each form restarts its sums at every document start
            if kernel is not None and not use_cache:  # fla's varlen kernels return no state
                return iso_tanh_linear_attention(q, k, v, None, kernel, documents.starts)[0], None
            out, state = iso_tanh_chunked(q, k, v, self.chunk_size, doc_starts=documents.starts)
            return out, (state if use_cache else None)
        if padding_mask is not None:  # the past's sums hold no padded key: only the new columns matter
            padding_mask = _check_padding_mask(padding_mask, q, k.shape[2] if past is None else None)
            q, k = mask_padding(q, k, padding_mask[:, -q.shape[2]:])
        if past is not None and q.shape[2] == 1:
            out, state = iso_tanh_recurrent(q, k, v, past)
        elif kernel is not None:
            out, state = iso_tanh_linear_attention(q, k, v, past, kernel)
        else:
            out, state = iso_tanh_chunked(q, k, v, self.chunk_size, past)
        return out, (state if use_cache else None)

    def quadratic(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, use_cache: bool,
                  padding_mask: torch.Tensor | None, documents: PackedDocuments | None, past: IsoTanhState | None,
                  weights: list[torch.Tensor]) -> tuple[torch.Tensor, IsoTanhState | None]:
        """``output_attentions``: the weights of eq. 16 as a matrix (appended to ``weights``) and the output as
        ``weights @ v``, so that the output's gradient reaches them as it does a softmax's; the state, if asked, from
        the chunked form. After a cache there are no keys, so no weights: refused."""
        if past is not None:
            raise ValueError("output_attentions: iso_tanh's cache keeps the sums (S, G), not the keys, so tokens "
                             "after a cache have no attention weights; score the whole sequence in one call")
        real = _check_padding_mask(padding_mask, q, k.shape[2]) if padding_mask is not None else None
        q, k = mask_padding(q, k, real) if real is not None else (q, k)
        probs = iso_tanh_weights(q, k, visible_keys(q.shape[2], k.shape[2], q.device, real, documents))
        weights.append(probs)
        out = probs @ v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        starts = documents.starts if documents is not None else None
        return out, (iso_tanh_chunked(q, k, v, self.chunk_size, doc_starts=starts)[1] if use_cache else None)


ATTN_SCORING_REGISTRY: dict[str, type[nn.Module]] = {"softmax": SoftmaxScoring, "iso_tanh": IsoTanhScoring}
