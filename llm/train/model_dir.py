"""Complete Hugging Face model directories: weights, config, code, tokenizer and special-token ids.

A directory written here loads with ``AutoTokenizer``, ``AutoModelForCausalLM`` and
``pipeline("text-generation")`` in a process where ``llm`` is absent (``trust_remote_code=True``
for the model; tests/hf/test_hub.py checks it). Every checkpoint's ``model/`` is one; publishing
(``llm.hf.save_for_hub``) adds a model card.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from llm.data.tokenizer import EOS_TOKEN, as_transformers_tokenizer, eos_id

__all__ = ["quiet_progress_bars", "save_model_dir", "save_tokenizer", "set_special_tokens"]

TOKENIZER_CLASS = "PreTrainedTokenizerFast"
"""The class written to ``tokenizer_config.json``: transformers 4 and 5 both know it (5 writes its own
``TokenizersBackend``, which 4 cannot load), and it runs no code from the directory."""


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' progress bars ("Writing model shards") while saving: they would cut
    through the training progress bar at every checkpoint."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path, model_max_length: int) -> int:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` for a stock fast tokenizer; return its EOS id.

    EOS ``<|endoftext|>`` doubles as the padding token (the model has no other), and padding goes on
    the left, as batched generation wants (the model also accepts right padding).
    """
    as_transformers_tokenizer(tokenizer).save_pretrained(directory)
    config_file = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(tokenizer_class=TOKENIZER_CLASS, pad_token=EOS_TOKEN, padding_side="left",
                  model_max_length=model_max_length)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return eos_id(tokenizer)


def set_special_tokens(model: PreTrainedModel, eos: int) -> None:
    """``eos_token_id`` and ``pad_token_id`` in the config and generation config, so ``generate()`` and
    pipelines stop at the end of a document and pad batches without being told."""
    for config in (model.config, model.generation_config):
        config.eos_token_id = eos
        config.pad_token_id = eos


def save_model_dir(model: PreTrainedModel, directory: str | Path, tokenizer: Tokenizer | None = None,
                   state_dict: dict | None = None) -> Path:
    """``model.save_pretrained(directory)`` quietly (weights; for isollm the config with ``auto_map``
    and the modelling code) and, given a tokenizer, its files and the special-token ids.

    ``state_dict``: the weights to write instead of ``model``'s own (a distributed run's gathered ones).
    """
    directory = Path(directory)
    if tokenizer is not None:
        set_special_tokens(model, save_tokenizer(tokenizer, directory, model.config.max_position_embeddings))
    with quiet_progress_bars():
        model.save_pretrained(directory, state_dict=state_dict)
    return directory
