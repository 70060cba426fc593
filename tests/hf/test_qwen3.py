"""Stock-Qwen3 export: transformers' own Qwen3ForCausalLM loads it (no remote code) with equal logits."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from llm.hf import export_qwen3
from llm.model import IsoLLMConfig, IsoLLMForCausalLM
from llm.model.config import ConfigError

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, rope_theta=10_000.0)  # head_dim != hidden/heads on purpose


def build(**overrides) -> IsoLLMForCausalLM:
    torch.manual_seed(0)
    model = IsoLLMForCausalLM(IsoLLMConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # norms away from their init of 1, so a dropped or misplaced norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_qwen3_loads_the_export_with_equal_logits(tmp_path, tied):
    model = build(tie_word_embeddings=tied)
    export_qwen3(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and "auto_map" not in config
    assert config["rope_parameters"]["rope_theta"] == 10_000.0 and config["head_dim"] == 24
    assert not any(path.suffix == ".py" for path in tmp_path.iterdir())  # no code: stock transformers

    qwen3 = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(qwen3) is Qwen3ForCausalLM
    assert (qwen3.lm_head.weight is qwen3.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(qwen3(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    prompt = ids[:, :4]
    torch.testing.assert_close(qwen3.generate(prompt, max_new_tokens=6, do_sample=False),
                               model.generate(prompt, max_new_tokens=6, do_sample=False), rtol=0, atol=0)


def test_parameter_matched_swiglu_exports_with_its_intermediate_size(tmp_path):
    model = build(ffn_param_match=True, intermediate_size=201)  # matching rounds it to a multiple of 8
    export_qwen3(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["intermediate_size"] == 200


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(ffn="isogmlp"), "ffn"),
    (dict(ffn="iso_mlp"), "ffn"),
    (dict(attn_scoring="iso_tanh"), "attn_scoring"),
    (dict(ffn_linear="affine_like"), "ffn_linear"),
    (dict(qk_norm=False), "qk_norm"),
    (dict(parametrization="mup"), "parametrization"),
])
def test_variants_qwen3_cannot_express_fail_naming_the_field(tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=f"^{field}: stock Qwen3 export needs") as info:
        export_qwen3(build(**overrides), tmp_path)
    assert info.value.field == field
    assert not any(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}],
                         ids=["linear", "yarn"])
def test_scaled_rope_exports_to_qwen3_with_equal_fp64_logits(tmp_path, rope):
    model = build(rope_parameters=rope, max_position_embeddings=32).double()
    export_qwen3(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == rope["rope_type"]
    qwen3 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # Qwen3's RMSNorm computes in fp32 even in an fp64 model: equal to 1e-7
        torch.testing.assert_close(qwen3(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
        unscaled = build(max_position_embeddings=32).double()(ids).logits  # the same weights (seed 0)
        assert (unscaled - model(ids).logits).abs().max() > 1e-3  # so the scaling is what the export carries


def test_partial_rotation_is_refused_by_the_qwen3_export(tmp_path):
    with pytest.raises(ConfigError, match=r"^rope_parameters.partial_rotary_factor: stock Qwen3 export needs 1, "):
        export_qwen3(build(rope_parameters={"partial_rotary_factor": 0.5}), tmp_path)
    assert not any(tmp_path.iterdir())
