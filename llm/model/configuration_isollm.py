"""The Hugging Face config of an isollm model: ``ModelConfig``'s fields on a ``PreTrainedConfig``.

transformers 5 makes every ``PreTrainedConfig`` subclass a keyword-only dataclass, so inheriting
from the ``ModelConfig`` dataclass as well gives exactly its fields (Qwen3 names plus the variant
fields) without restating them; a field added to ``ModelConfig`` appears here, in ``config.json``
and in ``AutoConfig.for_model("isollm", ...)`` at once.

Copied to the hub with the modelling code: relative imports only.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, ClassVar

from transformers import PreTrainedConfig

from .config import ModelConfig, upgrade_saved


class IsoLLMConfig(ModelConfig, PreTrainedConfig):
    """``ModelConfig`` + ``model_type = "isollm"``; validated on construction (``ConfigError`` names a field).

    ``ModelConfig`` comes first in the bases so that its ``validate`` and defaults win (e.g.
    ``tie_word_embeddings=True``, where ``PreTrainedConfig`` would leave weights untied).
    """

    model_type = "isollm"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["cache", "past_key_values"]
    """The generation state in the output, which the HF Trainer's evaluation leaves out: ``cache`` from
    transformers 5.24 on, ``past_key_values`` before."""
    base_model_tp_plan: ClassVar[dict[str, str]] = {"embed_tokens": "embedding_rowwise"}

    def __post_init__(self, **kwargs: Any) -> None:
        ModelConfig.validate(self)  # before transformers reads rope_parameters, which may not even be a mapping
        # completed, as transformers' models hold it (its older name, a saved rope_scaling, takes precedence)
        self.rope_parameters = self.resolved_rope_parameters
        super().__post_init__(**kwargs)
        ModelConfig.validate(self)

    def validate(self) -> IsoLLMConfig:
        """Run ``ModelConfig``'s checks (one line naming the field), then transformers' own (called by
        ``save_pretrained``)."""
        ModelConfig.validate(self)
        PreTrainedConfig.validate(self)
        return self

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> IsoLLMConfig:
        """A ``config.json`` written before ``ffn_init`` existed is read as it was written (``upgrade_saved``)."""
        return super().from_dict(upgrade_saved(config_dict), **kwargs)

    def to_model_config(self) -> ModelConfig:
        return ModelConfig(**{name: getattr(self, name) for name in ModelConfig.field_names()})

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs: Any) -> IsoLLMConfig:
        """The HF config of a training config; ``kwargs`` are extra HF fields (e.g. ``eos_token_id``)."""
        return cls(**asdict(config), **kwargs)
