"""The Hugging Face side of isollm: complete hub directories loadable without this package, the model
card, the stock-Qwen3 export and ``isollm-hub push``.

The Auto classes are registered by ``import llm`` (``llm/__init__.py``).
"""

from llm.hf.card import save_for_hub
from llm.hf.qwen3 import check_qwen3_exportable, export_qwen3, qwen3_config, qwen3_state_dict
from llm.train.model_dir import save_model_dir

__all__ = ["check_qwen3_exportable", "export_qwen3", "qwen3_config", "qwen3_state_dict", "save_for_hub",
           "save_model_dir"]
