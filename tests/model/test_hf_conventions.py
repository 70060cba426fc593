"""What transformers' own models do beyond logits: attention implementations that run what they are named after,
attention weights (softmax's and iso_tanh's eq. 16), ``inputs_embeds`` in ``generate``, the base model and heads
behind the Auto classes. (transformers' common suite runs on every class too: tests/hf/test_transformers_common.py.)"""

from __future__ import annotations

import pytest
import torch
from reference import iso_tanh_naive
from test_generation import pad
from test_modeling import VOCAB, T, build, tokens
from transformers import AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification

import llm  # noqa: F401  (registers the Auto classes)
from llm.model import (
    IsoLLMConfig,
    IsoLLMForCausalLM,
    IsoLLMForSequenceClassification,
    IsoLLMForTokenClassification,
    IsoLLMModel,
)
from llm.model import attention as attention_module
from llm.model.attention import IsoTanhScoring, SoftmaxScoring

KERNELS = {"sdpa": "scaled_dot_product_attention", "flex_attention": "flex_attention"}
"""The function each non-eager implementation must call (``eager`` calls neither)."""


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = dict.fromkeys(KERNELS, 0)

    def spy(name: str, real):
        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return counted

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention",
                        spy("sdpa", attention_module.F.scaled_dot_product_attention))
    monkeypatch.setattr(attention_module, "flex_attention", spy("flex_attention", attention_module.flex_attention))
    return calls


@pytest.mark.parametrize("padded", [False, True])
def test_each_attn_implementation_runs_its_kernel_and_all_give_the_same_logits(monkeypatch, tmp_path, padded):
    """Chosen at load (``attn_implementation=``) and switched with ``set_attn_implementation``: eager computes the
    score matrix itself, sdpa calls SDPA, flex_attention FlexAttention; in fp64 all agree, padded rows included."""
    build().save_pretrained(tmp_path)
    ids, mask = pad([tokens(1, n, seed=i)[0] for i, n in enumerate([T, 5])], "left") if padded else (tokens(), None)
    calls = count_kernel_calls(monkeypatch)
    logits = {}
    switched = IsoLLMModel.from_pretrained(tmp_path, dtype=torch.float64)
    for name in ("eager", "sdpa", "flex_attention"):
        loaded = IsoLLMModel.from_pretrained(tmp_path, attn_implementation=name, dtype=torch.float64)
        switched.set_attn_implementation(name)
        for model in (loaded, switched):
            assert model.config._attn_implementation == name
            before = dict(calls)
            with torch.no_grad():
                logits[name] = model(ids, attention_mask=mask).last_hidden_state
            ran = {kernel for kernel in KERNELS if calls[kernel] > before[kernel]}
            assert ran == ({name} if name in KERNELS else set()), (name, ran)
    torch.testing.assert_close(logits["sdpa"], logits["eager"], rtol=0, atol=1e-12)
    torch.testing.assert_close(logits["flex_attention"], logits["eager"], rtol=0, atol=1e-12)


def qkv(b: int = 2, h: int = 4, hkv: int = 2, t: int = T, d: int = 8) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, heads, t, d, generator=gen, dtype=torch.float64) for heads in (h, hkv, hkv))


def test_attention_weights_are_each_scorings_own_and_give_its_output():
    """softmax: ``softmax(q k^T / sqrt(D))`` over the causal keys; iso_tanh: eq. 16's ``g(|s_i|) s_ij``, whose rows
    have norm ``tanh(|s_i|)``. Either way ``weights @ v`` is the output without weights (the linear forms')."""
    q, k, v = qkv()
    ref_k, ref_v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    config = IsoLLMConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          iso_tanh_chunk_size=4)
    for scoring in (SoftmaxScoring(config), IsoTanhScoring(config)):
        weights = []
        out, _ = scoring(q, k, v, weights=weights)
        (w,) = weights
        assert w.shape == (2, 4, T, T) and not w[..., ~causal].any()
        plain, _ = scoring(q, k, v)
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-12)
        torch.testing.assert_close(w @ ref_v, plain, rtol=0, atol=1e-12)
    scores = (q @ ref_k.transpose(-1, -2) / 8**0.5).masked_fill(~causal, 0.0)
    torch.testing.assert_close(w.norm(dim=-1), scores.norm(dim=-1).tanh(), rtol=0, atol=1e-12)
    torch.testing.assert_close(w @ ref_v, iso_tanh_naive(q, k, v), rtol=0, atol=1e-12)


@pytest.mark.parametrize("scoring", ["softmax", "iso_tanh"])
def test_output_attentions_on_a_padded_batch_gives_each_row_its_weights_alone(scoring):
    model = build(attn_scoring=scoring)
    model.set_attn_implementation("eager")
    rows = [tokens(1, n, seed=i)[0] for i, n in enumerate([T, 5])]
    ids, mask = pad(rows, "left")
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, output_attentions=True).attentions
        alone = model(rows[1][None], output_attentions=True).attentions
    assert len(batch) == len(alone) == model.config.num_hidden_layers
    for got, want in zip(batch, alone, strict=True):
        torch.testing.assert_close(got[1, :, -5:, -5:], want[0], rtol=0, atol=1e-12)
        assert not got[1, :, -5:, :-5].any()  # no real query sees a padded key


def test_generate_gives_softmax_weights_and_iso_tanh_refuses_those_it_does_not_have():
    """Each softmax step's weights cover every key so far; after a cache iso_tanh holds the sums (S, G), not the
    keys, so generate() with output_attentions is refused in one line rather than answered with None."""
    kwargs = dict(max_new_tokens=2, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    steps = build().generate(tokens(1, 4), **kwargs).attentions
    assert [layers[0].shape[-2:] for layers in steps] == [(4, 4), (1, 5)]
    with pytest.raises(ValueError, match=r"^output_attentions: iso_tanh's cache keeps the sums \(S, G\)"):
        build(attn_scoring="iso_tanh").generate(tokens(1, 4), **kwargs)


def test_output_flags_come_from_the_config_too_and_return_dict_false_gives_the_tuple():
    model = build()
    model.set_attn_implementation("eager")  # transformers' config refuses output_attentions under sdpa
    model.config.output_hidden_states = model.config.output_attentions = True
    with torch.no_grad():
        out = model(tokens())
        as_tuple = model(tokens(), return_dict=False)
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    assert len(as_tuple) == len(out.to_tuple()) == 3  # logits, hidden states, attentions: the set fields in order
    torch.testing.assert_close(as_tuple[0], out.logits, rtol=0, atol=0)


@pytest.mark.parametrize("scoring", ["softmax", "iso_tanh"])
def test_generate_from_inputs_embeds_equals_generate_from_ids(scoring):
    """Soft prompts: a left-padded batch of prompt embeddings generates the tokens its ids generate."""
    model = build(attn_scoring=scoring)
    ids, mask = pad([tokens(1, n, seed=i)[0] for i, n in enumerate([T, 5])], "left")
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    from_ids = model.generate(ids, **kwargs)
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), **kwargs)
    assert torch.equal(from_embeds, from_ids[:, ids.shape[1]:])
    alone = tokens(1, 5)  # no mask at all: generate() drops an all-ones one
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(alone), max_new_tokens=4, do_sample=False)
    assert torch.equal(from_embeds, model.generate(alone, max_new_tokens=4, do_sample=False)[:, 5:])


def test_the_auto_classes_build_the_base_model_and_heads_and_a_head_loads_a_checkpoint(tmp_path, caplog):
    """AutoModel and the classification Auto classes take the isollm config; a causal-LM checkpoint loads into a
    head with the base weights as saved and only ``score`` initialised, which transformers reports."""
    causal = build(dtype=torch.float32)
    causal.save_pretrained(tmp_path)
    config = IsoLLMConfig(**{**causal.config.to_dict(), "num_labels": 3})
    assert type(AutoModel.from_config(config)) is IsoLLMModel
    assert type(AutoModelForTokenClassification.from_config(config)) is IsoLLMForTokenClassification
    head, info = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3, output_loading_info=True)
    assert type(head) is IsoLLMForSequenceClassification
    assert info["missing_keys"] == {"score.weight"} and not info["mismatched_keys"]
    saved = causal.model.state_dict()
    for name, value in head.model.state_dict().items():
        assert torch.equal(value, saved[name]), name


@pytest.mark.parametrize("variant", [dict(ffn="swiglu", ffn_linear="linear"),  # a block without parameters of its own
                                     dict(ffn="isogmlp", ffn_linear="focus"),
                                     dict(ffn="iso_ln", ffn_linear="affine_like")])
def test_weights_a_checkpoint_lacks_are_initialised_and_the_loaded_ones_kept(tmp_path, variant):
    """transformers reports the keys a checkpoint lacks as "newly initialized": this package's FFN blocks and
    projections (which transformers' default init does not know) are, by their own ``reset_parameters``, instead of
    keeping the uninitialised memory of the meta-device build; every loaded value stays bit for bit; and building
    the model for real draws what it always drew (the seed's weights do not depend on this)."""
    from safetensors.torch import load_file, save_file

    config = IsoLLMConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=36, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, **variant)
    torch.manual_seed(0)
    model = IsoLLMForCausalLM(config)
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 IsoLLMForCausalLM(config).state_dict().values(), strict=True))
    with torch.no_grad():  # loaded values unlike any init
        for param in model.parameters():
            param.add_(0.5)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    missing = [key for key in saved if key.startswith("model.layers.1.mlp.")]
    save_file({key: value for key, value in saved.items() if key not in missing}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = IsoLLMForCausalLM.from_pretrained(tmp_path).state_dict()
    fresh = IsoLLMForCausalLM(config).state_dict()  # what init gives, where it is not random
    for key in saved:
        if key not in missing:
            assert torch.equal(loaded[key], saved[key]), key
        elif key.endswith("weight") and loaded[key].dim() == 2:
            assert abs(loaded[key].std().item() - config.initializer_range) < 0.004, key
        else:
            assert torch.equal(loaded[key], fresh[key]), key
