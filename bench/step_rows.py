"""The rows bench_train_step.py times: each a model, how it computes its loss, and its training step.

A step is what the trainer does per micro-batch (bench/harness.py ``make_step``): forward and loss, then backward,
both inside the trainer's TF32 scope (``llm.train.step.tf32_matmuls``, as ``train_step`` wraps them), then fused
AdamW, or Muon on the hidden matrices with AdamW on the rest, as ``build_optimizer`` builds it for the row's
``train.optimizer`` (bench_train_step.py; bench_trees.py's workers: fused AdamW over all parameters).

Compilation: ours as ``train.compile`` does (``compile_decoder_layers``), transformers' Qwen3 whole. Dynamo keeps
its compiled code per Python code object, so every row's decoder layers (one class, one ``forward``) share one
cache: each structurally different row adds an entry, and past ``recompile_limit`` entries (8 by default) dynamo
would run the frame eagerly behind a log warning. ``strict_compilation`` raises the limit to cover the rows and
makes hitting it an error; each row then checks, on a second step under ``torch.compiler.set_stance
("fail_on_recompile")``, that it runs compiled code without compiling again (``check_compiled``), and the timed
rounds run under that stance too: a row that would recompile or fall back fails loudly, never silently eager.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from harness import packed_positions
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from llm.model import IsoLLMConfig, IsoLLMForCausalLM, ModelConfig
from llm.train.setup import compile_decoder_layers

QWEN3_ROWS = {
    "loss-outside": "transformers Qwen3 (loss eager, outside)",
    "loss-inside": "transformers Qwen3 (loss compiled)",
    "liger": "transformers Qwen3 + Liger FLCE",
}
"""``--qwen3`` choices and their row names. loss-outside: today's row, fp32 cross-entropy computed eagerly from
the logits the compiled model returns (an upper bound on our lead). loss-inside: the fair row, ``labels`` passed so
that transformers' own fp32 loss (``ForCausalLMLoss``) is traced into the compiled graph. liger: the compiled
trunk, then Liger-Kernel's fused linear cross-entropy on the last hidden states (no logits kept; CUDA only)."""


@dataclass(frozen=True)
class Spec:
    """A row of our model to build: its config, what changes its step, and the row its ratio is over."""

    config: ModelConfig
    reference: str | None = None
    """The row its ratio is over (None: the bench's baseline)."""
    batch: int = 0
    """The micro batch (0: ``--batch``)."""
    packed_docs: int = 0
    tf32: bool = True
    activation_checkpointing: int = 0
    optimizer: str = "adamw"
    """``train.optimizer`` of the row's step (the trainer's ``build_optimizer``)."""


@dataclass
class Row:
    """A timed row: the module whose parameters train, a closure computing the loss of the bench's batch, and the
    spec it was built from (transformers' Qwen3 rows: ``Spec(config)``, over the bench's baseline)."""

    model: nn.Module
    loss: Callable[[], torch.Tensor]
    tokens: int
    """Tokens a step trains on (rows may differ in batch size: their ratios compare tokens/s)."""
    spec: Spec
    """The model config its FLOPs are counted from, what changes its step, and the row its ratio is over (None:
    the bench's baseline row, or this row where it is the baseline)."""


def ours(spec: Spec, batch: torch.Tensor, compile_: bool) -> Row:
    """Our model's row of ``spec`` on ``batch`` (a fresh random one where ``spec.batch`` names another size); the
    loss fused with the LM head (``shift_labels``, as the trainer calls it); with ``activation_checkpointing`` = N
    every N-th layer recomputed in the backward (``train.activation_checkpointing``, set before compilation as the
    trainer sets it); with ``packed_docs``, position ids restarting at documents (harness.py ``packed_positions``)."""
    if spec.batch:
        batch = torch.randint(0, spec.config.vocab_size, (spec.batch, batch.shape[1]), device=batch.device)
    model = IsoLLMForCausalLM(IsoLLMConfig.from_model_config(spec.config)).to(batch.device).train()
    if spec.activation_checkpointing:
        model.activation_checkpointing_enable(every_n_layers=spec.activation_checkpointing)
    if compile_:
        compile_decoder_layers(model)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    positions = packed_positions(*inputs.shape, spec.packed_docs, batch.device) if spec.packed_docs else None
    return Row(model, lambda: model(inputs, position_ids=positions, shift_labels=targets, fused_loss=True).loss,
               inputs.numel(), spec)


def qwen3(kind: str, config: ModelConfig, batch: torch.Tensor, compile_: bool) -> Row:
    """transformers' Qwen3 row of ``kind`` (``QWEN3_ROWS``): transformers' own Qwen3 at our shape (SDPA
    attention, as ours); ImportError where Liger-Kernel is absent."""
    shared = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    model = Qwen3ForCausalLM(Qwen3Config(**{key: getattr(config, key) for key in shared}, rope_parameters=rope,
                                         head_dim=config.resolved_head_dim, attn_implementation="sdpa"))
    model.to(batch.device).train()
    inputs, targets = batch[:, :-1], batch[:, 1:].contiguous()  # its loss views the labels flat
    if kind == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # the gpu extra's, CUDA only

        flce, trunk = LigerFusedLinearCrossEntropyLoss(), torch.compile(model.model) if compile_ else model.model

        def loss() -> torch.Tensor:
            return flce(model.lm_head.weight, trunk(inputs).last_hidden_state.flatten(0, 1), targets.flatten())
    else:
        compiled = torch.compile(model) if compile_ else model
        if kind == "loss-inside":
            def loss() -> torch.Tensor:
                return compiled(inputs, labels=targets, shift_labels=targets).loss
        else:
            def loss() -> torch.Tensor:
                return nn.functional.cross_entropy(compiled(inputs).logits.flatten(0, 1).float(), targets.flatten())
    return Row(model, loss, inputs.numel(), Spec(config))  # over the baseline


def saved_bytes(row: Row) -> int:
    """The bytes autograd keeps from the row's forward pass for its backward (the activations; the weights
    excluded): each saved tensor's storage counted once through saved-tensor hooks, an exact count."""
    params = {p.untyped_storage().data_ptr() for p in row.model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = row.loss()
    loss.backward()
    row.model.zero_grad(set_to_none=True)
    return sum(storages.values())


@contextmanager
def strict_compilation(rows: int) -> Iterator[None]:
    """Room in dynamo's per-code cache for ``rows`` rows (a few entries each), and an error, not an eager
    fallback, where it is still exceeded; and static shapes for every row, as a training run compiles its one
    shape (by default a second shape would make dynamo compile a dynamic-shape graph, which other rows' shapes
    would then also hit). All three are ``torch._dynamo.config`` options (no public equivalent);
    tests/bench/test_bench_step.py fails if they are renamed."""
    import torch._dynamo.config as dynamo

    with dynamo.patch(recompile_limit=max(dynamo.recompile_limit, 4 * rows), fail_on_recompile_limit_hit=True,
                      automatic_dynamic_shapes=False):
        yield


def check_compiled(step: Callable[[], None], name: str) -> None:
    """Run ``step`` (already warmed up once) again where dynamo may not compile: raises, naming the row, if the
    row recompiles on every call or runs eagerly."""
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            step()
    except RuntimeError as err:
        raise RuntimeError(f"row {name!r} recompiles after its warm-up step, so it would be timed partly "
                           f"uncompiled: {str(err).splitlines()[0]}") from err
