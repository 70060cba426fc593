"""Decoding through a static cache (``IsoLLMCache(num_layers, max_length)``, cache.py), one token per call after
the prompt, each step one CUDA graph replay.

At the end of the prompt (``static_prompt``) softmax's keys and values move into buffers of ``max_length`` slots
and the step's bookkeeping (the next slot, which slots hold real tokens) into device tensors. Every step
(``decode_step``) then builds one ``cache.DecodeStep`` (the slot, the slots each row sees, whether its token is
real), which every layer's attention and FFN receive as an argument, updates each state in place and reads
nothing back to the host, so each has the same shapes, memory and kernels: on CUDA the first step is captured as a
graph and every later one replays it, without a kernel launch per operation (``static_step``).

Why a hand-made capture rather than ``torch.compile(mode="reduce-overhead")``, gpt-fast's way, which captures a
compiled step as CUDA graphs too: the step here is plain eager code, so the hub model decodes without a compiler
and without a compilation per model and batch size; the tests compile it all the same, with ``fullgraph=True``, to
prove it capturable.

Why the softmax step is two plain matmuls (llm/model/attention.py, ``SoftmaxScoring.static_step``) rather than
SDPA with a key mask: no SDPA kernel that takes a mask splits the keys over the GPU. The one SDPA picks for a
masked single query reads each KV head's keys in sequence, with one row of queries per KV head, so a step took
34 ms per token at 32k of context on an H100 (6 ms at 4k; docs/performance.md). A matmul over every slot spreads
the keys over every SM, and the softmax in fp32 keeps the outputs those of the growing cache (the fp64 equality
tests in tests/model/test_static_decoding.py).

Copied to the hub with the modelling code: torch only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .cache import DecodeStep, IsoLLMCache, StaticDecoding

if TYPE_CHECKING:
    from .modeling_isollm import IsoLLMModel


def static_prompt(model: IsoLLMModel, cache: IsoLLMCache, padding_mask: torch.Tensor | None,
                  shape: tuple[int, int], device: torch.device) -> None:
    """After a static cache's prompt (its first call, of ``shape`` ``(B, T)``): its ``max_length`` slots, the
    prompt's in them, and each layer's scoring state turned into its static one."""
    if (rope_type := model.rotary_emb.rope_type) in ("dynamic", "longrope"):  # updated by dynamic_rope_update
        raise ValueError(f"a static cache cannot decode with rope_type={rope_type}, whose frequencies follow the "
                         f"sequence length (a CUDA graph step replays fixed ones); generate with a dynamic cache")
    real = padding_mask if padding_mask is not None else torch.ones(shape, dtype=torch.bool, device=device)
    cache.decoding = StaticDecoding(slot=torch.full((1,), shape[1], device=device),
                                    real_keys=F.pad(real, (0, cache.max_length - real.shape[1])))
    for layer, state in zip(model.layers, cache.layers, strict=True):
        state.attention = layer.self_attn.scoring.static_state(state.attention, cache.max_length)


def static_step(model: IsoLLMModel, input_ids: torch.Tensor, padding_mask: torch.Tensor | None,
                cache: IsoLLMCache) -> torch.Tensor:
    """``decode_step`` for one token after a static cache's prompt, before the final norm: on CUDA the first step
    runs eagerly and is captured, every later one replays the capture; elsewhere each is called as it is (where it
    is what the tests check)."""
    if input_ids.shape[1] != 1 or torch.is_grad_enabled():
        raise ValueError(f"a static cache takes one token per call after its prompt, under torch.no_grad(); got "
                         f"{input_ids.shape[1]} tokens, autograd {'on' if torch.is_grad_enabled() else 'off'}")
    if cache.seen_tokens >= cache.max_length:
        raise ValueError(f"the static cache is full: it holds max_length={cache.max_length} tokens")
    cache.seen_tokens += 1
    real = (torch.ones_like(input_ids, dtype=torch.bool) if padding_mask is None
            else padding_mask[:, -1:].contiguous())
    if not input_ids.is_cuda:
        return decode_step(model, input_ids, real, cache)
    if cache.decoding.graph is None:
        output, cache.decoding.graph = _run_and_capture(functools.partial(decode_step, model, cache=cache),
                                                        (input_ids, real))
        return output
    graph, inputs, output = cache.decoding.graph
    for buffer, value in zip(inputs, (input_ids, real), strict=True):
        buffer.copy_(value)
    graph.replay()
    return output


def decode_step(model: IsoLLMModel, input_ids: torch.Tensor, real: torch.Tensor, cache: IsoLLMCache) -> torch.Tensor:
    """One token per row (``input_ids`` ``[B, 1]``; ``real`` ``[B, 1]``, False at padding) through a static
    cache, before the final norm. Every state is updated in place and no value is read back to the host."""
    decoding = cache.decoding
    decoding.real_keys.index_copy_(1, decoding.slot, real)
    own = torch.arange(decoding.real_keys.shape[1], device=decoding.slot.device) == decoding.slot
    step = DecodeStep(decoding.slot, (decoding.real_keys | own)[:, None, None], real)  # once for every layer
    position = (decoding.real_keys.sum(-1, keepdim=True) - 1).clamp_min(0)  # as forward counts real tokens
    x = model.embed_tokens(input_ids)
    cos, sin = model.rotary_emb(x, position)
    for layer, state in zip(model.layers, cache.layers, strict=True):
        x = layer(x, cos, sin, state, real, step=step)  # the step's padding mask: whether its token is real
    decoding.slot.add_(1)
    return x


def _run_and_capture(step: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                     ) -> tuple[torch.Tensor, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]]:
    """The first decoding step: ``step(*inputs)`` run for real, then captured as a CUDA graph for the next ones;
    returns its output and ``(graph, input buffers, output buffer)``.

    The real run is torch.cuda.graphs' warm-up. It runs on a side stream that first waits for the current one (which
    wrote the token and the state), and the current stream then waits for it, so every later use of its output and
    of the state is ordered after it. Whatever the step initialises lazily (cuBLAS handles and workspaces, kernels
    loaded or autotuned on first use) then exists before the capture, during which nothing may synchronise with
    the host. The run advances every state by this token, as any step does. A capture records the kernels without
    running them, so it leaves the state as the real run left it, and its first replay, at the next token, reads
    that state from the same memory: every step writes its states in place (tests/model/test_static_decoding.py),
    so nothing of the cache is copied. The input buffers are copies, allocated before the capture, into which each
    replay's token is copied; the output lives in the graph's pool, rewritten by every replay.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        output = step(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    output.record_stream(torch.cuda.current_stream())  # allocated on the side stream, used and freed on this one
    buffers = tuple(x.clone() for x in inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*buffers)
    return output, (graph, buffers, captured)
