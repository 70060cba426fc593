"""Attention scoring: iso_tanh's chunked / recurrent / linear-attention forms against the O(T^2)
reference, causality and state passing, and softmax against an explicit masked softmax."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reference import iso_tanh_naive

from llm.model.attention import ATTN_SCORING_REGISTRY, IsoTanhScoring, SoftmaxScoring
from llm.model.config import ModelConfig
from llm.model.iso_tanh import (
    _exclusive_cumsum,
    iso_tanh_chunked,
    iso_tanh_recurrent,
)

B, H, HKV, D, CHUNK = 2, 4, 2, 8, 8
EXACT = {"rtol": 0.0, "atol": 1e-10}


def make_qkv(t: int, dtype: torch.dtype = torch.float64, seed: int = 0, h: int = H, hkv: int = HKV,
             requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v scaled so |s_i| spans the curved part of tanh (not all saturated, not all linear)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (0.7 * torch.randn(B, heads, t, D, generator=gen, dtype=torch.float64) for heads in (h, hkv, hkv))
    return tuple(x.to(dtype).requires_grad_(requires_grad) for x in qkv)


def config(chunk: int = CHUNK) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=H * D, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=H, num_key_value_heads=HKV, iso_tanh_chunk_size=chunk)


def softmax_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Explicit causal softmax attention; the queries are the LAST q.shape[2] of k's positions."""
    tq, tk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(tk - tq, tk)[:, None]
    scores = scores.masked_fill(torch.arange(tk)[None, :] > query_pos, float("-inf"))
    return scores.softmax(-1) @ v


# --- iso_tanh: the fast forms equal the reference ---------------------------------------------------

@pytest.mark.parametrize("t", [1, 7, 16, 37])
@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_chunked_and_recurrent_equal_naive(t: int, hkv: int) -> None:
    q, k, v = make_qkv(t, hkv=hkv)
    ref = iso_tanh_naive(q, k, v)
    chunked, (s, g) = iso_tanh_chunked(q, k, v, CHUNK)
    recurrent, (s_rec, g_rec) = iso_tanh_recurrent(q, k, v, None)
    torch.testing.assert_close(chunked, ref, **EXACT)
    torch.testing.assert_close(recurrent, ref, **EXACT)
    # The final state is the plain sums over all tokens, one per KV head.
    torch.testing.assert_close(s, k.transpose(-1, -2) @ v, **EXACT)
    torch.testing.assert_close(g, k.transpose(-1, -2) @ k, **EXACT)
    torch.testing.assert_close(s_rec, s, **EXACT)
    torch.testing.assert_close(g_rec, g, **EXACT)


def test_strided_inputs() -> None:
    """The modelling code passes [B, T, heads, D] projections transposed to [B, heads, T, D] views."""
    q, k, v = make_qkv(21)
    strided = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    assert not strided[0].is_contiguous()
    torch.testing.assert_close(iso_tanh_chunked(*strided, CHUNK)[0], iso_tanh_naive(q, k, v), **EXACT)
    torch.testing.assert_close(iso_tanh_recurrent(*strided, None)[0], iso_tanh_naive(q, k, v), **EXACT)


def test_naive_weights_are_iso_tanh_of_visible_scores() -> None:
    """The reference itself, on one query: w = tanh(|s|) s/|s| over the visible scores only."""
    q, k, v = make_qkv(5, h=1, hkv=1)
    i = 3
    s = (k[0, 0, : i + 1] @ q[0, 0, i]) / math.sqrt(D)
    w = torch.tanh(s.norm()) * s / s.norm()
    torch.testing.assert_close(iso_tanh_naive(q, k, v)[0, 0, i], w @ v[0, 0, : i + 1], **EXACT)


@pytest.mark.parametrize("n", [1, 5, 16, 17, 40, 300])
def test_exclusive_cumsum(n: int) -> None:
    """The blocked prefix sum over chunks (one level up to 16 chunks, recursive beyond)."""
    x = torch.randn(2, 3, n, 5, dtype=torch.float64)
    expected = x.cumsum(2) - x
    torch.testing.assert_close(_exclusive_cumsum(x), expected, **EXACT)


def test_many_chunks_equal_naive() -> None:
    """chunk_size 1 and 2: 37 and 19 chunks, so the prefix sum over chunks takes its blocked path."""
    q, k, v = make_qkv(37)
    ref = iso_tanh_naive(q, k, v)
    for chunk in (1, 2):
        torch.testing.assert_close(iso_tanh_chunked(q, k, v, chunk)[0], ref, **EXACT)


@pytest.mark.parametrize("split", [(13,), (8, 16), (3, 4, 29)])
def test_chunked_with_carried_state_equals_whole(split: tuple[int, ...]) -> None:
    q, k, v = make_qkv(37)
    whole, whole_state = iso_tanh_chunked(q, k, v, CHUNK)
    outs, state = [], None
    for lo, hi in zip((0, *split), (*split, 37), strict=True):
        out, state = iso_tanh_chunked(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], CHUNK, state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, **EXACT)
    torch.testing.assert_close(state, whole_state, **EXACT)


def test_prefill_then_recurrent_equals_whole() -> None:
    q, k, v = make_qkv(30)
    whole = iso_tanh_naive(q, k, v)
    out, state = iso_tanh_chunked(q[:, :, :19], k[:, :, :19], v[:, :, :19], CHUNK)
    outs = [out]
    for t in range(19, 30):
        out, state = iso_tanh_recurrent(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, **EXACT)


def test_recurrent_advances_the_state_in_place_without_autograd_only() -> None:
    """Generation (no autograd): each token updates the sums where they are, no copy of them per token.
    With autograd on, the caller's state is left as it was and the output is the same."""
    q, k, v = make_qkv(6)
    _, prefilled = iso_tanh_chunked(q[:, :, :4], k[:, :, :4], v[:, :, :4], CHUNK)
    before = tuple(x.clone() for x in prefilled)
    step = (q[:, :, 4:5], k[:, :, 4:5], v[:, :, 4:5])
    tracked, state = iso_tanh_recurrent(*step, prefilled)
    assert all(torch.equal(x, y) for x, y in zip(prefilled, before, strict=True))
    with torch.no_grad():
        out, advanced = iso_tanh_recurrent(*step, prefilled)
    assert all(a.data_ptr() == p.data_ptr() for a, p in zip(advanced, prefilled, strict=True))
    torch.testing.assert_close(out, tracked, **EXACT)
    for got, want in zip(advanced, state, strict=True):
        torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize("impl", ["naive", "chunked", "recurrent", "softmax"])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_causal(impl: str, which: int) -> None:
    """Perturbing q, k or v at position t changes no output before t, and changes the output at t."""
    fn = {
        "naive": iso_tanh_naive,
        "chunked": lambda q, k, v: iso_tanh_chunked(q, k, v, CHUNK)[0],
        "recurrent": lambda q, k, v: iso_tanh_recurrent(q, k, v, None)[0],
        "softmax": lambda q, k, v: SoftmaxScoring(config())(q, k, v)[0],
    }[impl]
    t = 11  # inside the second chunk, so earlier positions of the same chunk are checked too
    qkv = list(make_qkv(20))
    base = fn(*qkv)
    qkv[which] = qkv[which].clone()
    qkv[which][:, :, t] += 1.0
    moved = fn(*qkv)
    torch.testing.assert_close(moved[:, :, :t], base[:, :, :t], rtol=0.0, atol=1e-13)
    assert (moved[:, :, t] - base[:, :, t]).abs().amax() > 1e-3


def test_zero_and_tiny_queries() -> None:
    """|s| = 0 takes the limit g(0) = 1: a zero query gives 0, a tiny one the plain sum of s_ij v_j."""
    q, k, v = make_qkv(20)
    q = q.clone()
    q[:, :, 0] = 0.0
    q[:, :, 9] *= 1e-7
    q.requires_grad_(True)
    out, _ = iso_tanh_chunked(q, k, v, CHUNK)
    kk = k.repeat_interleave(H // HKV, dim=1)[:, :, :10]
    vv = v.repeat_interleave(H // HKV, dim=1)[:, :, :10]
    linear = ((kk @ q[:, :, 9, :, None]).squeeze(-1) / math.sqrt(D))[..., None, :] @ vv
    torch.testing.assert_close(out[:, :, 9], linear.squeeze(-2), rtol=1e-12, atol=0.0)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    # At q = 0 the output is linear in q with g = 1: d out / d q = S / sqrt(D) (here S = k_0 v_0^T).
    expected = (kk[:, :, 0] * vv[:, :, 0].sum(-1, keepdim=True)) / math.sqrt(D)
    torch.testing.assert_close(q.grad[:, :, 0], expected, **EXACT)


def test_gradients_equal_naive() -> None:
    q, k, v = make_qkv(21, requires_grad=True)
    weights = torch.randn(B, H, 21, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = {}
    for name, fn in {"naive": iso_tanh_naive,
                     "chunked": lambda q, k, v: iso_tanh_chunked(q, k, v, CHUNK)[0],
                     "recurrent": lambda q, k, v: iso_tanh_recurrent(q, k, v, None)[0]}.items():
        grads[name] = torch.autograd.grad((fn(q, k, v) * weights).sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads[name])
    for name in ("chunked", "recurrent"):
        for got, ref in zip(grads[name], grads["naive"], strict=True):
            torch.testing.assert_close(got, ref, **EXACT)


def test_gradcheck_chunked() -> None:
    """Small (gradcheck runs one forward per input element): 2 chunks + a padded one, GQA."""
    q, k, v = (x[:1, :, :, :4].detach().clone().requires_grad_(True) for x in make_qkv(7, h=2, hkv=1))
    assert torch.autograd.gradcheck(lambda q, k, v: iso_tanh_chunked(q, k, v, 3)[0], (q, k, v))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2**-8)])
def test_low_precision_inputs_accumulate_in_fp32(dtype: torch.dtype, tol: float) -> None:
    """bf16: only the rounding of the output (unit roundoff 2^-8) is allowed; accumulating the
    running sums of T = 512 tokens in bf16 gives about 1e-2."""
    q, k, v = make_qkv(512, dtype=dtype)
    ref = iso_tanh_naive(*(x.double() for x in (q, k, v)))
    out, (s, g) = iso_tanh_chunked(q, k, v, 64)
    assert out.dtype == dtype and s.dtype == torch.float32 and g.dtype == torch.float32
    err = (out.double() - ref).abs().amax() / ref.abs().amax()
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


def test_autocast_does_not_lower_accumulation() -> None:
    """Under a bf16 autocast the running sums still accumulate in fp32 (bf16 matmuls give ~1e-2)."""
    q, k, v = make_qkv(512, dtype=torch.float32)
    ref = iso_tanh_naive(*(x.double() for x in (q, k, v)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked, _ = iso_tanh_chunked(q, k, v, 64)
        recurrent, _ = iso_tanh_recurrent(q[:, :, :64], k[:, :, :64], v[:, :, :64], None)
    torch.testing.assert_close(chunked.double(), ref, rtol=0.0, atol=1e-5)
    torch.testing.assert_close(recurrent.double(), ref[:, :, :64], rtol=0.0, atol=1e-5)


class _TF32Matmuls(torch.overrides.TorchFunctionMode):
    """Matmuls with every fp32 operand cut to TF32's 10 mantissa bits (truncated: never better than the tensor
    cores' rounding), which ``train.tf32`` gives the chunked form's matmuls on CUDA; the products stay fp32."""

    MATMULS = (torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.bmm)

    def __torch_function__(self, func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in self.MATMULS:
            args = tuple((a.view(torch.int32) & ~0x1FFF).view(torch.float32)
                         if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args)
        return func(*args, **(kwargs or {}))


def test_tf32_matmuls_stay_below_the_bf16_outputs_rounding() -> None:
    """``train.tf32``: bf16 inputs are exact in TF32, and the fp32 sums it rounds stay well inside the rounding of
    the bf16 output itself, over T = 4096 (64 chunks of running sums). Measured on fp32 output (the bf16 inputs'
    values), against fp64."""
    q, k, v = (x.to(torch.bfloat16).float() for x in make_qkv(4096, hkv=2))
    ref = iso_tanh_chunked(*(x.double() for x in (q, k, v)), 64)[0]
    with _TF32Matmuls():
        tf32 = iso_tanh_chunked(q, k, v, 64)[0]

    def rel(x: torch.Tensor) -> float:
        return ((x.double() - ref).norm() / ref.norm()).item()

    assert 1e-5 < rel(tf32) < rel(ref.to(torch.bfloat16)) / 2  # cut operands (not fp32's 1e-7), below bf16's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packed", [False, True])
def test_bf16_operands_on_cuda_stay_within_the_outputs_rounding(packed: bool) -> None:
    """bf16 q, k, v multiplied as they are (fp32 accumulation), against fp64, plain and packed."""
    q, k, v = (x.to("cuda", torch.bfloat16) for x in make_qkv(2048, dtype=torch.float32))
    starts = torch.zeros(B, 2048, dtype=torch.bool, device="cuda")
    starts[:, [0, 700, 1500]] = True
    ref = iso_tanh_chunked(*(x.double() for x in (q, k, v)), 64, doc_starts=starts if packed else None)[0]
    out = iso_tanh_chunked(q, k, v, 64, doc_starts=starts if packed else None)[0]
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2 * ((ref.to(torch.bfloat16).double() - ref).norm()
                                                                   / ref.norm()).item()


def test_bad_inputs_raise() -> None:
    q, k, v = make_qkv(5)
    with pytest.raises(ValueError, match="chunk_size"):
        iso_tanh_chunked(q, k, v, 0)
    with pytest.raises(ValueError, match="Hkv dividing H"):
        iso_tanh_chunked(q, k[:, :1].expand(B, 3, 5, D), v[:, :1].expand(B, 3, 5, D), CHUNK)
    with pytest.raises(ValueError, match="state"):
        iso_tanh_recurrent(q, k, v, (torch.zeros(B, H, D, D), torch.zeros(B, H, D, D)))


# --- softmax ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("past_len", "t"), [(0, 13), (7, 1), (7, 5), (7, 7)])
def test_softmax_matches_masked_reference(past_len: int, t: int) -> None:
    q, k, v = make_qkv(past_len + t)
    scoring = SoftmaxScoring(config())
    past = (k[:, :, :past_len], v[:, :, :past_len]) if past_len else None
    new = slice(past_len, None)
    out, present = scoring(q[:, :, new], k[:, :, new], v[:, :, new], past=past, use_cache=True)
    torch.testing.assert_close(out, softmax_reference(q[:, :, past_len:], k, v), **EXACT)
    torch.testing.assert_close(present, (k, v), rtol=0.0, atol=0.0)


# --- the registry modules: use_cache states are usable as past ----------------------------------

def test_registry() -> None:
    assert set(ATTN_SCORING_REGISTRY) == {"softmax", "iso_tanh"}
    assert ATTN_SCORING_REGISTRY["iso_tanh"] is IsoTanhScoring
    assert ATTN_SCORING_REGISTRY["softmax"] is SoftmaxScoring


@pytest.mark.parametrize("name", sorted(ATTN_SCORING_REGISTRY))
def test_module_cache_continues_sequence(name: str) -> None:
    scoring = ATTN_SCORING_REGISTRY[name](config())
    q, k, v = make_qkv(26)
    whole, no_state = scoring(q, k, v)
    assert no_state is None
    reference = softmax_reference(q, k, v) if name == "softmax" else iso_tanh_naive(q, k, v)
    torch.testing.assert_close(whole, reference, **EXACT)
    outs, past = [], None
    for lo, hi in [(0, 10), (10, 11), (11, 20), (20, 21), (21, 22), (22, 26)]:  # prefill, tokens, pieces
        out, past = scoring(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], past=past, use_cache=True)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, **EXACT)


def test_softmax_decoding_leaves_out_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    """One-token decoding runs SDPA with cuDNN disabled (a new execution plan per key length on GPU); the
    prefill keeps the default choice. The backend flags are global, so this is observable on CPU."""
    seen: list[tuple[int, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append((q.shape[2], torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    scoring = SoftmaxScoring(config())
    q, k, v = make_qkv(12)
    _, past = scoring(q[:, :, :11], k[:, :, :11], v[:, :, :11], use_cache=True)
    scoring(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], past=past, use_cache=True)
    assert seen == [(11, torch.backends.cuda.cudnn_sdp_enabled()), (1, False)]
