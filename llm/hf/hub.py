"""Save a model as a hub directory that loads with ``trust_remote_code=True`` where ``llm`` is absent."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from llm.data.tokenizer import as_transformers_tokenizer
from llm.model import IsoLLMForCausalLM


def save_for_hub(model: IsoLLMForCausalLM, directory: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """``model.save_pretrained(directory)`` (weights, config with ``auto_map``, the modelling code) and,
    if given, the tokenizer as checkpoints save it (``AutoTokenizer`` loads it; eos ``<|endoftext|>``).

    ``AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`` then rebuilds the same
    model in any process with torch and transformers (tests/hf/test_hub.py checks it without ``llm``).
    """
    directory = Path(directory)
    model.save_pretrained(directory)
    if tokenizer is not None:
        as_transformers_tokenizer(tokenizer).save_pretrained(directory)
    return directory
