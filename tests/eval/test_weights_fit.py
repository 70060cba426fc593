"""``check_weights_fit`` names the config.json field that changed, also when another field holds the same value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from llm.eval.evaluate import EvalError, check_weights_fit
from llm.model.config import ModelConfig
from llm.train.setup import build_model


@pytest.fixture(scope="module")
def swiglu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny swiglu model: hidden_size 32, intermediate_size 128."""
    out = tmp_path_factory.mktemp("swiglu")
    build_model(ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                            ffn="swiglu")).save_pretrained(out)
    return out


@pytest.mark.parametrize(("field", "value"), [("hidden_size", 128), ("intermediate_size", 32)])
def test_the_changed_field_is_named_alone(swiglu_dir: Path, field: str, value: int) -> None:
    """hidden_size changed to 128, the intermediate_size's value: named "hidden_size=128 or intermediate_size=128"
    (intermediate_size reshapes the MLP's tensors, all among those that do not fit). The field that reshapes every
    tensor that does not fit is the one named."""
    saved = (swiglu_dir / "config.json").read_text()
    try:
        (swiglu_dir / "config.json").write_text(json.dumps({**json.loads(saved), field: value}))
        with pytest.raises(EvalError, match=rf"^{swiglu_dir}: config.json's {field}={value} does not fit its weights "):
            check_weights_fit(swiglu_dir, AutoConfig.from_pretrained(swiglu_dir))
    finally:
        (swiglu_dir / "config.json").write_text(saved)
