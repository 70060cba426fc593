"""One decoder block of the isollm decoder: grouped-query attention with RoPE and QK-norm, its scoring from
``ATTN_SCORING_REGISTRY``, and the FFN from ``FFN_REGISTRY``, each behind a pre-norm residual (modeling_isollm.py
stacks them).

Copied to the hub with the modelling code: torch and transformers only.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention import ATTN_SCORING_REGISTRY
from .cache import DecodeStep, LayerState
from .config import ModelConfig
from .ffn import FFN_REGISTRY
from .fused_ops import RMSNorm, apply_rotary
from .layout import PackedDocuments


class IsoLLMAttention(nn.Module):
    """Grouped-query attention: fused ``qkv_proj``, Qwen3's per-head ``q_norm``/``k_norm`` before RoPE,
    scoring from ``ATTN_SCORING_REGISTRY[config.attn_scoring]``, ``o_proj``; no biases."""

    MUP_SCALED: ClassVar[tuple[str, ...]] = ("qkv_proj.weight", "o_proj.weight")
    """Hidden matrices."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.resolved_head_dim
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        norm = (lambda: RMSNorm(self.head_dim, config.rms_norm_eps)) if config.qk_norm else nn.Identity
        self.q_norm = norm()
        self.k_norm = norm()
        self.scoring = ATTN_SCORING_REGISTRY[config.attn_scoring](config)
        self.config = config  # its attn_implementation, read at each call: set_attn_implementation changes it
        self.query_scale = config.query_scale  # muP's attention scale (1 under standard and at the base)

    def fused_parts(self) -> dict[str, list[int]]:
        """The row blocks of the fused projection: q, k and v, three maps fused for speed only, which an optimizer
        that orthogonalises matrices (llm/train/optim.py, Muon) treats apart."""
        return {"qkv_proj.weight": [n * self.head_dim for n in (self.num_heads, self.num_kv_heads, self.num_kv_heads)]}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: LayerState | None = None,
                padding_mask: torch.Tensor | None = None, documents: PackedDocuments | None = None,
                step: DecodeStep | None = None, output_attentions: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention's output and its weights ``[B, H, T, T_past + T]``, computed only under
        ``output_attentions`` (None otherwise: transformers' output capture records them from here). ``state``: the
        layer's generation state (None in training), whose scoring state this call advances; ``step``: a static
        cache's one-token step after its prompt (None otherwise)."""
        implementation = getattr(self.config, "_attn_implementation", None)  # None on a plain ModelConfig
        b, t, _ = x.shape
        qkv = self.qkv_proj(x).view(b, t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin)
        if self.query_scale != 1.0:  # muP: the scorings divide by sqrt(head_dim), q brings the rest
            q = q * self.query_scale
        k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin)
        weights = [] if output_attentions else None  # the scoring appends its weights to it
        if step is not None:
            out = self.scoring.static_step(q, k, v.transpose(1, 2), state.attention, step)
        elif state is None:
            out, _ = self.scoring(q, k, v.transpose(1, 2), padding_mask=padding_mask, documents=documents,
                                  implementation=implementation, weights=weights)
        else:
            out, state.attention = self.scoring(q, k, v.transpose(1, 2), past=state.attention, use_cache=True,
                                                padding_mask=padding_mask, implementation=implementation,
                                                weights=weights)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (weights[0] if weights else None)


class IsoLLMDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: ``x + self_attn(norm(x))``, then ``x + mlp(norm(x))``.

    A ``GradientCheckpointingLayer``: after ``model.activation_checkpointing_enable(every_n_layers=n)`` (the
    public transformers API), every n-th layer keeps only its input in training and recomputes the rest in the
    backward pass (non-reentrant ``torch.utils.checkpoint``, around ``forward`` so FSDP2's hooks stay outside).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = IsoLLMAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FFN_REGISTRY[config.ffn](config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: LayerState | None = None,
                padding_mask: torch.Tensor | None = None, documents: PackedDocuments | None = None,
                step: DecodeStep | None = None, output_attentions: bool = False) -> torch.Tensor:
        """``padding_mask``: ``[B, T_past + T]``, True at real tokens (None: all real); ``documents``: the packed
        documents of each row (None: one per row); see attention.py. ``step``: a static cache's step;
        ``output_attentions``: whether the attention computes its weights (``IsoLLMAttention``)."""
        ffn_cache = state.ffn if state is not None else None
        ffn_mask = padding_mask[:, -x.shape[1]:] if padding_mask is not None else None
        attended, _ = self.self_attn(self.input_layernorm(x), cos, sin, state, padding_mask, documents, step,
                                     output_attentions)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x), cache=ffn_cache, padding_mask=ffn_mask,
                            doc_starts=documents.starts if documents is not None else None)
