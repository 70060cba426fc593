"""What transformers' trainers and decoding strategies expect of a model in the library itself: logits with the
loss in training, ``num_items_in_batch`` (``Trainer``'s gradient accumulation), a head that survives
``resize_token_embeddings``, and assisted / prompt-lookup decoding (cropping the cache). The clients themselves run
in tests/hf/test_clients.py."""

from __future__ import annotations

import pytest
import torch
from test_modeling import VOCAB, build, tokens
from torch import nn

from llm.model.lm_head import IGNORE_INDEX
from llm.model.modeling_isollm import CACHE_ARG


@pytest.mark.parametrize("fused", [False, True])
def test_training_forwards_return_logits_unless_the_fused_loss_is_asked_and_the_losses_agree(fused):
    model = build().train()
    ids = tokens()
    out = model(ids, labels=ids, fused_loss=fused)
    if fused:
        assert out.logits is None
    else:
        assert out.logits.shape == (*ids.shape, VOCAB)
        shifted = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), IGNORE_INDEX)], dim=1)
        torch.testing.assert_close(out.loss, nn.functional.cross_entropy(out.logits.flatten(0, 1), shifted.flatten()),
                                   rtol=1e-13, atol=0)
    torch.testing.assert_close(out.loss, build().eval()(ids, labels=ids).loss, rtol=1e-12, atol=0)


@pytest.mark.parametrize("fused", [False, True])
def test_num_items_in_batch_makes_accumulated_micro_batches_the_mean_over_every_target(fused):
    """Gradient accumulation as transformers' loss functions do it: micro-batches with unequal targets, each loss
    the sum over its targets over the step's count, add up to the whole batch's mean loss and gradient."""
    model = build().train()
    ids = tokens(4)
    labels = ids.clone()
    labels[0, 3:] = labels[2, 7:] = IGNORE_INDEX  # unequal targets per row
    labels[3] = IGNORE_INDEX  # a micro-batch row without any: it adds 0
    whole = model(ids, labels=labels, fused_loss=fused).loss
    want = torch.autograd.grad(whole, list(model.parameters()))
    count = (labels[:, 1:] != IGNORE_INDEX).sum()
    parts = [model(ids[rows], labels=labels[rows], fused_loss=fused, num_items_in_batch=count).loss
             for rows in (slice(0, 1), slice(1, 3), slice(3, 4))]
    assert parts[-1] == 0
    torch.testing.assert_close(sum(parts), whole, rtol=1e-12, atol=0)
    for got, expected in zip(torch.autograd.grad(sum(parts), list(model.parameters())), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-14)


def test_an_untied_head_survives_resize_token_embeddings_and_set_output_embeddings_and_trains():
    model = build(tie_word_embeddings=False).train()
    model.resize_token_embeddings(VOCAB + 8)
    assert type(model.lm_head) is nn.Linear  # transformers' own head replaces the package's
    ids = tokens()
    for fused in (False, True):  # the fused loss needs the package's head: the plain one reads the logits
        out = model(ids, labels=ids, fused_loss=fused)
        out.loss.backward()
        assert out.logits.shape[-1] == VOCAB + 8 and model.lm_head.weight.grad.abs().max() > 0
    model.set_output_embeddings(nn.Linear(32, VOCAB + 8, bias=False).double())
    model(ids, labels=ids).loss.backward()
    assert model.lm_head.weight.grad.abs().max() > 0


def lookup_prompt() -> torch.Tensor:
    """A prompt that repeats itself, so that prompt lookup proposes drafts, some of them rejected."""
    return torch.tensor([[5, 9, 14, 3, 5, 9, 14, 7, 5, 9, 14]])


@pytest.mark.parametrize("variant", [dict(), dict(ffn="isogmlp"), dict(ffn="iso_ln", ffn_linear="focus")],
                         ids=["swiglu", "isogmlp", "iso_ln_focus"])
def test_assisted_and_prompt_lookup_decoding_of_softmax_equal_greedy_decoding(variant):
    model, draft = build(**variant), build(seed=1, **variant)
    ids = lookup_prompt()
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False)
    for strategy in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=draft)):
        torch.testing.assert_close(model.generate(ids, max_new_tokens=12, do_sample=False, **strategy), greedy,
                                   rtol=0, atol=0, msg=str(strategy))


@pytest.mark.parametrize(("variant", "named"), [(dict(attn_scoring="iso_tanh"), "attn_scoring=iso_tanh"),
                                                (dict(ffn="isogmlp", isogmlp_gate="causal_mean"),
                                                 "isogmlp_gate=causal_mean")])
def test_decoding_that_drops_draft_tokens_is_refused_in_one_line_naming_the_state_that_cannot(variant, named):
    """Refused before decoding starts, and by the cache itself (a softmax model's draft of that kind)."""
    model, draft = build(**variant), build(seed=1, **variant)
    refusal = f"prompt-lookup decoding drop rejected draft tokens from the cache, but {named}"
    for strategy in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=draft)):
        with pytest.raises(NotImplementedError, match=refusal) as err:
            model.generate(lookup_prompt(), max_new_tokens=12, do_sample=False, **strategy)
        assert "\n" not in str(err.value)
    cache = getattr(model(lookup_prompt(), use_cache=True), CACHE_ARG)
    with pytest.raises(NotImplementedError, match=refusal):
        cache.crop(-2)
