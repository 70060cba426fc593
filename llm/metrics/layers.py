"""Per-layer isotropy and FFN diagnostics on a fixed validation batch (the ``layers`` of eval rows).

``layer_report`` is called at every eval with the same batch and seed, so the rows of a run, and of
every variant of a comparison, describe the same tokens. Under FSDP every rank must call it (the
forward pass gathers parameters); only the main process needs to log the result.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from llm.data.packing import model_inputs
from llm.metrics.isotropy import isotropy_metrics

# Keys of ``mlp.diagnostics(x)`` that go into a layer row (the variant decides which exist).
FFN_DIAGNOSTIC_KEYS = ("alpha", "beta", "pathway_ratio")
# Keys of ``isotropy_metrics``: all NaN for hidden states that are not finite.
ISOTROPY_KEYS = ("isoscore", "mean_cos", "eff_rank", "basis_alignment")


def _isotropy_or_nan(points: torch.Tensor) -> dict[str, float]:
    """``isotropy_metrics(points)``, or NaN for every score when a point is not finite (a diverged model):
    the eigen-decomposition would fail on them, and the eval row must still be written."""
    if not bool(torch.isfinite(points).all()):
        return dict.fromkeys(ISOTROPY_KEYS, math.nan)
    return isotropy_metrics(points)


@contextlib.contextmanager
def block_outputs(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """A list that each forward of ``model`` (an ``IsoLLMForCausalLM``) inside the block appends ``x_0, ..., x_L`` to:
    the first block's input (the embedding output) and every block's output, before the final norm. (The model's
    ``hidden_states`` end with ``norm(x_L)``, transformers' convention.) The hooks are the block's own and go at its
    end, leaving none behind (transformers' output capture, once asked, hooks every layer for good)."""
    states: list[torch.Tensor] = []
    blocks = getattr(model, "_orig_mod", model).model.layers  # whose hooks the wrapper's own call would not see
    handles = [blocks[0].register_forward_pre_hook(lambda block, args: states.append(args[0]))]
    handles += [block.register_forward_hook(lambda block, args, out: states.append(out)) for block in blocks]
    try:
        yield states
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def layer_report(model: nn.Module, input_ids: torch.Tensor, samples: int, seed: int,
                 document_eos: int | None = None) -> list[dict[str, float]]:
    """Isotropy of every hidden state and the FFN diagnostics of every block, one forward pass.

    Row ``layer = 0`` is the embedding output, row ``i`` the output of block ``i`` (before the final norm); each has
    the ``ISOTROPY_KEYS`` scores over the same ``samples`` token positions (all when there are fewer), drawn by a
    generator seeded with ``seed``, and row ``i >= 1`` block ``i``'s ``mlp.diagnostics`` of the FFN's whole input.
    ``document_eos``: the EOS id when documents are masked, after which positions restart as in training.

    ``model`` is an unwrapped ``IsoLLMForCausalLM`` (``accelerator.unwrap_model``), run in eval mode. Compiled
    parts (``train.compile``'s layers, a ``torch.compile`` wrapper) run eagerly here: one eager forward is cheap,
    and hooks added inside a compiled module would force a recompilation.
    """
    if samples <= 0:
        raise ValueError(f"samples: expected a positive integer, got {samples}")
    model = getattr(model, "_orig_mod", model)  # whose hooks the wrapper's own call would not see
    blocks = model.model.layers
    ffn_inputs: list[torch.Tensor] = []  # each block's, in order
    handles = [block.mlp.register_forward_pre_hook(lambda mlp, args: ffn_inputs.append(args[0])) for block in blocks]
    was_training = model.training
    model.eval()
    try:
        with torch.compiler.set_stance("force_eager"), warnings.catch_warnings(), block_outputs(model) as hidden_states:
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")  # one batch: no matter
            model(**model_inputs(input_ids, document_eos))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()

    positions = input_ids.numel()
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(positions, generator=generator)[:samples].to(input_ids.device)
    rows: list[dict[str, float]] = []
    for layer, hidden in enumerate(hidden_states):
        row: dict[str, float] = {"layer": layer, **_isotropy_or_nan(hidden.flatten(0, -2)[chosen])}
        if layer >= 1:
            diagnostics = blocks[layer - 1].mlp.diagnostics(ffn_inputs[layer - 1])
            row.update({key: float(diagnostics[key]) for key in FFN_DIAGNOSTIC_KEYS if key in diagnostics})
        rows.append(row)
    return rows


def flatten_for_tracker(row: dict[str, Any]) -> dict[str, float]:
    """Flat scalars of a metrics.jsonl row for TensorBoard / W&B: top-level numbers by name (but ``step``, which
    the tracker takes separately) and each layer's values as ``iso/layer03/isoscore`` (isotropy) or
    ``ffn/layer03/alpha`` (FFN diagnostics); non-finite values are kept (trackers plot them as gaps)."""
    flat: dict[str, float] = {key: float(value) for key, value in row.items()
                              if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
    for layer_row in row.get("layers", []):
        layer = int(layer_row["layer"])
        for key, value in layer_row.items():
            if key == "layer":
                continue
            group = "ffn" if key in FFN_DIAGNOSTIC_KEYS else "iso"
            flat[f"{group}/layer{layer:02d}/{key}"] = float(value)
    return flat

