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

__all__ = ["quiet_progress_bars", "save_model_dir"]

# The class written to ``tokenizer_config.json``: transformers 4 and 5 both know it (5 writes its own
# ``TokenizersBackend``, which 4 cannot load), and it runs no code from the directory.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


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


def save_model_dir(model: PreTrainedModel, directory: str | Path, tokenizer: Tokenizer | None = None,
                   state_dict: dict | None = None) -> Path:
    """``model.save_pretrained(directory)`` quietly (weights; for isollm the config with ``auto_map``
    and the modelling code) and, given a tokenizer, its ``tokenizer.json`` and a ``tokenizer_config.json`` for
    a stock fast tokenizer. EOS ``<|endoftext|>`` doubles as the padding token (the model has no other), padding
    goes on the left, as batched generation wants (the model also accepts right padding), and both ids are set in
    the config and generation config, so ``generate()`` and pipelines stop at the end of a document and pad
    batches without being told.

    ``state_dict``: the weights to write instead of ``model``'s own (a distributed run's gathered ones).
    """
    directory = Path(directory)
    if tokenizer is not None:
        as_transformers_tokenizer(tokenizer).save_pretrained(directory)
        config_file = directory / "tokenizer_config.json"
        tokenizer_config = json.loads(config_file.read_text())
        tokenizer_config.update(tokenizer_class=TOKENIZER_CLASS, pad_token=EOS_TOKEN, padding_side="left",
                                model_max_length=model.config.max_position_embeddings)
        config_file.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
        for config in (model.config, model.generation_config):
            config.eos_token_id = config.pad_token_id = eos_id(tokenizer)
    with quiet_progress_bars():
        model.save_pretrained(directory, state_dict=state_dict)
    return directory
