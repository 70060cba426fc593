"""Document boundaries inside packed windows, as the model reads them (``data.document_masking``).

The stream packs documents back to back, each followed by EOS (``llm.data.stream``), into windows of
``seq_len + 1`` tokens. With document masking, a window's inputs get ``position_ids`` that restart at 0 at every
document start: the window's first token, and every token that follows an EOS. The model then scores each
document as if alone (llm/model/layout.py), RoPE positions included. The EOS token itself closes its document:
it is predicted from that document, and its output (the prediction of the next document's first token) sees only
the document it closes, as without masking.
"""

from __future__ import annotations

import torch

__all__ = ["document_position_ids", "model_inputs"]


def document_position_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``[B, T]`` positions of ``inputs`` ``[B, T]`` counted from each one's document start (0 after an EOS)."""
    positions = torch.arange(inputs.shape[-1], device=inputs.device).expand_as(inputs)
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[:, 1:] = inputs[:, :-1] == eos_id
    return positions - torch.where(starts, positions, 0).cummax(dim=-1).values


def model_inputs(inputs: torch.Tensor, document_eos: int | None) -> dict[str, torch.Tensor]:
    """The model's keyword inputs for window inputs ``[B, T]``: ``input_ids``, plus ``position_ids`` restarting
    after every ``document_eos`` when documents are masked (``data.document_masking``; None: not masked)."""
    if document_eos is None:
        return {"input_ids": inputs}
    return {"input_ids": inputs, "position_ids": document_position_ids(inputs, document_eos)}
