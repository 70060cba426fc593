"""Memory per GPU of a training run, by launch mode, and the largest micro batch that fits (``isollm-params --plan``).

Static parts, with ``P`` parameters, ``N`` GPUs and AdamW (two fp32 moments, ``8P`` below). Under
``train.optimizer=muon`` the ``M`` elements of the Muon matrices (``llm.train.optim.muon_matrices``) hold one fp32
momentum buffer each and the rest AdamW's two moments: ``8P - 4M`` (Muon runs on single and ddp only). AdamW's
per-tensor step counters (a scalar each) are left out.

==========  ===========================================  ======================  ==================
mode        weights                                      gradients               optimizer state
==========  ===========================================  ======================  ==================
single      4P (fp32; bf16 is autocast)                  4P                      8P
ddp         4P                                           4P + 4P DDP buckets     8P
fsdp2       4P/N + bf16 copies of the gathered units     4P/N                    8P/N
zero2       2P bf16 + 4P/N fp32 master                   4P/N + reduce bucket    8P/N
zero3       2P/N bf16 + 4P/N master + gathered units     4P/N + reduce bucket    8P/N
==========  ===========================================  ======================  ==================

"Gathered units" are what FSDP2 and ZeRO-3 hold unsharded at once: the root (embedding, shared with the
tied head) and two decoder layers (the running one and the prefetched one), in bf16. The reduce bucket is
``reduce_bucket_size`` of launch/deepspeed/*.json (5e7 elements, bf16). In fp32 (``precision="fp32"``)
the DeepSpeed modes hold no bf16 copy and no separate master.

Activations are what autograd keeps for backward, per token: ``ACTIVATION_ELEMENTS`` below, counted with
``torch.autograd.graph.saved_tensors_hooks`` on the CPU model in fp32 (tests/train/test_memory_plan.py checks the
count at other shapes). Under bf16 autocast the matmul inputs are kept in bf16 and the residual stream and
norms in fp32, taken here as 3 bytes an element on average (the GPU check compares with the measured peak).
With activation checkpointing (``train.activation_checkpointing``) a checkpointed layer keeps only its input, and
the backward pass adds one recomputed layer at a time (``activation_bytes``). The fused LM head adds its chunk of
logits (``llm.model.lm_head``) and the fp32 gradient of the (tied) embedding it computes in the forward pass. A
margin of ``RESERVED_FRACTION`` of the GPU's memory is left to the CUDA context, the allocator's fragmentation
and temporaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llm.model import ModelConfig, param_counts
from llm.model.ffn import resolve_intermediate_size
from llm.model.lm_head import LOGITS_PER_CHUNK, MIN_CHUNK_ROWS
from llm.model.modeling_isollm import meta_model
from llm.train.optim import muon_matrices

__all__ = ["MODES", "MemoryPlan", "activation_bytes", "checkpointed_layers", "largest_micro_batch", "plan_memory",
           "recompute_bytes"]

MODES = ("single", "ddp", "fsdp2", "zero2", "zero3")
# ``reduce_bucket_size`` of launch/deepspeed/zero2.json and zero3.json.
REDUCE_BUCKET_ELEMENTS = 50_000_000
RESERVED_FRACTION = 0.1
ACTIVATION_BYTES = {"fp32": 4.0, "bf16": 3.0}

# Elements per token per layer kept by the FFN block, per intermediate width (its norm keeps 2 per hidden
# width): SwiGLU keeps its gate and up projections, their product and the down projection's input.
FFN_ACTIVATIONS = {"swiglu": 4, "isogmlp": 7, "iso_ln": 6, "iso_mlp": 2}


def _layer_elements(config: ModelConfig, seq_len: int) -> float:
    """Elements per token one decoder layer keeps for backward (fp32 count; see the module docstring)."""
    h, heads, hd = config.hidden_size, config.num_attention_heads, config.resolved_head_dim
    q, kv = heads * hd, config.num_key_value_heads * hd
    attention = 2 * h + 4 * q + 3 * kv + 3 * heads  # norm, qkv input, q/k norms, SDPA inputs/output/logsumexp
    if config.attn_scoring == "iso_tanh":  # the chunked form's per-chunk scores and states, T padded to chunks
        chunk = min(config.iso_tanh_chunk_size, seq_len)
        padding = math.ceil(seq_len / chunk) * chunk / seq_len
        attention += padding * (2.625 * q + 3.25 * kv + heads * (chunk + 2))
    ffn = 2 * h + FFN_ACTIVATIONS[config.ffn] * resolve_intermediate_size(config)
    return attention + ffn


def checkpointed_layers(num_layers: int, every: int) -> int:
    """How many decoder layers ``train.activation_checkpointing = every`` recomputes (layers 0, n, 2n, ...)."""
    return math.ceil(num_layers / every) if every else 0


def recompute_bytes(config: ModelConfig, micro_batch: int, seq_len: int, precision: str = "bf16") -> float:
    """Bytes one decoder layer keeps for backward: what recomputing a checkpointed layer adds to the peak."""
    return micro_batch * seq_len * _layer_elements(config, seq_len) * ACTIVATION_BYTES[precision]


def activation_bytes(config: ModelConfig, micro_batch: int, seq_len: int, precision: str = "bf16",
                     checkpoint_every: int = 0) -> float:
    """Bytes autograd holds for one micro batch at its peak (without the weights): what the forward pass keeps, a
    checkpointed layer only its input, and with checkpointing one recomputed layer (``recompute_bytes``)."""
    layers, checkpointed = config.num_hidden_layers, checkpointed_layers(config.num_hidden_layers, checkpoint_every)
    per_token = (layers - checkpointed) * _layer_elements(config, seq_len) + (2 + checkpointed) * config.hidden_size
    kept = micro_batch * seq_len * per_token * ACTIVATION_BYTES[precision]
    return kept + (recompute_bytes(config, micro_batch, seq_len, precision) if checkpointed else 0.0)


@dataclass(frozen=True)
class MemoryPlan:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    """The fused LM head's chunk of logits with its gradient, and the embedding gradient it computes."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits


def plan_memory(config: ModelConfig, mode: str, gpus: int, micro_batch: int, seq_len: int,
                precision: str = "bf16", checkpoint_every: int = 0, optimizer: str = "adamw") -> MemoryPlan:
    """Estimated bytes per GPU of training ``config`` with ``mode`` over ``gpus`` GPUs (``checkpoint_every``:
    ``train.activation_checkpointing``; ``optimizer``: ``train.optimizer``)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    p, non_embedding = param_counts(config)  # builds the model on the meta device: once per plan
    half = precision == "bf16"
    bucket = 2 * REDUCE_BUCKET_ELEMENTS if half else 4 * REDUCE_BUCKET_ELEMENTS
    # what FSDP2 / ZeRO-3 hold unsharded at once: the root (embedding) and two decoder layers
    gathered = (2 if half else 4) * ((p - non_embedding) + 2 * non_embedding // config.num_hidden_layers)
    muon = sum(m.numel() for m in muon_matrices(meta_model(config))) if optimizer == "muon" else 0
    state = 8 * p - 4 * muon
    weights, gradients, state = {
        "single": (4 * p, 4 * p, state),
        "ddp": (4 * p, 8 * p, state),
        "fsdp2": (4 * p / gpus + gathered, 4 * p / gpus, state / gpus),
        "zero2": ((2 * p + 4 * p / gpus) if half else 4 * p, 4 * p / gpus + bucket, state / gpus),
        "zero3": ((6 * p / gpus if half else 4 * p / gpus) + gathered, 4 * p / gpus + bucket, state / gpus)}[mode]
    rows = max(MIN_CHUNK_ROWS, LOGITS_PER_CHUNK["cuda"] // config.vocab_size)
    logits = 2 * 4 * rows * config.vocab_size + 4 * config.vocab_size * config.hidden_size
    return MemoryPlan(weights, gradients, state,
                      activation_bytes(config, micro_batch, seq_len, precision, checkpoint_every), logits)


def largest_micro_batch(config: ModelConfig, mode: str, gpus: int, gpu_bytes: float, seq_len: int,
                        precision: str = "bf16", checkpoint_every: int = 0, optimizer: str = "adamw") -> int:
    """The largest micro batch whose plan fits in ``(1 - RESERVED_FRACTION) * gpu_bytes``; 0 if none does."""
    fixed = plan_memory(config, mode, gpus, 0, seq_len, precision, checkpoint_every, optimizer).total
    per_sequence = activation_bytes(config, 1, seq_len, precision, checkpoint_every)
    return max(0, int(((1 - RESERVED_FRACTION) * gpu_bytes - fixed) // per_sequence))
