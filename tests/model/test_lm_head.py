"""The fused LM-head cross-entropy equals the plain one, in value and gradient (fp64), in every mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm.model import IsoLLMConfig, IsoLLMForCausalLM
from llm.model.config import ConfigError
from llm.model.lm_head import (
    FP8_MAX,
    IGNORE_INDEX,
    check_fp8_device,
    fp8_logits,
    linear_cross_entropy,
    quantize_rowwise,
)

N, D, V = 37, 16, 50  # N not a multiple of any chunk size below


def problem(dtype: torch.dtype = torch.float64, ignored: bool = True):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, D, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    if ignored:
        targets[[0, 5, 6, 36]] = IGNORE_INDEX
    return hidden, weight, targets


def reference(hidden, weight, targets):
    return F.cross_entropy((hidden @ weight.T).float() if hidden.dtype != torch.float64 else hidden @ weight.T,
                           targets, ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunk_rows", [1, 8, 36, 37, 64])
@pytest.mark.parametrize("ignored", [False, True])
def test_loss_and_gradients_equal_plain_cross_entropy_fp64(chunk_rows, ignored):
    hidden, weight, targets = problem(ignored=ignored)
    expected = reference(hidden, weight, targets)
    grads = torch.autograd.grad(expected * 3.0, (hidden, weight))  # a non-unit upstream gradient
    loss = linear_cross_entropy(hidden, weight, targets, chunk_rows=chunk_rows)
    fused_grads = torch.autograd.grad(loss * 3.0, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-13, atol=0)
    for got, want in zip(fused_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    if ignored:  # an ignored target contributes no gradient to its hidden state
        assert fused_grads[0][targets == IGNORE_INDEX].abs().max() == 0


def test_no_target_gives_torch_s_nan_loss_and_zero_gradients_fp64():
    """Every target ignored: F.cross_entropy's mean over no target is NaN and its gradients are zero; the fused
    loss's were NaN (0 / 0 scaled every gradient), which one such micro-batch spreads to every weight."""
    hidden, weight, targets = problem()
    targets[:] = IGNORE_INDEX
    expected = reference(hidden, weight, targets)
    want = torch.autograd.grad(expected, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, chunk_rows=8)
    got = torch.autograd.grad(loss, (hidden, weight))
    assert expected.isnan() and loss.isnan()
    for g, w in zip(got, want, strict=True):
        assert w.abs().max() == 0
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_rows_of_one_token_train_with_finite_zero_gradients():
    """``labels`` on rows of one token: no position has a next token to predict, as in transformers."""
    torch.manual_seed(0)
    config = IsoLLMConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
    model = IsoLLMForCausalLM(config).double().train()
    ids = torch.randint(0, V, (3, 1))
    model(ids, labels=ids, fused_loss=True).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is None or p.grad.abs().max() == 0, name


def test_default_chunks_are_equal_and_within_the_logits_budget():
    from llm.model.lm_head import LOGITS_PER_CHUNK, default_chunk_rows
    cuda = torch.device("cuda")
    rows = default_chunk_rows(32 * 2048, 151_936, cuda)
    chunks = -(-32 * 2048 // rows)
    assert chunks == 19 and 32 * 2048 - (chunks - 1) * rows > 0.9 * rows  # no small last chunk
    assert rows * 151_936 <= LOGITS_PER_CHUNK["cuda"]
    assert default_chunk_rows(10, 50, torch.device("cpu")) == 16 and rows % 16 == 0  # one chunk; whole tiles


def test_batched_targets_and_no_grad():
    hidden, weight, targets = problem()
    expected = reference(hidden, weight, targets)
    loss = linear_cross_entropy(hidden.detach().view(1, N, D), weight.detach(), targets.view(1, N))
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-13, atol=0)
    with torch.no_grad():
        assert not linear_cross_entropy(hidden, weight, targets).requires_grad
    with pytest.raises(ValueError, match="targets: expected shape"):
        linear_cross_entropy(hidden, weight, targets[:-1])


def test_fp32_and_bf16_autocast_match_the_logits_path():
    hidden, weight, targets = problem(torch.float32)
    torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, chunk_rows=8),
                               reference(hidden, weight, targets), rtol=1e-6, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = linear_cross_entropy(hidden, weight, targets, chunk_rows=8)
        plain = F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=IGNORE_INDEX)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=0)  # same bf16 logits, fp32 softmax
    grad_fp32 = torch.autograd.grad(reference(hidden, weight, targets), weight)[0]
    grad_fused = torch.autograd.grad(fused, weight)[0]
    grad_plain = torch.autograd.grad(plain, weight)[0]
    assert grad_fused.dtype == torch.float32

    def error(grad: torch.Tensor) -> float:  # relative to the fp32 gradient
        return ((grad - grad_fp32).norm() / grad_fp32.norm()).item()

    assert error(grad_fused) < 0.01 and error(grad_fused) < 2 * error(grad_plain)  # bf16's rounding, no worse


@pytest.mark.parametrize("tied", [True, False])
def test_model_training_mode_fuses_the_loss_and_matches_eval_mode(tied):
    torch.manual_seed(0)
    config = IsoLLMConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    model = IsoLLMForCausalLM(config).double()
    ids = torch.randint(0, V, (3, 9))
    targets = torch.randint(0, V, (3, 9))
    targets[1, 2] = IGNORE_INDEX

    def loss_and_grads(train: bool, **kwargs):
        model.train(train)
        model.zero_grad()
        out = model(ids, fused_loss=train, **kwargs)
        out.loss.backward()
        return out, [p.grad.clone() for p in model.parameters()]

    fused, fused_grads = loss_and_grads(True, shift_labels=targets)
    plain, plain_grads = loss_and_grads(False, shift_labels=targets)
    assert fused.logits is None and plain.logits.shape == (3, 9, V)
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-13, atol=0)
    for got, want in zip(fused_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    # ``labels`` (unshifted, transformers' convention) is the same loss with the last position unscored
    shifted = torch.cat([ids[:, 1:], torch.full((3, 1), IGNORE_INDEX)], dim=1)
    by_labels, _ = loss_and_grads(True, labels=ids)
    by_shift, _ = loss_and_grads(True, shift_labels=shifted)
    torch.testing.assert_close(by_labels.loss, by_shift.loss, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_every", [0, 1], ids=["plain", "activation-checkpointing"])
def test_torch_compile_training_step_equals_eager(checkpoint_every: int):
    """``train.compile``: the compiled model (rotary left to the compiler, the fused loss run eagerly)
    gives the eager loss and gradients, with ``train.activation_checkpointing`` too (recompute under compile)."""
    torch.manual_seed(0)
    config = IsoLLMConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, ffn="isogmlp", attn_scoring="iso_tanh",
                          iso_tanh_chunk_size=4)
    model = IsoLLMForCausalLM(config).train()
    if checkpoint_every:
        model.activation_checkpointing_enable(every_n_layers=checkpoint_every)
    ids = torch.randint(0, V, (2, 11))

    def loss_and_grads(module):
        model.zero_grad()
        loss = module(ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager_loss, eager_grads = loss_and_grads(model)
    compiled_loss, compiled_grads = loss_and_grads(torch.compile(model))
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=0)
    for got, want in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_fp8_matmul_is_torch_s_public_rowwise_scaled_mm():
    """``F.scaled_mm`` with rowwise scales (public in torch 2.13): its call as the head makes it, on the meta device
    (no kernel needed) and on the CPU, whose kernel is the dequantised fp32 matmul the FP8 head's numbers are."""
    a = torch.randn(48, 32, dtype=torch.bfloat16)
    w = torch.randn(80, 32, dtype=torch.bfloat16)
    w8, w_scale = quantize_rowwise(w)
    assert w8.dtype == torch.float8_e4m3fn and w_scale.shape == (80, 1)
    assert (w8.float().abs().amax(-1) == FP8_MAX).all()  # each row's largest magnitude at e4m3's largest value
    meta = fp8_logits(a.to("meta"), w8.to("meta"), w_scale.to("meta"))
    assert meta.shape == (48, 80) and meta.dtype == torch.bfloat16
    a8, a_scale = quantize_rowwise(a)
    dequantised = (a8.float() * a_scale) @ (w8.float() * w_scale).T
    torch.testing.assert_close(fp8_logits(a, w8, w_scale).float(), dequantised, rtol=2**-8, atol=1e-6)


def test_fp8_head_loss_within_half_a_percent_of_bf16():
    """The FP8 logits' loss and gradients against bf16's, at logits of a trained head's spread (std ~3)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(512, 64, generator=g).requires_grad_()
    weight = (0.4 * torch.randn(1000, 64, generator=g)).requires_grad_()
    targets = torch.randint(0, 1000, (512,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = linear_cross_entropy(hidden, weight, targets, chunk_rows=128)
        fp8 = linear_cross_entropy(hidden, weight, targets, chunk_rows=128, fp8=True)
    assert fp8.item() != bf16.item()  # the FP8 logits did run: their rounding moves the loss
    assert abs(fp8.item() - bf16.item()) < 0.005 * bf16.item()
    for got, want in zip(torch.autograd.grad(fp8, (hidden, weight)), torch.autograd.grad(bf16, (hidden, weight)),
                         strict=True):
        assert ((got - want).norm() / want.norm()).item() < 0.05


def test_fp8_is_refused_in_one_line_on_a_gpu_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"lm_head_precision: fp8 needs FP8 tensor cores .* A100 lacks"):
        check_fp8_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda"))
    with pytest.raises(ConfigError, match="lm_head_precision: unknown value 'fp16'"):
        IsoLLMConfig(vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     lm_head_precision="fp16").validate()


def test_the_config_field_reaches_the_head():
    """``lm_head_precision`` switches the model's head to the FP8 logits (``LMHead.fp8``), and bf16 leaves it off."""
    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    assert IsoLLMForCausalLM(IsoLLMConfig(**shape, lm_head_precision="fp8")).lm_head.fp8
    assert not IsoLLMForCausalLM(IsoLLMConfig(**shape)).lm_head.fp8
