"""The isollm decoder (self-contained: torch + transformers, relative imports, copied to the hub)."""

from .config import ConfigError, ModelConfig
from .configuration_isollm import IsoLLMConfig
from .modeling_isollm import IsoLLMCache, IsoLLMForCausalLM, param_counts

__all__ = ["ConfigError", "IsoLLMCache", "IsoLLMConfig", "IsoLLMForCausalLM", "ModelConfig", "param_counts"]
