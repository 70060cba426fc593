"""Tensor parallelism through ``from_pretrained(tp_plan="auto")``: the vocabulary-parallel plan (embedding and LM
head sharded, layers replicated) computes what the whole model computes, on 2 CPU processes (tests/hf/tp_worker.py
under torchrun, one launch for every variant: ~10 s on an idle 2-core machine)."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import REPO, run, torchrun

from llm.model import IsoLLMConfig, IsoLLMForCausalLM

VARIANTS = {
    "swiglu_softmax": dict(ffn="swiglu", attn_scoring="softmax"),
    "isogmlp_iso_tanh": dict(ffn="isogmlp", attn_scoring="iso_tanh"),
    "iso_ln_softmax_untied": dict(ffn="iso_ln", attn_scoring="softmax", tie_word_embeddings=False),
    "iso_mlp_iso_tanh": dict(ffn="iso_mlp", attn_scoring="iso_tanh"),
}


def test_vocabulary_parallel_plan_is_exact(tmp_path: Path) -> None:
    checkpoints = []
    for name, variant in VARIANTS.items():
        torch.manual_seed(0)
        config = IsoLLMConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, iso_tanh_chunk_size=4, **variant)
        IsoLLMForCausalLM(config).to(torch.float64).save_pretrained(tmp_path / name)  # 99 rows: shards of 50 and 49
        checkpoints.append(str(tmp_path / name))
    done = run(torchrun(2, str(REPO / "tests" / "hf" / "tp_worker.py"), *checkpoints))
    assert f"rank 0: {len(VARIANTS)} checkpoints sharded exactly" in done.stdout
