"""iso_tanh through a linear-attention kernel: the identity that maps it onto one (against a plain-torch kernel, in
fp64), and fla's kernel behind llm/model/fla_kernel.py's custom ops (in Triton's CPU interpreter here, on CUDA
where there is one), compiled whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import iso_tanh_naive
from test_attention import CHUNK, EXACT, config, make_qkv

from llm.model.attention import FLA_MIN_LENGTH, IsoTanhScoring
from llm.model.iso_tanh import iso_tanh_chunked, iso_tanh_linear_attention
from llm.model.layout import same_document


def torch_linear_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      initial_state: torch.Tensor | None = None, doc_starts: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-torch ``LinearAttention`` (llm/model/iso_tanh.py), as fla's kernel computes it ([B, T, H, K] layout):
    the scores masked to the causal triangle, and to each document where ``doc_starts`` is given."""
    scores = torch.einsum("bihk,bjhk->bhij", q, k).tril() * scale
    if doc_starts is not None:
        assert initial_state is None
        scores = scores * same_document(doc_starts)[:, None]
    o = (scores @ v.transpose(1, 2)).transpose(1, 2)
    if initial_state is not None:
        o = o + scale * (q.transpose(1, 2) @ initial_state).transpose(1, 2)
    if doc_starts is not None:
        return o, None
    state = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=q.dtype)
    return o, (state if initial_state is None else initial_state) + torch.einsum("bthk,bthv->bhkv", k, v)


@pytest.mark.parametrize("hkv", [1, 2])
def test_linear_attention_identity(hkv: int) -> None:
    """LA(q, k, [v|k]) gives the numerator and |s|^2 = q . LA(q, k, k) / sqrt(D); with a state, too."""
    q, k, v = make_qkv(23, hkv=hkv)
    ref = iso_tanh_naive(q, k, v)
    head, state = iso_tanh_linear_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], None, torch_linear_attn)
    tail, final = iso_tanh_linear_attention(q[:, :, 9:], k[:, :, 9:], v[:, :, 9:], state, torch_linear_attn)
    torch.testing.assert_close(torch.cat([head, tail], dim=2), ref, **EXACT)
    torch.testing.assert_close(final, iso_tanh_chunked(q, k, v, CHUNK)[1], **EXACT)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="triton ships Linux wheels only")
def test_fla_kernel_interpreted_matches_naive() -> None:
    """fla's own Triton kernels through the custom ops, run on the CPU by Triton's interpreter, against the fp64
    reference; the ops pass ``torch.library.opcheck`` and compile with ``fullgraph=True`` to the eager result.

    The interpreter is chosen by ``TRITON_INTERPRET=1`` before triton is first imported, which
    torch._dynamo does on import, hence the fresh process (``fla_interpreted.py`` has the checks).
    """
    script = Path(__file__).with_name("fla_interpreted.py")
    done = subprocess.run([sys.executable, str(script)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["hkv=1:", "ok", "hkv=2:", "ok", "padding:", "ok", "documents:", "ok",
                                   "custom-op:", "ok"], done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_kernel_matches_naive(dtype: torch.dtype) -> None:
    q, k, v = make_qkv(300, dtype=dtype)
    ref = iso_tanh_naive(*(x.double() for x in (q, k, v)))
    scoring = IsoTanhScoring(config(64))
    assert scoring.linear_attn is not None, "fla-core is not installed (pip install -e '.[gpu]')"
    out, state = iso_tanh_linear_attention(*(x.cuda() for x in (q, k, v)), None, scoring.linear_attn)
    err = (out.double().cpu() - ref).abs().amax() / ref.abs().amax()
    assert err < (1e-3 if dtype == torch.float32 else 3e-2)
    torch.testing.assert_close(state[1].cpu().double(), (k.double().transpose(-1, -2) @ k.double()),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_long_iso_tanh_runs_fla_without_a_graph_break() -> None:
    """From ``FLA_MIN_LENGTH`` on, the compiled scoring (``fullgraph=True``: a graph break fails) runs fla's kernel,
    forward and backward, within bf16 rounding of the chunked form in fp32, gradients included."""
    scoring = IsoTanhScoring(config(64))
    kernel = scoring.linear_attn
    assert kernel is not None, "fla-core is not installed (pip install -e '.[gpu]')"
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[1])
        return kernel(*args, **kwargs)

    scoring.linear_attn = counted
    q, k, v = (x.cuda().requires_grad_() for x in make_qkv(FLA_MIN_LENGTH, dtype=torch.bfloat16))
    out = torch.compile(scoring, fullgraph=True)(q, k, v)[0]
    assert calls == [FLA_MIN_LENGTH]  # traced once, through fla's op
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    fp32 = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = iso_tanh_chunked(*fp32, 64)[0]
    want = torch.autograd.grad(ref, fp32, grad.float())
    assert (out.float() - ref).abs().amax() / ref.abs().amax() < 3e-2
    for name, g, w in zip("qkv", got, want, strict=True):
        assert ((g.float() - w).norm() / w.norm()).item() < 3e-2, f"d{name}"
