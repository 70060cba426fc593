"""Hub-ready directories: a complete model directory (``llm.train.model_dir``, what every checkpoint's ``model/``
is) plus the model card (``llm.hf.card``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from llm.train.model_dir import save_model_dir

if TYPE_CHECKING:
    from llm.hf.card import RunSummary
    from llm.model import IsoLLMForCausalLM


def save_for_hub(model: IsoLLMForCausalLM, directory: str | Path, tokenizer: Tokenizer | None = None,
                 run: RunSummary | None = None, repo_id: str | None = None) -> Path:
    """A hub-ready directory: ``save_model_dir`` plus the ``README.md`` model card (``llm.hf.card``),
    which reports ``run``'s training (tokens, final val loss, bits per byte, config) when given and
    shows loading from ``repo_id`` (default: the directory itself).

    ``AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`` then rebuilds the same
    model in any process with torch and transformers.
    """
    from llm.hf.card import model_card

    directory = save_model_dir(model, directory, tokenizer)
    card = model_card(model.config.to_model_config(), run=run, repo_id=repo_id or str(directory))
    (directory / "README.md").write_text(card)
    return directory
