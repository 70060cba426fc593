"""isollm: pretraining Qwen3-style decoders with swappable FFN blocks and attention scoring.

Importing the package registers the model with transformers' Auto classes, so that
``AutoConfig.for_model("isollm", ...)``, ``AutoModel``, ``AutoModelForCausalLM``,
``AutoModelForSequenceClassification`` and ``AutoModelForTokenClassification`` work, and so that
``save_pretrained`` writes an ``auto_map`` and copies the modelling code: a saved directory then
loads with ``trust_remote_code=True`` where this package is not installed.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from llm.model import (
    IsoLLMConfig,
    IsoLLMForCausalLM,
    IsoLLMForSequenceClassification,
    IsoLLMForTokenClassification,
    IsoLLMModel,
)
from llm.quiet import quiet_deepspeed_banner

quiet_deepspeed_banner()

AutoConfig.register(IsoLLMConfig.model_type, IsoLLMConfig, exist_ok=True)
IsoLLMConfig.register_for_auto_class()
for auto_class, model_class in ((AutoModel, IsoLLMModel), (AutoModelForCausalLM, IsoLLMForCausalLM),
                                (AutoModelForSequenceClassification, IsoLLMForSequenceClassification),
                                (AutoModelForTokenClassification, IsoLLMForTokenClassification)):
    auto_class.register(IsoLLMConfig, model_class, exist_ok=True)
    model_class.register_for_auto_class(auto_class.__name__)

__version__ = "0.1.0"
