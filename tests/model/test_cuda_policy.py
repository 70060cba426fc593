"""CUDA's kernel choices (llm/model/acceleration.py) run on CPU tensors, against the portable eager forms: the fused
loss's compiled chunk kernel and FP8 logits, forward and backward; the compiled document block mask and compiled
FlexAttention with it, as training selects it for packed documents, through an evaluation (forward: torch 2.13 has
no FlexAttention backward on CPU); iso_tanh's bf16 operands accumulated in fp32; the outputs transformers' capture
records (``output_attentions``, ``output_hidden_states``) from compiled layers. Where the GPU path promises no
recompile after its first step, the later steps run under ``torch.compiler.set_stance("fail_on_recompile")``, and the
compiled kernels are ``fullgraph`` where the GPU compiles them so (the loss's), so a graph break fails too.

The policy runs here with ``compiler="aot_eager"``: dynamo and AOTAutograd trace forward and backward as for
inductor, without generating code (seconds, not minutes, on two cores). CUDA's half-operand GEMMs (``out_dtype``
overloads of ``bmm`` and ``addmm``) have no CPU kernel: the ``cuda_policy`` fixture registers one for this test,
through ``torch.library``, computing what the GPU's does (the half-precision operands' exact products, accumulated in
fp32), and counts its calls, so that a test also shows the CUDA branch ran."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from llm.config import DataConfig, RunConfig
from llm.model import IsoLLMConfig, IsoLLMForCausalLM
from llm.model.acceleration import CUDA, POLICIES, acceleration
from llm.model.attention import SoftmaxScoring
from llm.model.config import ModelConfig
from llm.model.iso_tanh import iso_tanh_chunked
from llm.model.lm_head import linear_cross_entropy
from llm.train.evaluate import evaluate
from llm.train.setup import compile_decoder_layers, train_attention

CUDA_ON_CPU = dataclasses.replace(CUDA, compiler="aot_eager")


@pytest.fixture
def cuda_policy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """CPU tensors take CUDA's choices; yields the calls of each ``out_dtype`` GEMM by overload name."""
    calls: Counter[str] = Counter()

    def bmm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        calls["bmm.dtype"] += 1
        return torch.bmm(a.to(out_dtype), b.to(out_dtype))

    def addmm_dtype_out(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *,
                        beta: float = 1, alpha: float = 1, out: torch.Tensor) -> torch.Tensor:
        calls["addmm.dtype_out"] += 1
        return torch.addmm(acc, a.to(out_dtype), b.to(out_dtype), beta=beta, alpha=alpha, out=out)

    library = torch.library.Library("aten", "IMPL")
    library.impl("bmm.dtype", bmm_dtype, "CPU")
    library.impl("addmm.dtype_out", addmm_dtype_out, "CPU")
    monkeypatch.setitem(POLICIES, "cpu", CUDA_ON_CPU)
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()
    del library  # its registrations go with it (torch.library's finalizer)


def test_the_policy_is_the_device_types_and_a_test_can_map_cpu_to_cudas(cuda_policy: Counter[str]) -> None:
    assert acceleration(torch.device("cuda")) == CUDA
    assert acceleration(torch.device("cpu")) == CUDA_ON_CPU
    assert acceleration(torch.device("meta")).compiler is None


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fused_loss_compiled_as_on_cuda_equals_eager_and_never_recompiles(cuda_policy: Counter[str],
                                                                          fp8: bool) -> None:
    """bf16 hidden states and weight, three chunks (the last one shorter): the compiled chunk kernel (and FP8
    logits) and the weight gradient accumulated in fp32 by the GEMM give eager's loss and hidden-state gradient, and a
    weight gradient at least as close to fp64's; the second step compiles nothing more."""
    g = torch.Generator()

    def step(policy: str, seed: int) -> list[torch.Tensor]:
        g.manual_seed(seed)
        hidden = torch.randn(40, 16, generator=g).bfloat16().requires_grad_()
        weight = torch.randn(96, 16, generator=g).div(4).bfloat16().requires_grad_()
        targets = torch.randint(0, 96, (40,), generator=g)
        targets[::7] = -100
        if policy == "fp64":
            hidden, weight = (x.detach().double().requires_grad_() for x in (hidden, weight))
            loss = torch.nn.functional.cross_entropy(hidden @ weight.T, targets)
        else:
            with pytest.MonkeyPatch.context() as patch:
                if policy == "portable":
                    patch.delitem(POLICIES, "cpu")
                loss = linear_cross_entropy(hidden, weight, targets, chunk_rows=16, fp8=fp8)
        loss.backward()
        return [loss.detach(), hidden.grad, weight.grad]

    cuda, portable, fp64 = step("cuda", 1), step("portable", 1), step("fp64", 1)
    assert cuda_policy["addmm.dtype_out"] == 3 and cuda[2].dtype == torch.bfloat16
    torch.testing.assert_close(cuda[0], portable[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(cuda[1], portable[1], rtol=0, atol=0)
    error = lambda grad: ((grad.double() - fp64[2]).norm() / fp64[2].norm()).item()  # noqa: E731
    assert error(cuda[2]) <= error(portable[2]) * 1.01 and error(cuda[2]) < (0.1 if fp8 else 2e-2)
    with torch.compiler.set_stance("fail_on_recompile"):
        torch.testing.assert_close(step("cuda", 2)[0], step("portable", 2)[0], rtol=1e-6, atol=0)


def packed_model() -> IsoLLMForCausalLM:
    torch.manual_seed(0)
    config = IsoLLMConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
    return IsoLLMForCausalLM(config).double()


def test_packed_documents_through_flex_attention_as_training_on_cuda_picks_it(cuda_policy: Counter[str]) -> None:
    """Training's choice for softmax with packed documents (``flex_attention``), the document block mask and
    FlexAttention compiled, through an evaluation of packed windows (fp64): the dense SDPA mask's loss, per window
    and in all; a second evaluation, of other windows, compiles nothing more."""
    config = RunConfig(model=ModelConfig(), data=DataConfig(document_masking=True))
    assert train_attention(config, torch.device("cpu")) == "flex_attention"
    windows = torch.randint(4, 64, (4, 33), generator=torch.Generator().manual_seed(0))
    windows[:, [5, 17, 18]] = 2  # EOS: documents of 6, 12, 1 and 14 tokens
    documents = SoftmaxScoring.document_mask(torch.zeros(1, 32, dtype=torch.bool))
    assert isinstance(documents, BlockMask)
    portable = packed_model()
    model = packed_model()
    model.set_attn_implementation("flex_attention")
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(POLICIES, "cpu")
        want = [evaluate(portable, w, 2, document_eos=2)["val_loss"] for w in (windows[:2], windows[2:])]
    assert evaluate(model, windows[:2], 2, document_eos=2)["val_loss"] == pytest.approx(want[0], rel=1e-12)
    with torch.compiler.set_stance("fail_on_recompile"):
        assert evaluate(model, windows[2:], 2, document_eos=2)["val_loss"] == pytest.approx(want[1], rel=1e-12)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_iso_tanh_bf16_operands_accumulate_in_fp32_within_the_outputs_rounding(cuda_policy: Counter[str],
                                                                               packed: bool) -> None:
    """bf16 q, k, v multiplied as they are, the GEMM accumulating in fp32 (CUDA's ``bmm`` overload): eager's fp32
    result exactly, and within twice bf16's rounding of the fp64 output, plain and packed."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 256, 16, generator=g).bfloat16() for h in (4, 2, 2))
    starts = torch.zeros(2, 256, dtype=torch.bool)
    starts[:, [0, 70, 150]] = True
    doc_starts = starts if packed else None
    ref = iso_tanh_chunked(*(x.double() for x in (q, k, v)), 32, doc_starts=doc_starts)[0]
    out = iso_tanh_chunked(q, k, v, 32, doc_starts=doc_starts)[0]
    assert cuda_policy["bmm.dtype"] > 0
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(POLICIES, "cpu")
        assert torch.equal(out, iso_tanh_chunked(q, k, v, 32, doc_starts=doc_starts)[0])
    rounding = ((ref.bfloat16().double() - ref).norm() / ref.norm()).item()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2 * rounding


@pytest.mark.parametrize("attn_scoring", ["softmax", "iso_tanh"])
def test_captured_outputs_of_compiled_layers_equal_eager_and_never_recompile(cuda_policy: Counter[str],
                                                                             attn_scoring: str) -> None:
    """``train.compile``'s layers asked for ``output_attentions`` and ``output_hidden_states`` (transformers'
    ``capture_outputs`` records them through hooks): eager's weights and hidden states, and the next call of the same
    shape compiles nothing more. Not ``fullgraph``: the hooks read a ``ContextVar``, which dynamo cannot trace inside
    a layer compiled on its own (docs/ARCHITECTURE.md, "The CUDA path on a CPU")."""
    torch.manual_seed(0)
    config = IsoLLMConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, attn_scoring=attn_scoring,
                          iso_tanh_chunk_size=4, attn_implementation="eager")
    model = IsoLLMForCausalLM(config).double().eval()
    ids = torch.randint(0, 64, (2, 3, 9), generator=torch.Generator().manual_seed(0))  # two calls of [3, 9]
    with torch.no_grad():
        eager = [model(i, output_attentions=True, output_hidden_states=True) for i in ids]
        compile_decoder_layers(model, backend="aot_eager")
        for i, (row, want) in enumerate(zip(ids, eager, strict=True)):
            with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
                got = model(row, output_attentions=True, output_hidden_states=True)
            for a, b in zip([*got.attentions, *got.hidden_states, got.logits],
                            [*want.attentions, *want.hidden_states, want.logits], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
