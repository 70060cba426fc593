"""generate() and the cache: every variant's cached greedy, beam and sampled generation against recomputation,
the iso_tanh state's size, the cache's public hooks, and padded batches (each row's logits and generation alone)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_modeling import CACHE_VARIANTS, VOCAB, T, build, tokens, variant_id
from transformers import GenerationMixin

from llm.model import IsoLLMCache, IsoLLMForCausalLM
from llm.model.attention import ATTN_SCORING_REGISTRY
from llm.model.modeling_isollm import CACHE_ARG


def test_iso_tanh_generation_state_does_not_grow_with_length():
    """iso_tanh carries (S, G) of fixed size [B, Hkv, D, D] per layer: no KV cache."""
    model = build(attn_scoring="iso_tanh")
    with torch.no_grad():
        cache = model(tokens(seq=3), use_cache=True)[CACHE_ARG]
        shapes = [tuple(t.shape) for layer in cache.layers for t in layer.attention]
        model(tokens(seq=T), cache=cache, use_cache=True)
    assert shapes == [tuple(t.shape) for layer in cache.layers for t in layer.attention]
    assert set(shapes) == {(2, 2, 8, 8)}


def greedy_by_recomputation(model: IsoLLMForCausalLM, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Reference decoding: the full forward over the whole sequence at every step, no cache."""
    seq = prompt
    with torch.no_grad():
        for _ in range(steps):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=variant_id)
def test_generate_with_cache_equals_greedy_recomputation(variant):
    # fp32, as generate() is used; random tiny models have near-tied logits now and then, so the
    # seed is fixed and the argmax gaps are far above fp32 rounding.
    model = build(dtype=torch.float32, **variant)
    prompt = tokens(seq=5)
    out = model.generate(prompt, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out[CACHE_ARG], IsoLLMCache)
    assert out[CACHE_ARG].get_seq_length() == 5 + 10 - 1  # the last token is sampled, never fed
    assert torch.equal(out.sequences, greedy_by_recomputation(model, prompt, 10))
    no_cache = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False)
    assert torch.equal(no_cache, out.sequences)


def test_a_generation_step_whose_state_did_not_come_back_raises(monkeypatch):
    """If generate() stops handing the model its state (as transformers 5.24's rename of past_key_values to
    cache did to the private hooks this model used to override), decoding fails loudly at the second step
    instead of predicting every token without its past."""
    model = build(dtype=torch.float32)
    forward = type(model).forward

    def forward_losing_the_state(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out[CACHE_ARG] = None
        return out

    monkeypatch.setattr(type(model), "forward", forward_losing_the_state)
    with pytest.raises(RuntimeError, match=r"generate\(\) continues after 5 tokens but the model's cache holds 0"):
        model.generate(tokens(seq=5), max_new_tokens=3, do_sample=False)


def test_generate_continues_from_a_cache_the_caller_passes():
    """A user's cache, filled by a forward over the start of the prompt, continues: under the name the
    installed transformers reads and under past_key_values, which 5.24 still accepts as an alias."""
    model = build(dtype=torch.float32, attn_scoring="iso_tanh")
    prompt = tokens(seq=5)
    expected = greedy_by_recomputation(model, prompt, 6)
    for name in sorted({CACHE_ARG, "past_key_values"}):
        with torch.no_grad():
            cache = model(prompt[:, :4], use_cache=True)[CACHE_ARG]
        with warnings.catch_warnings():  # 5.24 warns that past_key_values is its deprecated alias
            warnings.simplefilter("ignore", FutureWarning)
            out = model.generate(prompt, max_new_tokens=6, do_sample=False, **{name: cache})
        assert torch.equal(out, expected), name
        assert cache.get_seq_length() == 5 + 6 - 1


def test_generation_goes_through_public_hooks_only():
    """No private ``GenerationMixin`` method is overridden: such a hook changes without notice between
    transformers releases (5.24 renamed the state its cache hook wrote). ``prepare_inputs_for_generation`` is
    the documented one."""
    ours = [cls for cls in IsoLLMForCausalLM.__mro__ if cls.__module__.startswith("llm.")]  # generation.py's mixin too
    own = {name for cls in ours for name in vars(cls) if name.startswith("_") and not name.startswith("__")}
    assert own & set(dir(GenerationMixin)) == set()
    assert any("prepare_inputs_for_generation" in vars(cls) for cls in ours)


@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=variant_id)
def test_reorder_cache_selects_every_state_of_the_chosen_rows(variant):
    """Attention and FFN states alike: continuing a reordered cache equals running the reordered batch."""
    model = build(**variant)
    ids = tokens(batch=3)
    rows = torch.tensor([2, 0, 0])
    with torch.no_grad():
        cache = model(ids[:, :6], use_cache=True)[CACHE_ARG]
        cache.reorder_cache(rows)
        continued = model(ids[rows, 6:], cache=cache).logits
        torch.testing.assert_close(continued, model(ids[rows]).logits[:, 6:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=variant_id)
def test_beam_search_with_cache_equals_beam_search_without(variant):
    """Beam search reorders the cache's states (reorder_cache); recomputation needs none. With this
    seed the beams swap places at most steps, so skipping the reorder changes the output."""
    model = build(seed=1, dtype=torch.float32, **variant)
    prompt = tokens(seq=4, seed=1)
    kwargs = dict(max_new_tokens=8, num_beams=4, num_return_sequences=2, do_sample=False,
                  early_stopping=False)
    assert torch.equal(model.generate(prompt, **kwargs), model.generate(prompt, use_cache=False, **kwargs))


@pytest.mark.parametrize("scoring", sorted(ATTN_SCORING_REGISTRY))
def test_sampling_generate(scoring):
    model = build(dtype=torch.float32, attn_scoring=scoring)
    prompt = tokens(seq=4)
    torch.manual_seed(1)
    first = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(1)
    again = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=20)
    assert first.shape == (2, 12) and torch.equal(first[:, :4], prompt) and torch.equal(first, again)
    assert int(first.max()) < VOCAB
    top1 = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=1)
    assert torch.equal(top1, greedy_by_recomputation(model, prompt, 8))


def pad(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` padded to one length on ``side`` with random tokens (whatever the padding holds must not
    matter) and their attention mask."""
    width = max(len(row) for row in rows)
    ids = tokens(len(rows), width, seed=99)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        real = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, real], mask[i, real] = row, 1
    return ids, mask


LENGTHS = [T, 5, 1, 9]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=variant_id)
def test_each_row_of_a_padded_batch_gives_its_logits_alone(variant, side):
    model = build(**variant)
    rows = [tokens(1, n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = pad(rows, side)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        for i, row in enumerate(rows):
            alone = model(row[None]).logits[0]
            torch.testing.assert_close(logits[i, mask[i].bool()], alone, rtol=0, atol=1e-12)
            if side == "right":  # padding repeats the last real token's logits: logits[:, -1] predicts the next
                torch.testing.assert_close(logits[i, len(row):], alone[-1].expand(ids.shape[1] - len(row), -1),
                                           rtol=0, atol=1e-12)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=variant_id)
def test_generate_on_a_padded_batch_gives_each_prompt_its_generation_alone(variant, side):
    """Greedy tokens and every step's logits (which generate() returns in fp32): the KV cache or (S, G)
    sums, the FFN's running means and the positions all skip the padding; prefill, then single tokens.
    (The prompt alone gets an explicit mask: generate() would otherwise mask its pad_token_id.)"""
    model = build(**variant)
    rows = [tokens(1, n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = pad(rows, side)
    kwargs = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True,
                  pad_token_id=0)
    batch = model.generate(ids, attention_mask=mask, **kwargs)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], attention_mask=torch.ones(1, len(row), dtype=torch.long), **kwargs)
        assert torch.equal(batch.sequences[i, ids.shape[1]:], alone.sequences[0, len(row):])
        for step, (got, want) in enumerate(zip(batch.logits, alone.logits, strict=True)):
            torch.testing.assert_close(got[i], want[0], rtol=0, atol=1e-12, msg=lambda m, s=step: f"step {s}: {m}")


@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=variant_id)
def test_a_padded_generation_step_reads_nothing_back_to_the_host(variant, monkeypatch):
    """A step after the prefill (one token, its mask grown by one) never waits on the device: no tensor is
    turned into a Python bool or number, so GPU decoding runs ahead of the host."""
    model = build(**variant)
    ids, mask = pad([tokens(1, n, seed=i)[0] for i, n in enumerate(LENGTHS)], "left")
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True)[CACHE_ARG]
        expected = model(torch.cat([ids, ids[:, -1:]], dim=1), attention_mask=F.pad(mask, (0, 1), value=1)).logits

        def read_back(*args, **kwargs):
            raise AssertionError("a generation step read a tensor back to the host")

        for name in ("__bool__", "__int__", "__float__", "item", "tolist"):
            monkeypatch.setattr(torch.Tensor, name, read_back)
        step = model(ids[:, -1:], attention_mask=F.pad(mask, (0, 1), value=1), cache=cache).logits
        monkeypatch.undo()
    torch.testing.assert_close(step[:, -1], expected[:, -1], rtol=0, atol=1e-12)


def test_an_all_ones_mask_is_no_mask_and_a_misshapen_one_is_refused():
    model = build()
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=torch.ones_like(ids)).logits, model(ids).logits)
        mask = torch.ones_like(ids)[:, 1:]
        mask[0, 0] = 0
        with pytest.raises(ValueError, match=r"attention_mask must be \[batch, past \+ new tokens\]"):
            model(ids, attention_mask=mask)
