"""Packed documents: position_ids that restart at 0 keep the documents of one row apart, for every variant."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import iso_tanh_naive
from test_linear_attention import torch_linear_attn
from test_modeling import VARIANTS, VOCAB, build, tokens, variant_id
from torch.nn.attention.flex_attention import create_mask
from transformers import DataCollatorWithFlattening

from llm.model import IsoLLMCache
from llm.model.attention import ATTN_SCORING_REGISTRY, SoftmaxScoring, document_block_mask
from llm.model.iso_tanh import iso_tanh_chunked, iso_tanh_linear_attention
from llm.model.layout import PackedDocuments, document_starts, same_document

ROWS = [[5, 1, 9, 3, 6], [4, 8, 2, 10]]
"""Document lengths per row (24 tokens each). With iso_tanh's chunk of 4: starts inside a chunk, two in one
chunk, starts on chunk boundaries, and documents that span two and three chunks."""


def packed(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """Token ids ``[B, T]``, position ids restarting at each document, and each row's documents."""
    documents = [[tokens(1, n, seed=10 * r + i)[0] for i, n in enumerate(row)] for r, row in enumerate(rows)]
    ids = torch.stack([torch.cat(docs) for docs in documents])
    positions = torch.stack([torch.cat([torch.arange(len(doc)) for doc in docs]) for docs in documents])
    return ids, positions, documents


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_each_packed_document_gives_its_logits_alone(variant):
    model = build(**variant)
    ids, positions, documents = packed(ROWS)
    with torch.no_grad():
        logits = model(ids, position_ids=positions).logits
        for row, docs in enumerate(documents):
            start = 0
            for doc in docs:
                alone = model(doc[None]).logits[0]
                torch.testing.assert_close(logits[row, start:start + len(doc)], alone, rtol=0, atol=1e-12)
                start += len(doc)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_a_token_changes_nothing_outside_its_document_and_nothing_before_it(variant):
    """Causality (bitwise) and independence of the later documents in a packed row."""
    model = build(**variant)
    ids, positions, _ = packed(ROWS[:1])  # documents at 0, 5, 6, 15, 18
    with torch.no_grad():
        base = model(ids, position_ids=positions).logits
        for t, document_end in ((2, 5), (7, 15), (16, 18)):
            perturbed = ids.clone()
            perturbed[:, t] = (perturbed[:, t] + 1) % VOCAB
            logits = model(perturbed, position_ids=positions).logits
            assert torch.equal(logits[:, :t], base[:, :t])
            # iso_tanh's carried sums are differences of prefix sums: equal to rounding, not bitwise
            torch.testing.assert_close(logits[:, document_end:], base[:, document_end:], rtol=0, atol=1e-12)
            assert not torch.allclose(logits[:, t], base[:, t])


def test_position_ids_that_never_restart_are_the_unpacked_forward():
    model = build(ffn="isogmlp", isogmlp_gate="causal_mean", attn_scoring="iso_tanh")
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(model(ids, position_ids=torch.arange(ids.shape[1])[None]).logits, model(ids).logits)


def packed_qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 q, k, v for ROWS (GQA: 4 query heads over 2 KV heads) and their document starts ``[B, T]``."""
    q, k, v = (torch.randn(2, heads, 24, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i, heads in enumerate((4, 2, 2)))
    _, positions, _ = packed(ROWS)
    return q, k, v, F.pad(positions[:, 1:] != positions[:, :-1] + 1, (1, 0), value=True)


def assert_each_document_alone(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               alone=iso_tanh_naive) -> None:
    """``out`` on each document of ROWS equals ``alone(q, k, v)`` run on that document by itself."""
    for row, lengths in enumerate(ROWS):
        start = 0
        for n in lengths:
            piece = slice(start, start + n)
            want = alone(q[row:row + 1, :, piece], k[row:row + 1, :, piece], v[row:row + 1, :, piece])
            torch.testing.assert_close(out[row:row + 1, :, piece], want, rtol=0, atol=1e-12)
            start += n


@pytest.mark.parametrize("chunk", [1, 3, 4, 24])
def test_chunked_iso_tanh_restarts_its_sums_at_every_document(chunk):
    """The packed chunked form against the O(T^2) reference run on each document, fp64, GQA; the final state
    is the last document's sums."""
    q, k, v, starts = packed_qkv()
    out, (s, g) = iso_tanh_chunked(q, k, v, chunk, doc_starts=starts)
    assert_each_document_alone(out, q, k, v)
    for row, lengths in enumerate(ROWS):
        last = k[row, :, 24 - lengths[-1]:]
        torch.testing.assert_close(g[row], last.transpose(-1, -2) @ last, rtol=0, atol=1e-12)
        torch.testing.assert_close(s[row], last.transpose(-1, -2) @ v[row, :, 24 - lengths[-1]:], rtol=0, atol=1e-12)


def test_linear_attention_form_cuts_the_kernel_at_every_document():
    """The GPU form with a kernel that restarts its sums at each document start, against the reference on each
    document; fla's own kernel, its rows flattened and cut per document and per row: fla_interpreted.py."""
    q, k, v, starts = packed_qkv()
    out, state = iso_tanh_linear_attention(q, k, v, None, torch_linear_attn, doc_starts=starts)
    assert state is None
    assert_each_document_alone(out, q, k, v)


@pytest.mark.parametrize("variant", [dict(), dict(ffn="isogmlp", isogmlp_gate="causal_mean", attn_scoring="iso_tanh")],
                         ids=variant_id)
def test_a_flattened_batch_trains_on_each_document_alone(variant):
    """transformers' DataCollatorWithFlattening (one row, restarting position_ids, -100 at each document's first
    label): the loss and its gradient are those of the documents scored one by one, token-weighted."""
    model = build(**variant)
    documents = [tokens(1, n, seed=n)[0] for n in (7, 3, 11)]
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": doc.tolist()} for doc in documents])
    loss = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).loss
    (grad,) = torch.autograd.grad(loss, model.model.embed_tokens.weight)
    targets = sum(len(doc) - 1 for doc in documents)
    alone = sum(model(doc[None], labels=doc[None]).loss * (len(doc) - 1) for doc in documents) / targets
    (grad_alone,) = torch.autograd.grad(alone, model.model.embed_tokens.weight)
    torch.testing.assert_close(loss, alone, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, grad_alone, rtol=0, atol=1e-12)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_keeps_each_document_alone():
    """Softmax's CUDA path for packed documents (FlexAttention with the block mask built once per forward), run
    here on CPU: each document's output is its causal attention alone, as the dense mask gives it (fp64, GQA)."""
    q, k, v, starts = packed_qkv()
    scoring = SoftmaxScoring(None)
    flex, _ = scoring(q, k, v, documents=PackedDocuments(starts, document_block_mask(starts)))
    dense, _ = scoring(q, k, v, documents=PackedDocuments(starts, SoftmaxScoring.document_mask(starts)))

    def causal_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    for out in (flex, dense):
        assert_each_document_alone(out, q, k, v, alone=causal_softmax)


@pytest.mark.parametrize("attn_scoring", sorted(ATTN_SCORING_REGISTRY))
def test_packed_documents_with_a_cache_or_padding_are_refused_not_attended_across(attn_scoring):
    """Documents are kept apart only without a cache and without padding: with either, restarting position_ids
    raise instead of silently attending across documents (forward and generate())."""
    model = build(attn_scoring=attn_scoring)
    ids, positions, _ = packed(ROWS)
    with torch.no_grad(), pytest.raises(ValueError, match="packed documents"):
        model(ids, position_ids=positions, use_cache=True)
    mask = torch.ones_like(ids)
    mask[0, -1] = 0
    with torch.no_grad(), pytest.raises(ValueError, match="packed documents"):
        model(ids, position_ids=positions, attention_mask=mask)
    with pytest.raises(ValueError, match=r"generate\(\): position_ids restart"):
        model.generate(ids, position_ids=positions, max_new_tokens=2, do_sample=False)
    # transformers' positions for a left-padded row restart at the first real token: padding, not a document
    left = torch.tensor([[0, 0, 1, 1, 1]])
    hf_positions = (left.cumsum(-1) - 1).masked_fill(left == 0, 1)
    with torch.no_grad():
        model(ids[:1, :5], position_ids=hf_positions, attention_mask=left, use_cache=True)


@pytest.mark.parametrize("attn_scoring", sorted(ATTN_SCORING_REGISTRY))
def test_positions_that_restart_after_the_cache_are_refused(attn_scoring):
    """Two tokens at positions 0, 1 after 5 cached gave logits 0.08 off: refused as a restart inside a call is,
    before any state moves. Positions that continue each row's real tokens are those forward gives: accepted, with
    forward's logits, left padding included."""
    model = build(attn_scoring=attn_scoring)
    ids = tokens(seq=7)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # row 1: 3 real tokens in the cache
    for attention_mask, continuing in ((None, [[5, 6]]), (mask, [[5, 6], [3, 4]])):
        with torch.no_grad():
            cache = IsoLLMCache(2)
            model(ids[:, :5], attention_mask=None if attention_mask is None else attention_mask[:, :5], cache=cache)
            with pytest.raises(ValueError, match="restart between real tokens or after the cache's"):
                model(ids[:, 5:], position_ids=torch.tensor([[0, 1]]), attention_mask=attention_mask, cache=cache)
            assert cache.seen_tokens == 5
            state = [t.clone() for t in cache.tensors()]
            given = model(ids[:, 5:], position_ids=torch.tensor(continuing), attention_mask=attention_mask,
                          cache=cache).logits
            own = IsoLLMCache(2)
            model(ids[:, :5], attention_mask=None if attention_mask is None else attention_mask[:, :5], cache=own)
            assert all(torch.equal(a, b) for a, b in zip(own.tensors(), state, strict=True))
            torch.testing.assert_close(given, model(ids[:, 5:], attention_mask=attention_mask, cache=own).logits,
                                       rtol=0, atol=1e-12)


def test_document_starts_reads_nothing_back_off_the_cpu():
    """On a device (here ``meta``, which cannot be read back at all) the starts come without the one-sequence check's
    host sync; on the CPU, where that check is free, an ``arange`` is still the unpacked forward (None)."""
    positions = torch.arange(16)[None].expand(2, -1)
    assert document_starts(positions, 2) is None
    starts = document_starts(positions.to("meta"), 2)
    assert starts.device.type == "meta" and starts.shape == (2, 16)


@pytest.mark.slow
def test_compiled_document_block_mask_equals_the_dense_mask_and_never_syncs():
    """The block mask traced whole (``fullgraph=True``: a value read back would break the graph), as it is compiled
    on CUDA; its blocks are those of the dense block-diagonal causal mask, and its mask is that mask, elementwise."""
    starts = torch.zeros(2, 512, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, [100, 130, 400]] = True
    starts[1, 257] = True
    mask = torch.compile(document_block_mask, fullgraph=True)(starts)
    dense = same_document(starts).tril()[:, None]
    assert torch.equal(create_mask(mask.mask_mod, 2, 1, 512, 512), dense)
    blocks = dense.unflatten(2, (4, 128)).unflatten(4, (4, 128)).any(dim=(3, 5))
    assert torch.equal(mask.to_dense().bool(), blocks)
