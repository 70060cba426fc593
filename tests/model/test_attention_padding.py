"""Padded batches: with the padding's queries and keys zeroed, every iso_tanh form gives each row its output
alone (zero at the padding), and both scoring modules do so through a padded prefill and the tokens after it."""

from __future__ import annotations

import pytest
import torch
from reference import iso_tanh_naive
from test_attention import EXACT, B, config, make_qkv, softmax_reference
from test_linear_attention import torch_linear_attn

from llm.model.attention import ATTN_SCORING_REGISTRY
from llm.model.iso_tanh import (
    iso_tanh_chunked,
    iso_tanh_linear_attention,
    iso_tanh_recurrent,
    mask_padding,
)

PADDED_T = 13
ROWS = [slice(3, PADDED_T), slice(0, 8)]
"""Row 0 left-padded by 3, row 1 right-padded by 5."""


def padding_mask(t: int = PADDED_T) -> torch.Tensor:
    real = torch.zeros(B, t, dtype=torch.bool)
    for row, tokens in enumerate(ROWS):
        real[row, tokens] = True
    return real


ISO_TANH_FORMS = {
    "naive": lambda q, k, v: iso_tanh_naive(q, k, v),
    "chunked": lambda q, k, v: iso_tanh_chunked(q, k, v, 4)[0],
    "recurrent": lambda q, k, v: iso_tanh_recurrent(q, k, v, None)[0],
    "linear_attention": lambda q, k, v: iso_tanh_linear_attention(q, k, v, None, torch_linear_attn)[0],
}


@pytest.mark.parametrize("form", sorted(ISO_TANH_FORMS))
def test_iso_tanh_with_padding_masked_is_each_row_alone_in_every_form(form: str) -> None:
    """Zero padded queries and keys: real outputs equal the row alone's, padded outputs are exactly 0."""
    q, k, v = make_qkv(PADDED_T)
    real = padding_mask()
    out = ISO_TANH_FORMS[form](*mask_padding(q, k, real), v)
    for row, tokens in enumerate(ROWS):
        alone = iso_tanh_naive(q[row : row + 1, :, tokens], k[row : row + 1, :, tokens], v[row : row + 1, :, tokens])
        torch.testing.assert_close(out[row : row + 1, :, tokens], alone, **EXACT)
    assert not out.transpose(1, 2)[~real].any()


def test_iso_tanh_state_of_a_padded_row_sums_its_real_tokens_only() -> None:
    q, k, v = make_qkv(PADDED_T)
    _, (s, g) = iso_tanh_chunked(*mask_padding(q, k, padding_mask()), v, 4)
    for row, tokens in enumerate(ROWS):
        kt = k[row, :, tokens].transpose(-1, -2)
        torch.testing.assert_close(s[row], kt @ v[row, :, tokens], **EXACT)
        torch.testing.assert_close(g[row], kt @ k[row, :, tokens], **EXACT)


@pytest.mark.parametrize("name", sorted(ATTN_SCORING_REGISTRY))
def test_module_with_padding_mask_is_each_row_alone_then_continues(name: str) -> None:
    """Padded prefill, then two tokens with the mask grown by them: each row as computed alone, zero at
    padding. Softmax masks its cached padded keys; iso_tanh never adds them to its sums."""
    scoring = ATTN_SCORING_REGISTRY[name](config(4))
    q, k, v = make_qkv(PADDED_T + 2)
    real = torch.cat([padding_mask(), torch.ones(B, 2, dtype=torch.bool)], dim=1)
    prefill = slice(0, PADDED_T)
    head, past = scoring(q[:, :, prefill], k[:, :, prefill], v[:, :, prefill], use_cache=True,
                         padding_mask=real[:, prefill])
    tail, _ = scoring(q[:, :, PADDED_T:], k[:, :, PADDED_T:], v[:, :, PADDED_T:], past=past,
                      padding_mask=real)
    out = torch.cat([head, tail], dim=2)
    reference = softmax_reference if name == "softmax" else iso_tanh_naive
    for row in range(B):
        keep = real[row]
        alone = reference(*(x[row : row + 1, :, keep] for x in (q, k, v)))
        torch.testing.assert_close(out[row : row + 1, :, keep], alone, **EXACT)
    assert not out.transpose(1, 2)[~real].any()


def test_misshapen_padding_mask_is_refused() -> None:
    q, k, v = make_qkv(5)
    for scoring in ATTN_SCORING_REGISTRY.values():
        with pytest.raises(ValueError, match="padding_mask must be a bool tensor"):
            scoring(config())(q, k, v, padding_mask=torch.ones(B, 4, dtype=torch.bool))
        with pytest.raises(ValueError, match="padding_mask must be a bool tensor"):
            scoring(config())(q, k, v, padding_mask=torch.ones(B, 5))
