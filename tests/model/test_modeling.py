"""The decoder: causality of every variant, a cached forward against the full one, loss, tying, parameter counts,
RoPE and RMSNorm against their formulas, bf16 and activation checkpointing (generate(): test_generation.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from reference import rotary_cos_sin

from llm.model import IsoLLMCache, IsoLLMConfig, IsoLLMForCausalLM, ModelConfig, param_counts
from llm.model.attention import ATTN_SCORING_REGISTRY
from llm.model.ffn import FFN_REGISTRY, ISOGMLP_GATES
from llm.model.fused_ops import RMSNorm, _RMSNorm, apply_rotary
from llm.model.linear import LINEAR_REGISTRY
from llm.model.modeling_isollm import CACHE_ARG

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
    model = build()
    out = model(tokens())
    assert out.logits.shape == (2, T, VOCAB)
    assert out.loss is None and out.get(CACHE_ARG) is None and out.hidden_states is None
    assert not any(module._forward_hooks for module in model.modules())  # transformers' capture: only when asked


def test_hidden_states_end_with_the_last_hidden_state_as_in_transformers_models():
    """``(x_0, ..., x_{L-1}, norm(x_L))``: the last is ``last_hidden_state``, the LM head's input; indices select
    among them (the others None)."""
    model = build(num_hidden_layers=3)
    ids = tokens()
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        assert len(out.hidden_states) == 4
        torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(ids), rtol=0, atol=0)
        torch.testing.assert_close(model.lm_head(out.hidden_states[-1]), out.logits, rtol=0, atol=0)
        base = model.model(ids, output_hidden_states=True)
        torch.testing.assert_close(base.hidden_states[-1], base.last_hidden_state, rtol=0, atol=0)
        chosen = model(ids, output_hidden_states=[1, -1]).hidden_states
        assert chosen[0] is None and chosen[2] is None
        for i in (1, 3):
            torch.testing.assert_close(chosen[i], out.hidden_states[i], rtol=0, atol=0)
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
