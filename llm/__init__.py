"""isollm: pretraining Qwen3-style decoders with swappable FFN blocks and attention scoring.

Importing the package registers the model with transformers' Auto classes, so that
``AutoConfig.for_model("isollm", ...)`` and ``AutoModelForCausalLM.from_config(...)`` work, and so
that ``save_pretrained`` writes an ``auto_map`` and copies the modelling code: a saved directory then
loads with ``trust_remote_code=True`` where this package is not installed.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from llm.model import IsoLLMConfig, IsoLLMForCausalLM
from llm.quiet import quiet_deepspeed_banner

quiet_deepspeed_banner()

AutoConfig.register(IsoLLMConfig.model_type, IsoLLMConfig, exist_ok=True)
AutoModelForCausalLM.register(IsoLLMConfig, IsoLLMForCausalLM, exist_ok=True)
IsoLLMConfig.register_for_auto_class()
IsoLLMForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__version__ = "0.1.0"
