"""iso_tanh through fla's chunked linear-attention kernel (llm/model/fla_kernel.py's custom ops), run on the CPU by
Triton's interpreter.

Run by ``test_linear_attention.py`` in a fresh process with ``TRITON_INTERPRET=1``. It checks iso_tanh's
mapping onto the kernel (layout, scale, carried state, GQA expansion, backward) against the fp64
reference on machines without a GPU, and that zeroing padded queries and keys before the kernel
gives each row of a padded batch its output alone, that packed documents cut into the kernel's varlen input
(``cu_seqlens``) give each document its output alone, that the ops pass torch's own checks of a custom op
(``torch.library.opcheck``: schema, fake shapes, autograd registration), and that ``torch.compile`` with
``fullgraph=True`` traces through them, forward and backward, to the eager result. Two things the interpreter
lacks are patched here: autotuning (it cannot time configs, so the first is taken) and loop counters as Triton
scalars (fla calls ``i_t.to(tl.int64)`` on a ``range`` index, which the interpreter leaves a Python int).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import fla.ops.common.chunk_h as chunk_h
import torch
import triton.language as tl
from reference import iso_tanh_naive
from triton.runtime.autotuner import Autotuner

from llm.model.fla_kernel import fla_kernel, fla_linear_attn
from llm.model.iso_tanh import iso_tanh_linear_attention, mask_padding

B, H, T, SPLIT, D = 2, 4, 100, 70, 16  # fla tiles the head dimension by 16; 70 and 30 are not multiples of 64


def scalar_range(*bounds: int) -> Iterator[tl.tensor]:
    return (tl.full([], i, tl.int32) for i in range(*(int(b) for b in bounds)))


def check(hkv: int) -> None:
    """Forward, carried state and q/k/v gradients in fp32 against the fp64 reference."""
    kernel = fla_kernel()
    assert kernel is not None, "fla-core and triton are test dependencies (pyproject's dev extra)"
    gen = torch.Generator().manual_seed(hkv)
    q, k, v = (0.5 * torch.randn(B, heads, T, D, generator=gen, dtype=torch.float64).requires_grad_()
               for heads in (H, hkv, hkv))
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    first = slice(0, SPLIT)
    rest = slice(SPLIT, T)
    head, state = iso_tanh_linear_attention(q32[:, :, first], k32[:, :, first], v32[:, :, first], None, kernel)
    tail, final = iso_tanh_linear_attention(q32[:, :, rest], k32[:, :, rest], v32[:, :, rest], state, kernel)
    out = torch.cat([head, tail], dim=2)
    ref = iso_tanh_naive(q, k, v)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    kt = k.detach().transpose(-1, -2)
    torch.testing.assert_close(final, (kt @ v.detach(), kt @ k.detach()), rtol=1e-4, atol=1e-4, check_dtype=False)
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q32, k32, v32), grad.float())
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, g, w in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"d{n}: {m}")


def check_padding() -> None:
    """A left- and a right-padded row (forward only): real outputs as alone, zero at the padding."""
    kernel = fla_kernel()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (0.5 * torch.randn(2, heads, T, D, generator=gen) for heads in (H, 2, 2))
    rows = [slice(30, T), slice(0, SPLIT)]
    real = torch.zeros(2, T, dtype=torch.bool)
    for row, tokens in enumerate(rows):
        real[row, tokens] = True
    out, _ = iso_tanh_linear_attention(*mask_padding(q, k, real), v, None, kernel)
    for row, tokens in enumerate(rows):
        alone = iso_tanh_naive(*(x[row : row + 1, :, tokens].double() for x in (q, k, v)))
        torch.testing.assert_close(out[row : row + 1, :, tokens].double(), alone, rtol=1e-4, atol=1e-5)
    assert not out.transpose(1, 2)[~real].any()


def check_documents() -> None:
    """Packed documents (forward only): the rows flattened into fla's varlen input, cut at each document."""
    kernel = fla_kernel()
    gen = torch.Generator().manual_seed(1)
    q, k, v = (0.5 * torch.randn(2, heads, T, D, generator=gen) for heads in (H, 2, 2))
    lengths = [[30, 45, 25], [17, 83]]  # starts inside and across fla's 64-token chunks
    starts = torch.zeros(2, T, dtype=torch.bool)
    for row, row_lengths in enumerate(lengths):
        starts[row, torch.tensor([0, *row_lengths[:-1]]).cumsum(0)] = True
    out, state = iso_tanh_linear_attention(q, k, v, None, kernel, doc_starts=starts)
    assert state is None
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            piece = slice(start, start + n)
            alone = iso_tanh_naive(*(x[row : row + 1, :, piece].double() for x in (q, k, v)))
            torch.testing.assert_close(out[row : row + 1, :, piece].double(), alone, rtol=1e-4, atol=1e-5)
            start += n


def check_custom_op() -> None:
    """torch's checks of the op, with and without a carried state and with documents, and a compiled iso_tanh
    (``fullgraph=True``: no graph break) equal to the eager one, forward and backward, both ways."""
    gen = torch.Generator().manual_seed(2)
    q, k = (0.5 * torch.randn(2, 70, 2, D, generator=gen) for _ in range(2))
    v = 0.5 * torch.randn(2, 70, 2, 2 * D, generator=gen)
    state = torch.randn(2, 2, D, 2 * D, generator=gen)
    starts = torch.zeros(2, 70, dtype=torch.bool)
    starts[0, [0, 20]] = starts[1, [0, 65]] = True
    for init, docs in ((None, None), (state, None), (None, starts)):
        args = [x.clone().requires_grad_() if x is not None else None for x in (q, k, v)] + [D**-0.5, init, docs]
        if init is not None:
            args[4] = init.clone().requires_grad_()
        torch.library.opcheck(fla_linear_attn, args, test_utils=("test_schema", "test_autograd_registration",
                                                                  "test_faketensor"))
    kernel = fla_kernel()
    compiled = torch.compile(iso_tanh_linear_attention, fullgraph=True, backend="aot_eager")
    qh, kh, vh = (0.5 * torch.randn(2, heads, 70, D, generator=gen) for heads in (H, 2, 2))
    for docs in (None, starts):
        inputs = [x.clone().requires_grad_() for x in (qh, kh, vh)]
        eager_inputs = [x.clone().requires_grad_() for x in (qh, kh, vh)]
        got = compiled(*inputs, None, kernel, docs)[0]
        want = iso_tanh_linear_attention(*eager_inputs, None, kernel, docs)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got.square().sum().backward()
        want.square().sum().backward()
        for g, w in zip(inputs, eager_inputs, strict=True):
            torch.testing.assert_close(g.grad, w.grad, rtol=0, atol=0)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (see the module docstring)"
    first_config = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, kwargs: first_config(self, kwargs)[:1]
    chunk_h.range = scalar_range
    for hkv in (1, 2):
        check(hkv)
        print(f"hkv={hkv}: ok")
    check_padding()
    print("padding: ok")
    check_documents()
    print("documents: ok")
    check_custom_op()
    print("custom-op: ok")


if __name__ == "__main__":
    main()
