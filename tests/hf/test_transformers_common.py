"""transformers' common model tests (``ModelTesterMixin``, run on transformers' own models) on every isollm class:
``IsoLLMModel``, ``IsoLLMForCausalLM``, ``IsoLLMForSequenceClassification``, ``IsoLLMForTokenClassification``.

The mixin comes from the installed transformers' sdist (``transformers_suite.py``); without it the module is
skipped, except under ``CI=true``, where it fails. Variants: a covering set rather than the full product (each
variant runs the whole suite, ~110 tests): every FFN (swiglu, isogmlp, iso_ln, iso_mlp) once and each scoring
(softmax, iso_tanh) twice. Generation, whose mixin the sdist lacks, is covered by ``tests/model/test_generation.py``
and ``tests/model/test_static_decoding.py`` (generate() equals the full forward; batched padded; ``inputs_embeds``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
import unittest
import warnings
from typing import ClassVar
from unittest import mock

import pytest
import torch
from transformers.models.auto import modeling_auto

import llm  # noqa: F401  (registers the Auto classes)
from llm.model import (
    IsoLLMConfig,
    IsoLLMForCausalLM,
    IsoLLMForSequenceClassification,
    IsoLLMForTokenClassification,
    IsoLLMModel,
)

try:
    from transformers_suite import common_tests

    with warnings.catch_warnings():  # transformers' own CI marks (accelerate_tests, flash_attn_test...): not ours
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        ModelTesterMixin = common_tests().ModelTesterMixin
except Exception as error:  # no sdist (offline): the suite cannot run
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(f"transformers' common tests are unavailable: {error}", allow_module_level=True)

VARIANTS = {
    "swiglu_softmax": dict(ffn="swiglu", attn_scoring="softmax"),
    "isogmlp_iso_tanh": dict(ffn="isogmlp", attn_scoring="iso_tanh"),
    "iso_ln_softmax": dict(ffn="iso_ln", attn_scoring="softmax"),
    "iso_mlp_iso_tanh": dict(ffn="iso_mlp", attn_scoring="iso_tanh"),
}

MAPPING_NAMES = {
    "MODEL_MAPPING_NAMES": IsoLLMModel,
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": IsoLLMForCausalLM,
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": IsoLLMForSequenceClassification,
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": IsoLLMForTokenClassification,
}
"""Where the suite looks a class up by name to choose its labels and checks; a model in the library is listed there."""


@pytest.fixture(scope="module", autouse=True)
def listed_as_in_the_library():
    with contextlib.ExitStack() as stack:
        for mapping, model_class in MAPPING_NAMES.items():
            stack.enter_context(mock.patch.dict(getattr(modeling_auto, mapping), isollm=model_class.__name__))
        yield


class IsoLLMModelTester:
    """The tiny model and inputs the suite builds its checks from (the attributes it reads)."""

    batch_size, seq_length, vocab_size, hidden_size, max_position_embeddings = 2, 7, 99, 32, 32
    num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size = 2, 4, 2, 37
    num_labels, pad_token_id, is_training = 3, 0, True

    def __init__(self, parent: unittest.TestCase, variant: dict) -> None:
        self.parent = parent
        self.variant = variant

    def get_config(self) -> IsoLLMConfig:
        return IsoLLMConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                            num_attention_heads=self.num_attention_heads,
                            num_key_value_heads=self.num_key_value_heads, num_labels=self.num_labels,
                            max_position_embeddings=self.max_position_embeddings,
                            pad_token_id=self.pad_token_id, iso_tanh_chunk_size=4, **self.variant)

    def prepare_config_and_inputs_for_common(self) -> tuple[IsoLLMConfig, dict[str, torch.Tensor]]:
        input_ids = torch.randint(1, self.vocab_size, (self.batch_size, self.seq_length))
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, :2] = 0  # a left-padded row
        input_ids[0, :2] = self.pad_token_id
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class IsoLLMCommonTest(ModelTesterMixin):
    all_model_classes = (IsoLLMModel, IsoLLMForCausalLM, IsoLLMForSequenceClassification,
                         IsoLLMForTokenClassification)
    variant: ClassVar[dict] = {}

    def setUp(self) -> None:
        self.model_tester = IsoLLMModelTester(self, self.variant)

    def test_can_init_all_missing_weights(self) -> None:
        """The suite compares a model built for real with one whose every weight ``_init_weights`` drew from a seed:
        transformers' convention that all init lives there. isollm's FFN blocks and projections draw theirs in
        their constructors, in the order runs have always drawn them (a seed gives the weights it gave), and
        ``_init_weights`` draws them only where ``from_pretrained`` finds them missing; that is tested in
        tests/model/test_hf_conventions.py (missing weights initialised, loaded ones kept). (Run as is, the suite
        skips it for a model file without a copyright line of 2023 or later.)"""
        self.skipTest("FFN blocks and projections draw their init in their constructors (the seed's weights); "
                      "the missing-weight init is tested in tests/model/test_hf_conventions.py")

    def test_generation_tester_mixin_inheritance(self) -> None:
        """Generation is tested by this repository's own tests (the module's docstring), not transformers' mixin,
        which its sdist lacks; the causal LM is the one class that generates."""
        assert [cls for cls in self.all_model_classes if cls.can_generate()] == [IsoLLMForCausalLM]


class IsoTanhCommonTest(IsoLLMCommonTest):
    """iso_tanh computes no softmax, so SDPA and FlexAttention do not apply: its one implementation is ``eager``.
    The suite's two tests that require SDPA are replaced by the check that it is refused, in one line."""

    def test_can_set_attention_dynamically(self) -> None:
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config)
            assert model.config._attn_implementation == "eager"
            for name in ("sdpa", "flex_attention"):
                with pytest.raises(ValueError, match=rf'^attn_implementation="{name}" does not apply to '
                                                     "attn_scoring=iso_tanh; it runs eager$"):
                    model.set_attn_implementation(name)
            assert model.config._attn_implementation == "eager"

    def test_sdpa_can_dispatch_non_composite_models(self) -> None:
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        with tempfile.TemporaryDirectory() as directory:
            IsoLLMModel(config).save_pretrained(directory)
            assert IsoLLMModel.from_pretrained(directory).config._attn_implementation == "eager"
            with pytest.raises(ValueError, match=r'^attn_implementation="sdpa" does not apply'):
                IsoLLMModel.from_pretrained(directory, attn_implementation="sdpa")


def test_the_suites_rope_tests_apply():
    """The suite skips its RoPE tests (scaling from the config, the frequencies of each type, partial rotation) for a
    model without ``rope_parameters`` holding ``partial_rotary_factor``, or without a ``rotary_emb`` module."""
    config = IsoLLMModelTester(None, {}).get_config()
    assert "partial_rotary_factor" in config.rope_parameters
    assert list(inspect.signature(type(IsoLLMModel(config).rotary_emb)).parameters) == ["config"]


for _name, _variant in VARIANTS.items():
    _class_name = "Test" + "".join(part.title() for part in _name.split("_"))
    _base = IsoTanhCommonTest if _variant["attn_scoring"] == "iso_tanh" else IsoLLMCommonTest
    globals()[_class_name] = type(_class_name, (_base, unittest.TestCase), {"variant": _variant})
