"""Packed documents in one row: where each starts, read from ``position_ids`` as transformers marks them.

A training window packs several documents. With document masking, its ``position_ids`` restart at 0 at
every document (``DataCollatorWithFlattening``'s convention, which transformers' own models read through
``masking_utils.find_packed_sequence_indices``): a position that does not continue the previous one by 1
starts a document. Every block that mixes positions then keeps documents apart: softmax through a
block-diagonal causal mask, iso_tanh by restarting its sums, isogmlp's causal mean by restarting its prefix.
``PackedDocuments`` carries the starts and the attention's own form of the mask, built once per forward.

Copied to the hub with the modelling code: torch only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


class PackedDocuments(NamedTuple):
    """The documents packed into each row of a batch, as the decoder's blocks read them."""

    starts: torch.Tensor
    """``[B, T]`` bool, True at the first token of each document (the FFNs and iso_tanh read these)."""
    attention_mask: Any = None
    """The scoring's block-diagonal causal mask (``document_mask``), built once per forward for every layer."""


def document_starts(position_ids: torch.Tensor, batch: int) -> torch.Tensor | None:
    """``[batch, T]`` bool, True at the first token of each document; None when every row is one sequence.

    "One sequence" (the unpacked fast path, for a plain ``arange``) is decided only on the CPU, where reading the
    bool back costs no device sync. On a GPU, and under ``torch.compile``, nothing branches on data: the starts
    are returned as they are, a single document being a row with one start (the same outputs, through the packed
    forms), so a training step never waits on the device here.
    """
    restarts = _restarts(position_ids)
    if restarts.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(restarts.any()):
        return None
    return F.pad(restarts, (1, 0), value=True).expand(batch, -1)


def _restarts(position_ids: torch.Tensor) -> torch.Tensor:
    """``[..., T - 1]``: True where a position does not continue the previous one by 1."""
    return position_ids[..., 1:] != position_ids[..., :-1] + 1


def document_start_index(doc_starts: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: the position of the first token of each token's document."""
    positions = torch.arange(doc_starts.shape[-1], device=doc_starts.device)
    return torch.where(doc_starts, positions, 0).cummax(dim=-1).values


def same_document(doc_starts: torch.Tensor) -> torch.Tensor:
    """``[B, T, T]`` bool: query i and key j lie in the same document (block diagonal)."""
    document = doc_starts.long().cumsum(dim=-1)
    return document[:, :, None] == document[:, None, :]


def restarts_between_real_tokens(position_ids: torch.Tensor, real: torch.Tensor | None) -> bool:
    """Whether ``position_ids`` restart between two consecutive real tokens (``real`` ``[B, T]``, None: all
    real), i.e. mark packed documents: padding may carry any position (transformers gives left padding 1)."""
    restart = _restarts(position_ids)
    if real is not None:
        restart = restart & real[..., 1:] & real[..., :-1]
    return bool(restart.any())
