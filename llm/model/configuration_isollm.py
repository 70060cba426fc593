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

from .config import ModelConfig


class IsoLLMConfig(ModelConfig, PreTrainedConfig):
    """``ModelConfig`` + ``model_type = "isollm"``; validated on construction (``ConfigError`` names a field).

    ``ModelConfig`` comes first in the bases so that its ``validate`` and defaults win (e.g.
    ``tie_word_embeddings=True``, where ``PreTrainedConfig`` would leave weights untied).
    """

    model_type = "isollm"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        ModelConfig.validate(self)

    def validate(self) -> IsoLLMConfig:
        """Run transformers' own checks (called by ``save_pretrained``), then ``ModelConfig``'s."""
        PreTrainedConfig.validate(self)
        ModelConfig.validate(self)
        return self

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> IsoLLMConfig:
        """A ``config.json`` written before ``ffn_init`` existed holds the papers' raw scales: load it so,
        rather than as today's scale-matched default, so that an old checkpoint computes what it was trained to.

        Such a file also holds every option at the defaults of its time (``iso_r0: 1.0`` ...), including those
        its variant does not read, which ``validate`` now refuses: those had no effect and take today's defaults.
        """
        if "ffn_init" not in config_dict:
            config_dict = {**config_dict, "ffn_init": "paper"}
            fields = {name: value for name, value in config_dict.items() if name in ModelConfig.field_names()}
            try:
                read = ModelConfig(**fields).with_variant()
            except KeyError:  # an unknown variant choice: validate() names it
                read = None
            if read is not None:
                config_dict.update({name: getattr(read, name) for name in fields})
        return super().from_dict(config_dict, **kwargs)

    def to_model_config(self) -> ModelConfig:
        return ModelConfig(**{name: getattr(self, name) for name in ModelConfig.field_names()})

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs: Any) -> IsoLLMConfig:
        """The HF config of a training config; ``kwargs`` are extra HF fields (e.g. ``eos_token_id``)."""
        return cls(**asdict(config), **kwargs)
