"""RoPE and its scaling (llm/model/rotary.py): today's bits for the default type, transformers' Qwen3 for the scaled
ones, the run config's ``rope_parameters`` validated in one line, and checkpoints saved without it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from reference import rotary_cos_sin
from test_modeling import TINY, build, tokens
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from llm.config import load_config
from llm.model import IsoLLMConfig, IsoLLMForCausalLM, ModelConfig
from llm.model.config import ConfigError, upgrade_saved
from llm.model.fused_ops import apply_rotary
from llm.model.rotary import IsoLLMRotaryEmbedding

POSITIONS = torch.arange(0, 6000, 7)[None]  # past max_position_embeddings (64), where dynamic NTK rescales


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_default_rope_gives_the_bits_of_the_formula_checkpoints_were_trained_with(dtype):
    rotary = build(dtype=dtype, rope_theta=10_000.0).model.rotary_emb
    for ours, formula in zip(rotary(torch.zeros(1, dtype=dtype), POSITIONS), rotary_cos_sin(POSITIONS, 8, 1e4, dtype),
                             strict=True):
        assert torch.equal(ours, formula)


def test_scaled_frequencies_stay_fp32_in_a_bf16_model():
    """``model.to(bf16)`` would round the frequencies to 8 bits: the module keeps them fp32 (its ``_apply``)."""
    rotary = build(dtype=torch.float32, rope_parameters={"rope_type": "linear", "factor": 4.0}).model.rotary_emb
    x = torch.zeros(1, dtype=torch.bfloat16)
    fp32 = rotary(x, POSITIONS)
    rotary.to(torch.bfloat16)
    assert rotary.inv_freq.dtype == rotary.original_inv_freq.dtype == torch.float32
    for ours, before in zip(rotary(x, POSITIONS), fp32, strict=True):
        assert torch.equal(ours, before)


SCALED = [{"rope_type": "linear", "factor": 4.0},
          {"rope_type": "dynamic", "factor": 4.0},
          {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
          {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0}]


@pytest.mark.parametrize("rope", SCALED, ids=[rope["rope_type"] for rope in SCALED])
def test_scaled_rope_equals_transformers_qwen3(rope):
    """cos and sin of each type (frequencies and YaRN's attention scaling) equal Qwen3's, dynamic NTK's rescaling
    past ``max_position_embeddings`` included."""
    rotary = build(rope_parameters=rope, max_position_embeddings=64).model.rotary_emb
    qwen3 = Qwen3RotaryEmbedding(Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=8,
                                             max_position_embeddings=64, rope_parameters={**rope, "rope_theta": 1e6}))
    x = torch.zeros(1, dtype=torch.float64)
    for ours, theirs in zip(rotary(x, POSITIONS), qwen3(x, POSITIONS), strict=True):
        assert torch.equal(ours, theirs)
    assert not torch.equal(rotary(x, POSITIONS)[0], rotary_cos_sin(POSITIONS, 8, 1e6, torch.float64)[0])


def test_partial_rotation_rotates_the_first_dimensions_only():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = rotary_cos_sin(torch.arange(5)[None], 4, 10_000.0, torch.float64)
    rotated = apply_rotary(x, cos, sin)
    torch.testing.assert_close(rotated[..., :4], apply_rotary(x[..., :4], cos, sin), rtol=0, atol=0)
    assert torch.equal(rotated[..., 4:], x[..., 4:])
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x,))


BAD_ROPE = [("3", "rope_parameters"),
            ("{rope_type: ntk}", "rope_parameters.rope_type"),
            ("{rope_type: linear}", "rope_parameters"),  # transformers' own check: factor is missing
            ("{rope_type: yarn, factor: 0.5}", "rope_parameters.factor"),
            ("{rope_type: linear, factor: 2, rope_theta: 500}", "rope_parameters.rope_theta"),
            ("{partial_rotary_factor: 1.5}", "rope_parameters.partial_rotary_factor"),
            # accepted before: inf removes all position information, NaN and true pass ``factor < 1``
            ("{rope_type: linear, factor: .inf}", "rope_parameters.factor"),
            ("{rope_type: linear, factor: .nan}", "rope_parameters.factor"),
            ("{rope_type: linear, factor: true}", "rope_parameters.factor"),
            ("{rope_type: longrope, factor: 2.0, short_factor: [1.0, .nan], long_factor: [1.0, 1.0]}",
             "rope_parameters.short_factor"),
            # a ZeroDivisionError traceback before, and a negative original length trained
            ("{rope_type: yarn, factor: 2.0, original_max_position_embeddings: 0}",
             "rope_parameters.original_max_position_embeddings"),
            ("{rope_type: yarn, factor: 2.0, original_max_position_embeddings: -32}",
             "rope_parameters.original_max_position_embeddings"),
            # transformers only logs these, and the run trained on them
            ("{rope_type: llama3, factor: 8.0, original_max_position_embeddings: 16, low_freq_factor: 4.0, "
             "high_freq_factor: 1.0}", "rope_parameters"),
            ("{rope_type: linear, factor: 2.0, facter: 4.0}", "rope_parameters")]


@pytest.mark.parametrize(("value", "field"), BAD_ROPE, ids=[value for value, _ in BAD_ROPE])
def test_bad_rope_parameters_in_a_run_config_fail_in_one_line_naming_the_field(value, field):
    with pytest.raises(ConfigError) as info:
        load_config([], ["train.max_steps=1", f"model.rope_parameters={value}"])
    assert info.value.field == f"model.{field}" and "\n" not in str(info.value)


def test_a_mistake_transformers_warns_of_once_per_process_is_refused_every_time():
    """YaRN's factor against max_position_embeddings / original length: transformers' warning_once prints it for
    the first config of a process only (compare reads many), and each config must still be refused."""
    mismatch = "model.rope_parameters={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 16}"
    for _ in range(2):
        with pytest.raises(ConfigError, match="does not match"):
            load_config([], ["train.max_steps=1", "model.max_position_embeddings=256", mismatch])


def test_a_run_config_sets_the_scaling_the_model_computes():
    config = load_config([], ["train.max_steps=1", "model.rope_parameters={rope_type: yarn, factor: 4.0}"]).model
    rotary = IsoLLMRotaryEmbedding(IsoLLMConfig.from_model_config(config))
    assert rotary.rope_type == "yarn" and rotary.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1)
    assert ModelConfig().rope_parameters is None  # plain RoPE at rope_theta


def test_a_checkpoint_saved_before_rope_parameters_loads_with_its_logits(tmp_path):
    """A model directory written before scaling existed: its config.json holds rope_theta alone."""
    model = build(rope_theta=10_000.0)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = IsoLLMForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert loaded.config.rope_parameters == {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert TINY["hidden_size"] // TINY["num_attention_heads"] == 8  # the head_dim the formula above assumes


def test_a_run_config_saved_before_rope_parameters_reads_as_plain_rope():
    """What the old run provably computed, so that it compares as one configuration with today's unscaled runs."""
    assert upgrade_saved({"ffn_init": "matched", "rope_theta": 1e4})["rope_parameters"] is None
    assert upgrade_saved({"ffn_init": "matched", "rope_parameters": {"rope_type": "linear", "factor": 2.0}}
                         )["rope_parameters"] == {"rope_type": "linear", "factor": 2.0}
