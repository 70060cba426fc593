"""Position ids of packed windows: restart after every EOS, and the model then scores each document alone."""

from __future__ import annotations

import torch

from llm.data.packing import document_position_ids
from llm.model import IsoLLMConfig, IsoLLMForCausalLM

EOS = 1


def test_positions_restart_after_every_eos() -> None:
    inputs = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 3, 4, 5, 6, 7, 8, 9]])
    assert document_position_ids(inputs, EOS).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_a_window_of_documents_scores_each_alone() -> None:
    """A window cut from the stream (its first document started before it): each piece between EOS tokens,
    with its EOS, gives the logits it gives alone."""
    torch.manual_seed(0)
    model = IsoLLMForCausalLM(IsoLLMConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, ffn="isogmlp",
                                           isogmlp_gate="causal_mean", attn_scoring="iso_tanh",
                                           iso_tanh_chunk_size=4)).double().eval()
    pieces = [torch.tensor([9, 8, 7, EOS]), torch.tensor([3, 4, 5, 6, 7, 2, EOS]), torch.tensor([11, 12, 13])]
    inputs = torch.cat(pieces)[None]
    with torch.no_grad():
        logits = model(inputs, position_ids=document_position_ids(inputs, EOS)).logits[0]
        start = 0
        for piece in pieces:
            alone = model(piece[None]).logits[0]
            torch.testing.assert_close(logits[start:start + len(piece)], alone, rtol=0, atol=1e-12)
            start += len(piece)
