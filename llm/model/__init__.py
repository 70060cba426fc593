"""The isollm decoder (self-contained: torch + transformers, relative imports, copied to the hub)."""

from .config import ConfigError, ModelConfig
from .configuration_isollm import IsoLLMConfig
from .modeling_isollm import (
    IsoLLMCache,
    IsoLLMForCausalLM,
    IsoLLMForSequenceClassification,
    IsoLLMForTokenClassification,
    IsoLLMModel,
    IsoLLMPreTrainedModel,
    param_counts,
)

__all__ = ["ConfigError", "IsoLLMCache", "IsoLLMConfig", "IsoLLMForCausalLM", "IsoLLMForSequenceClassification",
           "IsoLLMForTokenClassification", "IsoLLMModel", "IsoLLMPreTrainedModel", "ModelConfig", "param_counts"]
