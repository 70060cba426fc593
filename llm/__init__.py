"""isollm: pretraining Qwen3-style decoders with swappable FFN blocks and attention scoring.

Importing the package registers the model with transformers' Auto classes, so that
``AutoConfig.for_model("isollm", ...)``, ``AutoModel``, ``AutoModelForCausalLM``,
``AutoModelForSequenceClassification`` and ``AutoModelForTokenClassification`` work, and so that
``save_pretrained`` writes an ``auto_map`` and copies the modelling code: a saved directory then
loads with ``trust_remote_code=True`` where this package is not installed.
"""

import transformers

from llm.model import IsoLLMConfig, modeling_isollm
from llm.quiet import quiet_deepspeed_banner

quiet_deepspeed_banner()


def _register_auto_classes() -> None:
    transformers.AutoConfig.register(IsoLLMConfig.model_type, IsoLLMConfig, exist_ok=True)
    IsoLLMConfig.register_for_auto_class()
    for auto_name, class_name in modeling_isollm.AUTO_CLASSES.items():
        model_class = getattr(modeling_isollm, class_name)
        getattr(transformers, auto_name).register(IsoLLMConfig, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_name)


_register_auto_classes()
__version__ = "0.1.0"
