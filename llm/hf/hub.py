"""Save a model as a hub directory that loads with ``trust_remote_code=True`` where ``llm`` is absent."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from llm.model import IsoLLMForCausalLM

# save_pretrained copies modeling_isollm.py and, recursively, the files it imports relatively; an
# absolute import of the package would be copied as is and fail where llm is not installed.
_ABSOLUTE_LLM_IMPORT = re.compile(r"^\s*(from|import)\s+llm\b", re.MULTILINE)


def save_for_hub(model: IsoLLMForCausalLM, directory: str | Path, tokenizer: Tokenizer | None = None,
                 eos_token: str | None = None) -> Path:
    """``model.save_pretrained(directory)`` (weights, config with ``auto_map``, the modelling code) and,
    if given, the tokenizer as a ``PreTrainedTokenizerFast`` (``AutoTokenizer`` loads it).

    ``AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`` then rebuilds the same
    model in any process with torch and transformers. Raises ``RuntimeError`` naming the file if the
    copy could not work without ``llm``.
    """
    directory = Path(directory)
    model.save_pretrained(directory)
    if tokenizer is not None:
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token).save_pretrained(directory)
    config_file = directory / "config.json"
    if "AutoModelForCausalLM" not in json.loads(config_file.read_text()).get("auto_map", {}):
        raise RuntimeError(f"{config_file}: no auto_map.AutoModelForCausalLM; import llm before saving "
                           "(it registers the Auto classes)")
    for code in sorted(directory.glob("*.py")):
        if _ABSOLUTE_LLM_IMPORT.search(code.read_text()):
            raise RuntimeError(f"{code}: imports llm absolutely; llm/model must use relative imports only")
    return directory
