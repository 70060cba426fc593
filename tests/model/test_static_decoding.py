"""A static cache (``IsoLLMCache(num_layers, max_length)``): after the prompt every one-token step updates the
state in place, with the same shapes and no value read back to the host, so that CUDA replays it as one captured
graph. Every variant decodes as with the growing cache, in ``forward`` and in ``generate()``."""

from __future__ import annotations

import pytest
import torch
from test_modeling import CACHE_ARG, CACHE_VARIANTS, build, tokens, variant_id

from llm.model import IsoLLMCache, static_decoding

PROMPT, STEPS = 6, 5


def padded_batch(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows: left-padded, padded at one decoding step, unpadded."""
    ids = tokens(batch=3, seq=PROMPT + STEPS).to(device)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, PROMPT + 2] = 0
    return ids, mask


@torch.no_grad()
def decode(model, ids: torch.Tensor, mask: torch.Tensor, cache: IsoLLMCache) -> torch.Tensor:
    """The prompt, then one token per call; the last logits of every call, ``[STEPS + 1, B, V]``."""
    logits = [model(ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], cache=cache).logits[:, -1]]
    for t in range(PROMPT, ids.shape[1]):
        logits.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits[:, -1])
    return torch.stack(logits)


def real_steps(mask: torch.Tensor) -> torch.Tensor:
    """``[STEPS + 1, B]``: which calls' last token is real (a padded step's logits mean nothing)."""
    return mask[:, PROMPT - 1:].T.bool()


@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=variant_id)
def test_static_cache_decodes_as_the_growing_cache(variant):
    """fp64: the buffers, their key mask and the in-place sums give the growing cache's logits; padded prompts
    and a padded step included."""
    model = build(**variant)
    ids, mask = padded_batch()
    growing = decode(model, ids, mask, IsoLLMCache(2))
    cache = IsoLLMCache(2, max_length=PROMPT + STEPS)
    static = decode(model, ids, mask, cache)
    assert cache.decoding is not None and cache.seen_tokens == PROMPT + STEPS
    real = real_steps(mask)
    torch.testing.assert_close(static[real], growing[real], rtol=0, atol=1e-12)


@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=variant_id)
def test_a_step_changes_every_state_in_place(variant):
    """What a replayed CUDA graph relies on: it reads and writes the memory it was captured with, so a step that
    put a new tensor in the cache would decode every later token from a stale state. Each step keeps the same
    tensors at the same addresses, and none is added."""
    model = build(**variant)
    ids, mask = padded_batch()
    cache = IsoLLMCache(2, max_length=PROMPT + STEPS)
    with torch.no_grad():
        model(ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], cache=cache)
        held = cache.tensors()  # kept alive: no id is reused
        addresses = [(id(state), state.data_ptr()) for state in held]
        for t in range(PROMPT, ids.shape[1]):
            model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache)
            assert [(id(state), state.data_ptr()) for state in cache.tensors()] == addresses


@pytest.mark.parametrize("variant", CACHE_VARIANTS[:4], ids=variant_id)
def test_generate_with_a_static_cache_equals_generate_without(variant):
    """Greedy with left padding, and beam search, whose reorder_cache moves the rows in place."""
    model = build(dtype=torch.float32, **variant)
    prompt, mask = padded_batch()
    prompt, mask = prompt[:, :PROMPT], mask[:, :PROMPT]
    for kwargs in (dict(attention_mask=mask), dict(num_beams=3, early_stopping=False)):
        kwargs |= dict(max_new_tokens=STEPS, do_sample=False)
        static = IsoLLMCache(2, max_length=PROMPT + STEPS)
        assert torch.equal(model.generate(prompt, **{CACHE_ARG: static}, **kwargs), model.generate(prompt, **kwargs))
        assert static.decoding is not None


@pytest.mark.slow
@pytest.mark.parametrize("variant", CACHE_VARIANTS[:4], ids=variant_id)
def test_the_decoding_step_is_one_graph_for_every_step(variant, monkeypatch):
    """What CUDA graph capture needs, checked on CPU: ``fullgraph=True`` fails on a host sync or a branch on data,
    and one compilation for every step means the same shapes at each (the slot and positions live on the
    device). The in-place updates survive compilation: the logits are eager's."""
    graphs = []

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        graphs.append(graph)
        return graph.forward

    model = build(**variant)
    ids, mask = padded_batch()
    eager = decode(model, ids, mask, IsoLLMCache(2, max_length=PROMPT + STEPS))
    torch._dynamo.reset()
    compiled_step = torch.compile(static_decoding.decode_step, fullgraph=True, backend=counting_backend)
    monkeypatch.setattr(static_decoding, "decode_step", compiled_step)
    compiled = decode(model, ids, mask, IsoLLMCache(2, max_length=PROMPT + STEPS))
    assert len(graphs) == 1
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-12)


def test_a_static_cache_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="max_length must be a positive number of tokens, got 0"):
        IsoLLMCache(2, max_length=0)
    model = build()
    ids = tokens(seq=PROMPT + 2)
    with torch.no_grad(), pytest.raises(ValueError, match="prompt has 6 tokens, more than the static cache's "
                                                          "max_length 4"):
        model(ids[:, :PROMPT], cache=IsoLLMCache(2, max_length=4))
    cache = IsoLLMCache(2, max_length=PROMPT + 1)
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache)
        with pytest.raises(ValueError, match=r"one token per call after its prompt.*got 2 tokens"):
            model(ids[:, PROMPT:], cache=cache)
        model.config.output_hidden_states = True  # a captured step's layers run unhooked: asked, refused
        with pytest.raises(ValueError, match="static cache's steps take input_ids, without output_attentions or "
                                             "output_hidden_states"):
            model(ids[:, PROMPT:PROMPT + 1], cache=cache)
        model.config.output_hidden_states = False
    with pytest.raises(ValueError, match="autograd on"):
        model(ids[:, PROMPT:PROMPT + 1], cache=cache)
    with torch.no_grad():
        model(ids[:, PROMPT:PROMPT + 1], cache=cache)
        with pytest.raises(ValueError, match="static cache is full: it holds max_length=7 tokens"):
            model(ids[:, PROMPT + 1:], cache=cache)
    assert cache.seen_tokens == PROMPT + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", CACHE_VARIANTS[:4], ids=variant_id)
def test_cuda_graph_decoding_equals_the_growing_cache(variant):
    """On CUDA each step after the prompt is a replay of the graph captured at the first: fp32, against the
    growing cache's kernels (flash for one query) at fp32 rounding."""
    model = build(dtype=torch.float32, **variant).cuda()
    ids, mask = padded_batch("cuda")
    growing = decode(model, ids, mask, IsoLLMCache(2))
    cache = IsoLLMCache(2, max_length=PROMPT + STEPS)
    static = decode(model, ids, mask, cache)
    assert cache.decoding.graph is not None
    real = real_steps(mask)
    torch.testing.assert_close(static[real], growing[real], rtol=1e-4, atol=1e-5)


def test_cache_implementation_static_decodes_through_the_static_cache(monkeypatch):
    """transformers' own way to ask for a static cache gets this model's, sized as transformers sizes its own."""
    model = build(dtype=torch.float32)
    prompt = tokens(seq=PROMPT)
    steps = []
    decode_step = static_decoding.decode_step
    monkeypatch.setattr(static_decoding, "decode_step",
                        lambda model, ids, real, cache: steps.append(cache) or decode_step(model, ids, real, cache))
    kwargs = dict(max_new_tokens=STEPS, do_sample=False)
    static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(static, model.generate(prompt, **kwargs))
    assert len(steps) == STEPS - 1 and steps[0].max_length == PROMPT + STEPS - 1  # the last token is not fed


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5},
                                  {"rope_type": "linear", "factor": 2.0}], ids=["yarn_partial", "linear"])
def test_static_cache_rotates_as_the_growing_cache_with_scaled_rope(rope):
    model = build(rope_parameters=rope)
    ids, mask = padded_batch()
    static, growing = (decode(model, ids, mask, IsoLLMCache(2, max_length=n)) for n in (PROMPT + STEPS, None))
    torch.testing.assert_close(static[real_steps(mask)], growing[real_steps(mask)], rtol=0, atol=1e-12)


def test_a_static_cache_refuses_a_rope_that_follows_the_sequence_length():
    model = build(rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with torch.no_grad(), pytest.raises(ValueError, match=r"^a static cache cannot decode with rope_type=dynamic, "
                                                          r"whose frequencies follow the sequence length"):
        model(tokens(seq=PROMPT), cache=IsoLLMCache(2, max_length=PROMPT + 1))
