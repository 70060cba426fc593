"""References that only the tests use: each computes what a library form computes, the plain way."""

from __future__ import annotations

import torch

from llm.model import ModelConfig
from llm.model.ffn import FFN_REGISTRY, resolve_intermediate_size
from llm.model.iso_tanh import check_qkv


def iso_tanh_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """O(T^2) reference of iso_tanh attention (llm/model/iso_tanh.py), computed from the masked score rows as written.

    ``w_i = tanh(|s_i|) s_i/|s_i|`` (isotropic-deep-learning eq. 16, 28) with ``s_i`` the scores of
    query i over keys ``j <= i`` only (the masked entries are absent from the norm, not -inf), and
    ``f(0) = 0``. Deliberately independent of ``tanh_ratio`` and of the ``(S, G)`` identity it checks.
    """
    _, h, hkv, t, d = check_qkv(q, k, v)
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    visible = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-1, -2) / d**0.5).masked_fill(~visible, 0.0)
    norm = torch.linalg.vector_norm(scores, dim=-1, keepdim=True)
    safe_norm = torch.where(norm > 0, norm, torch.ones_like(norm))  # keeps the unused branch finite
    weights = torch.where(norm > 0, torch.tanh(norm) * scores / safe_norm, scores)
    return weights @ v


def ffn_param_count(config: ModelConfig) -> int:
    """Parameters of one FFN block at the hidden size ``resolve_intermediate_size`` gives ``config`` (after parameter
    matching), counted on the meta device: a block that resolved its own size otherwise would not match it."""
    with torch.device("meta"):
        block = FFN_REGISTRY[config.ffn](config, intermediate_size=resolve_intermediate_size(config))
    return sum(p.numel() for p in block.parameters())


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin ``[B, T, head_dim]`` as isollm computed them before RoPE scaling existed (every checkpoint
    trained then rotates by these bits): ``theta^(-2i/D)`` in fp32, rotate-half layout."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = position_ids[..., None].float() * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)
