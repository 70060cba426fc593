"""Export a SwiGLU + softmax isollm model to the stock Qwen3 format (``Qwen3ForCausalLM``, no remote code).

isollm's decoder is Qwen3's with two projections fused for speed; the export splits them back:

    layers.i.self_attn.qkv_proj  [(H + 2 Hkv) D, d] -> q_proj [H D, d], k_proj [Hkv D, d], v_proj [Hkv D, d]
    layers.i.mlp.in_proj         [2 h, d]           -> gate_proj [h, d], up_proj [h, d]   (rows [gate; up])

Every other tensor keeps its name. RMSNorm, rotate-half RoPE (scaled or not), QK-norm before RoPE and the
``1/sqrt(D)`` softmax are Qwen3's, so transformers' own ``Qwen3ForCausalLM`` gives the same logits.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

from llm.model import IsoLLMForCausalLM, ModelConfig
from llm.model.config import ConfigError
from llm.train.model_dir import save_model_dir

QWEN3_REQUIREMENTS: dict[str, object] = {
    "ffn": "swiglu",
    "attn_scoring": "softmax",
    "ffn_linear": "linear",
    "qk_norm": True,  # Qwen3 always normalises q and k; no weight setting makes that the identity
    "parametrization": "standard",  # muP's logit multiplier and attention scale have no Qwen3 field
}
"""The fields stock Qwen3 can express, and the value each must have."""
QWEN3_SHARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                       "max_position_embeddings", "initializer_range", "rms_norm_eps", "tie_word_embeddings")
"""The fields ``Qwen3Config`` takes under the same name and meaning."""


def check_qwen3_exportable(config: ModelConfig) -> None:
    """Raise ``ConfigError`` naming the first field stock Qwen3 cannot express."""
    for name, required in QWEN3_REQUIREMENTS.items():
        value = getattr(config, name)
        if value != required:
            raise ConfigError(name, f"stock Qwen3 export needs {name}={required!r}, got {value!r}; "
                              "save this variant with llm.hf.save_for_hub (trust_remote_code) instead")
    if (partial := config.resolved_rope_parameters["partial_rotary_factor"]) != 1:  # Qwen3 rotates whole heads
        raise ConfigError("rope_parameters.partial_rotary_factor", f"stock Qwen3 export needs 1, got {partial}; "
                          "save this model with llm.hf.save_for_hub (trust_remote_code) instead")


def qwen3_config(model: IsoLLMForCausalLM) -> Qwen3Config:
    """The ``Qwen3Config`` of the same architecture, RoPE scaling included (``rope_parameters``, which both models
    compute with transformers' functions)."""
    config = model.config
    check_qwen3_exportable(config)
    return Qwen3Config(
        intermediate_size=model.model.layers[0].mlp.intermediate_size, head_dim=config.resolved_head_dim,
        hidden_act="silu", rope_parameters=dict(config.resolved_rope_parameters),
        attention_bias=False, use_sliding_window=False, **{name: getattr(config, name) for name in QWEN3_SHARED_FIELDS},
        **{name: getattr(config, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")})


def qwen3_state_dict(model: IsoLLMForCausalLM) -> dict[str, torch.Tensor]:
    """``model``'s weights under Qwen3's names, fused projections split (views, no copies)."""
    check_qwen3_exportable(model.config)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("self_attn.qkv_proj.weight"):
            attn = model.get_submodule(name.removesuffix(".qkv_proj.weight"))
            sizes = [n * attn.head_dim for n in (attn.num_heads, attn.num_kv_heads, attn.num_kv_heads)]
            prefix = name.removesuffix("qkv_proj.weight")
            for part, weight in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes), strict=True):
                out[f"{prefix}{part}.weight"] = weight
        elif name.endswith("mlp.in_proj.weight"):
            prefix = name.removesuffix("in_proj.weight")
            for part, weight in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
                out[f"{prefix}{part}.weight"] = weight
        else:
            out[name] = tensor
    return out


def export_qwen3(model: IsoLLMForCausalLM, directory: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write ``directory`` as a stock Qwen3 checkpoint: ``AutoModelForCausalLM.from_pretrained(directory)``
    loads it with transformers alone (no ``trust_remote_code``) and gives ``model``'s logits; with
    ``tokenizer``, ``AutoTokenizer`` and ``pipeline("text-generation")`` load it too (``save_model_dir``).
    A variant Qwen3 cannot express is a ``ConfigError`` (``check_qwen3_exportable``)."""
    qwen3 = Qwen3ForCausalLM(qwen3_config(model)).to(model.dtype)
    # strict: every Qwen3 tensor is written and nothing of ours is dropped (a tied lm_head appears in
    # both state dicts under its own name and as the embedding's alias).
    qwen3.load_state_dict(qwen3_state_dict(model), strict=True)
    return save_model_dir(qwen3, directory, tokenizer)
