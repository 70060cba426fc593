"""Padded rows: ``attention_mask`` read as a padding mask, ``position_ids`` checked against it (packed documents
cannot be kept apart beside padding or a cache), and each padded position filled from its row's last real token, so
that ``logits[:, -1]`` is every row's next-token prediction.

Copied to the hub with the modelling code: torch and transformers only.
"""

from __future__ import annotations

import torch

from .cache import IsoLLMCache
from .layout import restarts_between_real_tokens

PACKED_WITH_STATE = (
    "position_ids restart between real tokens or after the cache's (packed documents), which are kept apart only "
    "without a cache (use_cache=False) and without padding in attention_mask; score or generate each document in a "
    "row of its own")


def real_token_mask(attention_mask: torch.Tensor | None, shape: tuple[int, int],
                    cache: IsoLLMCache | None) -> torch.Tensor | None:
    """``attention_mask`` as a bool mask, or None when no token is padding (the unmasked fast path); ``shape``: the
    new tokens' ``(B, T)``.

    A generation step (one token after a cache) keeps the mask without asking whether it holds padding:
    the answer would cost a device-to-host copy on every token, and masking one query costs nothing.
    """
    if attention_mask is None:
        return None
    step = cache is not None and cache.seen_tokens > 0 and shape[1] == 1
    if not step and bool(attention_mask.all()):
        return None
    expected = (shape[0], shape[1] + (cache.seen_tokens if cache is not None else 0))
    if tuple(attention_mask.shape) != expected:
        raise ValueError(f"attention_mask must be [batch, past + new tokens] = {list(expected)}; "
                         f"got {list(attention_mask.shape)}")
    return attention_mask.bool()


def refuse_restarts(position_ids: torch.Tensor, padding_mask: torch.Tensor | None, cache: IsoLLMCache | None) -> None:
    """Refuse ``position_ids`` that restart (``PACKED_WITH_STATE``) between two real tokens of the call, or after a
    cache's tokens at the call's first: a row continues at its count of real tokens so far, the position
    ``forward`` itself gives its next token. One bool is read back, once per call of several tokens; under
    ``torch.compile`` that read breaks the graph, so that the refusal is the same compiled and eager."""
    t = position_ids.shape[-1]
    real = padding_mask[:, -t:] if padding_mask is not None else None
    if cache is not None and cache.seen_tokens > 0:
        past = (padding_mask[:, :-t].sum(-1, keepdim=True) if padding_mask is not None
                else position_ids.new_full((1, 1), cache.seen_tokens))
        rows = max(past.shape[0], position_ids.shape[0])
        position_ids = torch.cat([(past - 1).expand(rows, 1), position_ids.expand(rows, t)], dim=-1)
        real = torch.cat([past > 0, real], dim=-1) if real is not None else None
    if restarts_between_real_tokens(position_ids, real):
        raise ValueError(PACKED_WITH_STATE)


def from_last_real_token(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, T, d]`` with each padded position holding the row's last real token before it.

    Then ``logits[:, -1]`` is every row's next-token prediction, right-padded rows included (generate()
    reads it); positions before a row's first real token keep their own (meaningless) value.
    """
    positions = torch.arange(x.shape[1], device=x.device).expand_as(real)
    source = torch.where(real, positions, 0).cummax(dim=1).values
    return x.gather(1, source[..., None].expand_as(x))
