"""The decoder: causality of every variant, cached decoding, generate(), loss, tying, parameter counts."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationMixin

from llm.model import IsoLLMCache, IsoLLMConfig, IsoLLMForCausalLM, ModelConfig, param_counts
from llm.model.attention import ATTN_SCORING_REGISTRY
from llm.model.ffn import FFN_REGISTRY, ISOGMLP_GATES
from llm.model.fused_ops import RMSNorm, _RMSNorm, apply_rotary
from llm.model.linear import LINEAR_REGISTRY
from llm.model.modeling_isollm import CACHE_ARG, rotary_cos_sin

VOCAB, T = 256, 12
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
            iso_tanh_chunk_size=4)  # T = 3 chunks: the state carried across chunks is exercised


def build(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> IsoLLMForCausalLM:
    torch.manual_seed(seed)
    return IsoLLMForCausalLM(IsoLLMConfig(**{**TINY, **overrides})).to(dtype).eval()


def tokens(batch: int = 2, seq: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


VARIANTS = [dict(ffn=f, attn_scoring=a) for f, a in itertools.product(sorted(FFN_REGISTRY),
                                                                         sorted(ATTN_SCORING_REGISTRY))]
VARIANTS += [dict(ffn="isogmlp", isogmlp_gate=g, attn_scoring=a)
             for g, a in itertools.product(sorted(ISOGMLP_GATES), sorted(ATTN_SCORING_REGISTRY))]
VARIANTS += [dict(ffn="iso_ln", ffn_linear=lin, attn_scoring=a)
             for lin, a in itertools.product(sorted(LINEAR_REGISTRY), sorted(ATTN_SCORING_REGISTRY))]
VARIANTS += [dict(qk_norm=False), dict(tie_word_embeddings=False), dict(num_key_value_heads=4)]


def variant_id(variant: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in variant.items())


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_no_logit_depends_on_a_later_token(variant):
    """Perturbing token t leaves every logit before t bit-identical (fp64) and changes the logits at t."""
    model = build(**variant)
    ids = tokens()
    with torch.no_grad():
        base = model(ids).logits
        for t in (1, 5, T - 1):
            perturbed = ids.clone()
            perturbed[:, t] = (perturbed[:, t] + 1) % VOCAB
            logits = model(perturbed).logits
            assert torch.equal(logits[:, :t], base[:, :t]), f"logits before {t} changed"
            assert not torch.allclose(logits[:, t], base[:, t])


CACHE_VARIANTS = [dict(attn_scoring="softmax"), dict(attn_scoring="iso_tanh"),
                  dict(ffn="isogmlp", isogmlp_gate="causal_mean", attn_scoring="iso_tanh"),
                  dict(ffn="isogmlp", isogmlp_gate="causal_mean", attn_scoring="softmax")]
CACHE_VARIANTS += [dict(ffn=f, attn_scoring=a) for f, a in itertools.product(sorted(set(FFN_REGISTRY) - {"swiglu"}),
                                                                          sorted(ATTN_SCORING_REGISTRY))]
"""Generation state of every kind: both scorings' (k, v) and (S, G), the causal_mean gate's running sum, and
every FFN with each scoring."""


@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=variant_id)
def test_incremental_forward_with_past_equals_the_full_forward(variant):
    """Prefill, then one token, then a 3-token piece, then single tokens: each step's logits are the full
    forward's at those positions (positions and the FFN's running state carried by the cache)."""
    model = build(**variant)
    ids = tokens()
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        cache = out[CACHE_ARG]
        assert isinstance(cache, IsoLLMCache) and cache.get_seq_length() == 5
        torch.testing.assert_close(out.logits, full[:, :5], rtol=0, atol=1e-12)
        for start, stop in [(5, 6), (6, 9), *((t, t + 1) for t in range(9, T))]:
            step = model(ids[:, start:stop], cache=cache, use_cache=True)
            assert step[CACHE_ARG] is cache and cache.get_seq_length() == stop
            torch.testing.assert_close(step.logits, full[:, start:stop], rtol=0, atol=1e-12)


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
    own = {name for name in vars(IsoLLMForCausalLM) if name.startswith("_") and not name.startswith("__")}
    assert own & set(dir(GenerationMixin)) == set()
    assert "prepare_inputs_for_generation" in vars(IsoLLMForCausalLM)


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


def test_loss_is_the_shifted_cross_entropy_in_fp32():
    model = build(dtype=torch.float32)
    ids = tokens()
    labels = ids.clone()
    labels[0, 3:6] = -100
    out = model(ids, labels=labels)
    manual = F.cross_entropy(out.logits[:, :-1].double().reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                             ignore_index=-100)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), manual, rtol=1e-6, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(ids, labels=labels).loss.dtype == torch.float32


def test_training_forward_returns_logits_only():
    out = build()(tokens())
    assert out.logits.shape == (2, T, VOCAB)
    assert out.loss is None and out.get(CACHE_ARG) is None and out.hidden_states is None


def test_hidden_states_are_the_embedding_and_every_block_output():
    model = build(num_hidden_layers=3)
    ids = tokens()
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        assert len(out.hidden_states) == 4
        torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(ids), rtol=0, atol=0)
        torch.testing.assert_close(model.lm_head(model.model.norm(out.hidden_states[-1])), out.logits,
                                   rtol=0, atol=0)
        last = model(ids, logits_to_keep=1).logits
        torch.testing.assert_close(last, out.logits[:, -1:], rtol=0, atol=1e-12)


def test_rotary_embedding_makes_scores_depend_on_relative_position_only():
    """Shifting every position by a constant leaves the logits unchanged (RoPE's defining property), up
    to the fp32 rounding of the angles (computed in fp32, as Qwen3 does)."""
    model = build()
    ids = tokens()
    positions = torch.arange(T)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, position_ids=positions + 17).logits,
                                   model(ids, position_ids=positions).logits, rtol=0, atol=1e-6)
        assert not torch.allclose(model(ids, position_ids=positions.flip(-1)).logits, model(ids).logits)


@pytest.mark.parametrize("tied", [True, False])
def test_weight_tying_and_init(tied):
    model = build(dtype=torch.float32, tie_word_embeddings=tied, vocab_size=4096, hidden_size=64)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert (head is embed) == tied
    for weight in (embed, head, model.model.layers[0].self_attn.qkv_proj.weight):  # normal(0, 0.02)
        assert abs(weight.std().item() - 0.02) < 0.001 and abs(weight.mean().item()) < 0.001
    assert torch.equal(model.model.layers[0].input_layernorm.weight, torch.ones(64))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("ffn", sorted(FFN_REGISTRY))
def test_param_counts_match_the_built_model(ffn, tied):
    config = ModelConfig(**TINY, ffn=ffn, tie_word_embeddings=tied, ffn_param_match=True)
    model = IsoLLMForCausalLM(IsoLLMConfig.from_model_config(config))
    total, non_embedding = param_counts(config)
    assert total == sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert total - non_embedding == VOCAB * 32 * (1 if tied else 2)
    assert param_counts(IsoLLMConfig.from_model_config(config)) == (total, non_embedding)


def test_parameter_names_follow_qwen3():
    names = set(dict(build(tie_word_embeddings=False).named_parameters()))
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
                 "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                 "model.layers.1.mlp.in_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert name in names
    assert not any(name.endswith("bias") for name in names)


def test_rotary_equals_rotate_half_formula_and_its_gradient():
    """RoPE with Qwen3's rotate-half layout, ``x cos + rotate_half(x) sin``; backward checked numerically."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = rotary_cos_sin(torch.arange(5)[None] + 3, 8, 10000.0, torch.float64)
    x1, x2 = x.chunk(2, dim=-1)
    expected = x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, rtol=0, atol=1e-15)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 input keeps a bf16 gradient
        x16 = x.detach().bfloat16().requires_grad_()
        apply_rotary(x16, cos.float(), sin.float()).sum().backward()
    assert x16.grad.dtype == torch.bfloat16


def test_rms_norm_equals_its_formula_and_its_gradient():
    """``weight * x / sqrt(mean(x^2) + eps)``; the hand-written backward checked numerically, for the
    hidden states and for a strided per-head view as q_norm/k_norm get it."""
    norm = RMSNorm(8, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    qkv = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    for x in (qkv[:, :, 0], qkv[:, :, :2]):
        expected = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(norm(x), expected, rtol=1e-14, atol=0)
    x = qkv[:1, :2, :2]  # a strided view, as q_norm/k_norm see it
    weight = norm.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t, w: _RMSNorm.apply(t, w, 1e-6), (x, weight))
    x16 = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    out = RMSNorm(8, eps=1e-6)(x16)  # Qwen3's dtypes: normalised in fp32, rounded to bf16, fp32 gain
    assert out.dtype == torch.float32
    out.sum().backward()
    assert x16.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_under_autocast_equals_the_composed_formula(dtype):
    """Under a bf16 autocast (the GPU default) the sum of squares and the backward stay in fp32: the
    hand-written Function equals the composed ops, which autocast leaves alone, value and gradients."""
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 6, 64, generator=gen)).to(dtype)
    weight = torch.rand(64, generator=gen) + 0.5
    grad = torch.randn(4, 6, 64, generator=gen)

    def run(fn):
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(xi, wi)
            out.backward(grad.to(out.dtype))  # inside the autocast region, as some loops call it
        return out, xi.grad, wi.grad

    def composed(xi, wi):
        x32 = xi.float()
        return wi * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(xi.dtype)

    for got, want in zip(run(lambda xi, wi: _RMSNorm.apply(xi, wi, 1e-6)), run(composed), strict=True):
        assert got.dtype == want.dtype
        # With a bf16 input the composed ops differentiate through the bf16-rounded normalised x
        error = (got - want).float().norm() / want.float().norm()
        assert error < (1e-6 if dtype == torch.float32 else 2**-7)


@pytest.mark.parametrize("mode", ["autocast", "bf16_weights"])
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_bf16_training_step_follows_fp32(variant, mode):
    """A training step in bf16 gives fp32's loss and gradients to bf16 precision, for every variant:
    under autocast (Accelerate's bf16 with DDP) and with the weights themselves in bf16 (FSDP2's
    param_dtype, DeepSpeed's bf16 mode)."""
    model = build(dtype=torch.float32, **variant).train()
    ids = tokens()

    def step(model: IsoLLMForCausalLM, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters()])

    loss32, grad32 = step(model, autocast=False)
    model.zero_grad()
    loss16, grad16 = step(model, True) if mode == "autocast" else step(model.to(torch.bfloat16), False)
    assert loss16.dtype == torch.float32
    torch.testing.assert_close(loss16, loss32, rtol=2e-2, atol=0)
    assert torch.nn.functional.cosine_similarity(grad16, grad32, dim=0) > 0.99


@pytest.mark.parametrize("every_n_layers", [1, 2])
@pytest.mark.parametrize("variant", [dict(), dict(ffn="isogmlp", isogmlp_gate="causal_mean", attn_scoring="iso_tanh")],
                         ids=variant_id)
def test_activation_checkpointing_gives_the_same_loss_and_gradients(variant, every_n_layers):
    """transformers' public ``activation_checkpointing_enable``: recomputed layers give bit-identical results."""
    def loss_and_grads(model: IsoLLMForCausalLM) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.train()
        ids = tokens(seq=T)
        loss = model(ids, labels=ids, position_ids=torch.tensor([[*range(5), *range(T - 5)]])).loss
        return loss, torch.autograd.grad(loss, list(model.parameters()))

    plain, plain_grads = loss_and_grads(build(num_hidden_layers=4, **variant))
    model = build(num_hidden_layers=4, **variant)
    model.activation_checkpointing_enable(every_n_layers=every_n_layers)
    checkpointed = [layer.gradient_checkpointing for layer in model.model.layers]
    assert checkpointed == [i % every_n_layers == 0 for i in range(4)]
    calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *args: calls.append(1))  # recompute may stop early
    loss, grads = loss_and_grads(model)
    assert len(calls) == 2  # the forward, then the recompute in the backward pass
    assert torch.equal(loss, plain)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
