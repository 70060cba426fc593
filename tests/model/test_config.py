"""IsoLLMConfig mirrors ModelConfig; bad values fail with one ConfigError naming the field; size presets."""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

import llm  # noqa: F401  (registers the Auto classes)
from llm.cli.params import main as params_main
from llm.config import load_config
from llm.model import IsoLLMConfig, IsoLLMForCausalLM, ModelConfig, param_counts
from llm.model.config import ConfigError

SIZES = Path(__file__).resolve().parents[2] / "configs" / "sizes"
TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def test_hf_config_has_exactly_the_model_config_fields_and_defaults():
    hf_fields = {f.name: f for f in fields(IsoLLMConfig)}
    for f in fields(ModelConfig):
        assert f.name in hf_fields
        default = getattr(ModelConfig(), f.name)
        if f.name == "rope_parameters":  # the HF config holds them completed
            default = ModelConfig().resolved_rope_parameters
        assert getattr(IsoLLMConfig(), f.name) == default, f.name
    assert IsoLLMConfig.model_type == "isollm"
    assert IsoLLMConfig().tie_word_embeddings is True


def test_for_model_builds_any_variant_and_round_trips():
    config = AutoConfig.for_model("isollm", ffn="iso_ln", ffn_linear="focus", attn_scoring="iso_tanh",
                                  iso_ln_alpha=1.5, **TINY)
    assert isinstance(config, IsoLLMConfig)
    model_config = config.to_model_config()
    expected = ModelConfig(ffn="iso_ln", ffn_linear="focus", attn_scoring="iso_tanh", iso_ln_alpha=1.5, **TINY)
    assert model_config == replace(expected, rope_parameters=expected.resolved_rope_parameters)
    assert IsoLLMConfig.from_model_config(model_config).to_model_config() == model_config
    assert isinstance(AutoModelForCausalLM.from_config(config), IsoLLMForCausalLM)


def test_config_json_round_trip(tmp_path):
    config = IsoLLMConfig(ffn="isogmlp", isogmlp_gate="causal_mean", **TINY)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "isollm" and saved["ffn"] == "isogmlp"
    assert saved["auto_map"]["AutoConfig"] == "configuration_isollm.IsoLLMConfig"
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.to_model_config() == config.to_model_config()


BAD_VALUES = [
    ({"ffn": "relu_mlp"}, "ffn"),
    ({"hidden_size": 30}, "hidden_size"),  # not divisible by 4 heads
    ({"num_key_value_heads": 3}, "num_key_value_heads"),  # does not divide 4 heads
    ({"attn_scoring": "linear"}, "attn_scoring"),
    ({"isogmlp_gate": "sequence_mean"}, "isogmlp_gate"),  # the non-causal gate does not exist
    ({"ffn": "iso_ln", "mixing_lr_mult": float("inf")}, "mixing_lr_mult"),  # an infinite lr
]


@pytest.mark.parametrize(("bad", "field"), BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_bad_values_raise_one_config_error_naming_the_field(bad, field):
    for build in (lambda: ModelConfig(**{**TINY, **bad}).validate(),
                  lambda: IsoLLMConfig(**{**TINY, **bad}),
                  lambda: AutoConfig.for_model("isollm", **{**TINY, **bad})):
        with pytest.raises(ConfigError) as info:
            build()
        assert info.value.field == field
        assert str(info.value).startswith(f"{field}: ") and "\n" not in str(info.value)
    overrides = [f"model.{key}={value}" for key, value in bad.items()]
    with pytest.raises(ConfigError) as info:
        load_config([str(SIZES / "tiny.yaml")], ["train.max_steps=1", *overrides])
    assert info.value.field == f"model.{field}"


PRESETS = {"83m": 83e6, "134m": 134e6, "250m": 250e6}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_total_parameters_match_their_names(name):
    config = load_config([str(SIZES / f"{name}.yaml")], ["train.max_steps=1"]).model
    assert config.vocab_size == 151_680 and config.tie_word_embeddings and config.ffn == "swiglu"
    total, non_embedding = param_counts(config)
    assert abs(total / PRESETS[name] - 1) < 0.02
    assert total - non_embedding == 151_680 * config.hidden_size
    header = (SIZES / f"{name}.yaml").read_text().split("model:")[0]
    assert f"{total:,}" in header and f"{non_embedding:,}" in header  # the comment states both counts


@pytest.mark.parametrize("name", ["tiny", "small-cpu"])
def test_cpu_sizes_load_and_state_their_counts(name):
    config = load_config([str(SIZES / f"{name}.yaml")], ["train.max_steps=1"]).model
    total, non_embedding = param_counts(config)
    header = (SIZES / f"{name}.yaml").read_text().split("model:")[0]
    assert f"{total:,}" in header and f"{non_embedding:,}" in header
    assert set(asdict(config)) == {f.name for f in fields(ModelConfig)}


@pytest.mark.parametrize("argv", [["model.ffn=isogmlp", "model.ffn_param_match=true"],
                                  ["--plan", "model.ffn=isogmlp", "model.ffn_param_match=true"]])
def test_params_cli_prints_counts_and_resolved_intermediate_size(argv: list[str], capsys):
    """Overrides are read before or after the flags (``isollm-params SIZE --plan key=value``)."""
    assert params_main([str(SIZES / "83m.yaml"), *argv]) == 0
    out = capsys.readouterr().out
    total, non_embedding = param_counts(ModelConfig(**{**asdict(load_config(
        [str(SIZES / "83m.yaml")], ["train.max_steps=1"]).model), "ffn": "isogmlp", "ffn_param_match": True}))
    assert f"{total:,}" in out and f"{non_embedding:,}" in out
    assert "ffn intermediate size: 768 (config 1024, parameter-matched)" in out


def test_params_cli_reports_a_bad_value_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        params_main([str(SIZES / "tiny.yaml"), "model.ffn=bogus"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().endswith("model.ffn: unknown value 'bogus'; expected one of: "
                                                    "swiglu, isogmlp, iso_ln, iso_mlp")


VARIANT_NAMES = [
    ({}, "swiglu+softmax"),
    ({"ffn": "iso_ln", "iso_ln_layernorm": False}, "iso_ln[layernorm=false]+softmax"),
    ({"ffn": "iso_ln", "iso_ln_pathway": False}, "iso_ln[pathway=false]+softmax"),
    ({"ffn": "iso_ln", "iso_ln_alpha": 1.5}, "iso_ln[alpha=1.5]+softmax"),
    ({"ffn": "isogmlp", "isogmlp_gate": "causal_mean"}, "isogmlp[gate=causal_mean]+softmax"),
    ({"ffn": "iso_mlp", "iso_activation": "relu"}, "iso_mlp[activation=relu]+softmax"),
    ({"ffn": "iso_mlp", "iso_activation": "leaky_relu", "iso_leaky_slope": 0.2, "ffn_init": "paper"},
     "iso_mlp[activation=leaky_relu,leaky_slope=0.2,init=paper]+softmax"),
    ({"attn_scoring": "iso_tanh"}, "swiglu+iso_tanh"),
    ({"ffn_linear": "affine_like"}, "swiglu+softmax+affine_like"),
    ({"ffn_linear": "focus", "focus_sigma_init": 0.2}, "swiglu+softmax+focus[sigma_init=0.2]"),
    ({"ffn": "isogmlp", "mixing_lr_mult": 1.0}, "isogmlp[mixing_lr_mult=1]+softmax"),
]


@pytest.mark.parametrize(("options", "name"), VARIANT_NAMES, ids=[n for _, n in VARIANT_NAMES])
def test_variant_name_carries_every_non_default_option(options, name):
    assert ModelConfig(**options).validate().variant_name == name


def test_all_variant_names_of_the_ablations_are_distinct():
    names = [ModelConfig(**options).validate().variant_name for options, _ in VARIANT_NAMES]
    assert len(set(names)) == len(names)


UNUSED_OPTIONS = [
    ({"iso_ln_alpha": 1.5}, "iso_ln_alpha", "ffn=iso_ln"),
    ({"ffn": "isogmlp", "iso_ln_layernorm": False}, "iso_ln_layernorm", "ffn=iso_ln"),
    ({"isogmlp_gate": "causal_mean"}, "isogmlp_gate", "ffn=isogmlp"),
    ({"ffn": "iso_mlp", "iso_r0": 0.3}, "iso_r0", "iso_activation=relu"),  # tanh has no radius
    ({"ffn": "iso_mlp", "iso_activation": "relu", "iso_r_cap": 2.0}, "iso_r_cap", "iso_activation=capped_relu"),
    ({"iso_activation": "relu"}, "iso_activation", "ffn=iso_mlp"),
    ({"ffn_init": "paper"}, "ffn_init", "ffn=iso_mlp or ffn_linear=affine_like"),
    ({"focus_mu_lr_mult": 0.5}, "focus_mu_lr_mult", "ffn_linear=focus"),
    ({"mixing_lr_mult": 2.0}, "mixing_lr_mult", "ffn=isogmlp or ffn=iso_ln"),
]


@pytest.mark.parametrize(("options", "field", "owner"), UNUSED_OPTIONS, ids=[f for _, f, _ in UNUSED_OPTIONS])
def test_an_option_of_an_unselected_variant_is_refused(options, field, owner):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**options).validate()
    assert info.value.field == field and owner in str(info.value) and "\n" not in str(info.value)
    overrides = [f"model.{key}={value}" for key, value in options.items()]
    with pytest.raises(ConfigError) as info:
        load_config([str(SIZES / "tiny.yaml")], ["train.max_steps=1", *overrides])
    assert info.value.field == f"model.{field}"


def test_every_option_field_is_owned_by_some_registry_entry():
    """Each variant field is declared by the entries that read it; an undeclared one could never be refused."""
    from llm.model.config import VARIANT_SELECTORS, _declaring_entries

    declared = set(_declaring_entries())
    variant_fields = {"isogmlp_gate", "iso_ln_alpha", "iso_ln_layernorm", "iso_ln_pathway", "iso_activation",
                      "iso_r0", "iso_r_cap", "iso_leaky_slope", "ffn_init", "mixing_lr_mult", "focus_sigma_init",
                      "focus_mu_lr_mult", "focus_sigma_lr_mult"}
    assert declared == variant_fields
    assert set(VARIANT_SELECTORS) <= {f.name for f in fields(ModelConfig)}


def test_with_variant_resets_the_options_the_new_choice_does_not_read():
    config = ModelConfig(ffn="iso_ln", iso_ln_alpha=1.5, mixing_lr_mult=2.0, ffn_linear="focus",
                         focus_sigma_init=0.2).validate()
    swiglu = config.with_variant(ffn="swiglu").validate()
    assert (swiglu.ffn, swiglu.iso_ln_alpha, swiglu.mixing_lr_mult) == ("swiglu", 0.0, 5.0)
    assert (swiglu.ffn_linear, swiglu.focus_sigma_init) == ("focus", 0.2)  # still selected: kept
    assert config.with_variant(ffn="isogmlp").mixing_lr_mult == 2.0  # isogmlp reads it too


def test_iso_r0_is_bounded_by_the_cap_only_where_the_cap_is_read():
    """The papers' iso-ReLU with R0 = 1 (ffn_init=paper) is valid whatever the unread iso_r_cap (default 1)."""
    for activation in ("relu", "leaky_relu"):
        config = ModelConfig(ffn="iso_mlp", iso_activation=activation, ffn_init="paper", iso_r0=1.0).validate()
        assert (config.iso_r0, config.iso_r_cap) == (1.0, 1.0)
    with pytest.raises(ConfigError, match=r"iso_r_cap=1\.0") as info:
        ModelConfig(ffn="iso_mlp", iso_activation="capped_relu", ffn_init="paper", iso_r0=1.0).validate()
    assert info.value.field == "iso_r0"
    with pytest.raises(ConfigError, match="expected >= 0") as info:
        ModelConfig(ffn="iso_mlp", iso_activation="relu", iso_r0=-0.1).validate()
    assert info.value.field == "iso_r0"
