"""torch.compile: every variant's training forward, fused loss and backward compile as one graph (fullgraph, no
graph break, plain and with packed documents) and give eager's loss and gradients; ``train.compile`` compiles the
decoder layer once for every layer."""

from __future__ import annotations

import pytest
import torch
from test_modeling import VOCAB, build, variant_id
from test_packing import ROWS, packed

from llm.metrics.layers import layer_report
from llm.model.attention import ATTN_SCORING_REGISTRY
from llm.model.ffn import FFN_REGISTRY, ISOGMLP_GATES
from llm.model.linear import LINEAR_REGISTRY
from llm.model.lm_head import chunk_loss_and_grad
from llm.train.setup import compile_decoder_layers

COMPILED_VARIANTS = [
    *(dict(ffn=ffn, attn_scoring=scoring) for ffn in sorted(FFN_REGISTRY) for scoring in sorted(ATTN_SCORING_REGISTRY)),
    *(dict(ffn="isogmlp", isogmlp_gate=gate) for gate in sorted(ISOGMLP_GATES) if gate != "token"),
    *(dict(ffn="iso_ln", ffn_linear=linear) for linear in sorted(LINEAR_REGISTRY) if linear != "linear"),
]
"""Every FFN x scoring, and each other IsoGMLP gate and FFN input projection once."""


def loss_and_grads(model: torch.nn.Module, module: torch.nn.Module, **inputs: torch.Tensor):
    model.zero_grad()
    loss = module(**inputs).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same_step(eager, compiled) -> None:
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-12, atol=0)
    for got, want in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("variant", COMPILED_VARIANTS, ids=variant_id)
def test_training_step_compiles_as_one_graph_and_equals_eager(variant):
    """``fullgraph=True`` fails on any graph break: a host sync, a branch on data, an op the compiler cannot
    trace. ``aot_eager`` traces forward and backward as inductor would, without generating code (seconds, not
    minutes, on CPU); fp64 so that any difference is the graph's, not rounding's."""
    model = build(**variant, iso_tanh_chunk_size=4).train()
    ids, positions, _ = packed(ROWS)
    for inputs in ({}, {"position_ids": positions[:, :-1]}):  # one document per row; packed documents
        torch._dynamo.reset()
        step = {"input_ids": ids[:, :-1], "shift_labels": ids[:, 1:], **inputs}
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        assert_same_step(loss_and_grads(model, model, **step), loss_and_grads(model, compiled, **step))


def test_train_compile_compiles_the_decoder_layer_once_for_every_layer():
    """Regional compilation: the layers share one graph, so compile time does not grow with depth; the per-layer
    metrics at an eval (hooks) leave no hook behind, nor does a training step (nothing asked), so the next step
    reuses that graph."""
    graphs = []

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    model = build(num_hidden_layers=3, ffn="isogmlp", attn_scoring="iso_tanh", iso_tanh_chunk_size=4).train()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    step = {"input_ids": ids[:, :-1], "shift_labels": ids[:, 1:]}
    eager = loss_and_grads(model, model, **step)
    compile_decoder_layers(model, backend=counting_backend)
    assert_same_step(eager, loss_and_grads(model, model, **step))
    assert len(graphs) == 1
    assert_same_step(eager, loss_and_grads(model, model, **step))  # the second step reuses it
    layer_report(model, ids, samples=4, seed=0)
    assert_same_step(eager, loss_and_grads(model, model, **step))
    assert len(graphs) == 1
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in model.modules())


def test_train_compile_fails_past_the_recompile_limit_instead_of_running_eagerly():
    """A layer recompiled past dynamo's limit raises, not a warning and an eager layer under ``train.compile``."""
    torch._dynamo.reset()
    model = build(num_hidden_layers=1).train()
    # config.patch restores both options after (pytest's monkeypatch would hide them from torch's config module)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=False, recompile_limit=1):
        compile_decoder_layers(model, backend="eager", dynamic=False)
        assert torch._dynamo.config.fail_on_recompile_limit_hit
        model(torch.zeros(1, 4, dtype=torch.long))
        with pytest.raises(Exception, match="recompile_limit"):
            model(torch.zeros(1, 5, dtype=torch.long))  # a second static shape: a second graph, past the limit of 1
    torch._dynamo.reset()


def test_the_loss_kernel_compiled_equals_eager():
    """The fused loss's chunk kernel as CUDA runs it (compiled: the gradient's onehot as a comparison the
    compiler fuses) against eager's scatter, fp64."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=g, dtype=torch.float64)
    target = torch.randint(0, 50, (7, 1), generator=g)
    keep = torch.rand(7, 1, generator=g) > 0.3
    eager = chunk_loss_and_grad(logits, target, keep)
    compiled = torch.compile(chunk_loss_and_grad, fullgraph=True, backend="aot_eager")(logits, target, keep)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    probs = logits.softmax(-1)
    torch.testing.assert_close(eager[0], -(probs.log().gather(1, target) * keep).sum(), rtol=1e-14, atol=0)
    torch.testing.assert_close(eager[1], probs - torch.nn.functional.one_hot(target[:, 0], 50), rtol=1e-14,
                               atol=1e-16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn_scoring", sorted(ATTN_SCORING_REGISTRY))
def test_cuda_compiled_step_matches_eager_in_bf16(attn_scoring):
    """The CUDA paths CPU tests cannot reach: inductor's kernels for the layers and the loss's chunk kernel,
    FlexAttention's packed documents. bf16 autocast, so eager and compiled agree to bf16's rounding."""
    shape = dict(attn_scoring=attn_scoring, dtype=torch.float32, vocab_size=4096, hidden_size=128,
                 intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, iso_tanh_chunk_size=64)
    eager_model, compiled_model = (build(**shape).cuda().train() for _ in range(2))  # same seed: same weights
    torch._dynamo.reset()
    compile_decoder_layers(compiled_model)
    ids = torch.randint(0, 4096, (2, 513), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in (100, 300, 112)])[None].cuda()
    for inputs in ({}, {"position_ids": positions}):  # one document per row; packed documents
        step = {"input_ids": ids[:, :-1], "shift_labels": ids[:, 1:], **inputs}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eager = loss_and_grads(eager_model, eager_model, **step)
            compiled = loss_and_grads(compiled_model, compiled_model, **step)
        torch.testing.assert_close(compiled[0], eager[0], rtol=2e-2, atol=0)
        worst = max(((c - e).norm() / e.norm()).item() for c, e in zip(compiled[1], eager[1], strict=True)
                    if e.norm() > 0)
        assert worst < 5e-2, worst
