"""How transformers' ``generate()`` reaches the isollm decoder: the state's argument name, the public
``prepare_inputs_for_generation`` hook that hands it this model's ``IsoLLMCache``, and the decoding strategies the
state allows. ``IsoLLMForCausalLM`` (modeling_isollm.py) takes them through ``IsoLLMGenerationMixin``.

Copied to the hub with its relative imports: torch and transformers only.
"""

import dataclasses
from typing import Any

import torch
import transformers
from transformers import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import ModelOutput

from .cache import DROPS_DRAFTS, IsoLLMCache
from .configuration_isollm import IsoLLMConfig
from .layout import restarts_between_real_tokens
from .padding import PACKED_WITH_STATE


# The name under which the installed transformers' ``generate()`` hands the state to ``forward`` and reads it
# back from the output: ``cache`` from 5.24 on, ``past_key_values`` before (read off its public output classes).
def _cache_field(output_class: type[ModelOutput]) -> str:
    return "cache" if "cache" in {f.name for f in dataclasses.fields(output_class)} else "past_key_values"


CACHE_ARG = _cache_field(CausalLMOutputWithPast)
BASE_CACHE_ARG = _cache_field(BaseModelOutputWithPast)


def keeps_every_token(config: IsoLLMConfig) -> str | None:
    """Why the generation state of the model ``config`` describes cannot forget a token (None: it can), as assisted
    and prompt-lookup decoding would have it forget the draft tokens they reject."""
    if config.attn_scoring != "softmax":  # the one scoring with a key and a value per token
        return f"attn_scoring={config.attn_scoring} keeps running sums over every past token, which cannot forget one"
    if config.ffn == "isogmlp" and config.isogmlp_gate == "causal_mean":
        return "isogmlp_gate=causal_mean keeps a running mean over every past token, which cannot forget one"
    return None


class IsoLLMGenerationMixin(GenerationMixin):
    """transformers' ``GenerationMixin`` with this model's state (``IsoLLMCache``) and its limits."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate()``, without the ``torch.compile`` of the whole forward it starts for a static
        cache (``disable_compile``): the static ``IsoLLMCache`` replays its own captured step instead, which
        ``cache_implementation="static"`` also gets, sized as transformers sizes its own. Assisted and prompt-lookup
        decoding are refused up front where the state cannot forget the draft tokens they reject (``crop``)."""
        lookup = kwargs.get("prompt_lookup_num_tokens", getattr(kwargs.get("generation_config"),
                                                                 "prompt_lookup_num_tokens", None))
        if self.model.keeps_every_token and (kwargs.get("assistant_model") is not None or lookup):
            raise NotImplementedError(DROPS_DRAFTS.format(self.model.keeps_every_token))
        kwargs.setdefault("disable_compile", True)
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, inputs_embeds: torch.Tensor | None = None,
                                      **kwargs: Any) -> dict[str, Any]:
        """``generate()``'s inputs for one step (the public hook models override): transformers' own, with
        this model's ``IsoLLMCache`` as the state and without transformers' ``position_ids``.

        - The state: ``generate()`` starts a KV ``DynamicCache``; every scoring here keeps an ``IsoLLMCache``
          instead (iso_tanh has no keys or values), which replaces the empty one on the first step and comes
          back on every later one through the output (``CACHE_ARG``).
        - A step that continues after ``n`` tokens must find them in the cache: a cache that missed a step
          (say, a transformers release that renames the argument again) raises here instead of silently
          decoding every token without its past.
        - Positions: ``forward`` counts each row's real tokens from the attention mask itself; ``position_ids``
          that restart inside a prompt (packed documents) are refused, not attended across. transformers
          continues each row from its last prompt position, which is 0 at a right-padded row's trailing
          padding; counting real tokens gives every row, left- or right-padded, the positions it has alone.
        """
        cache = self._generation_cache(input_ids, inputs_embeds, kwargs)
        given = kwargs.get("position_ids")
        if given is not None and (cache is None or cache.seen_tokens == 0):  # the prompt: packed documents?
            mask = kwargs.get("attention_mask")
            if restarts_between_real_tokens(given, mask[:, -given.shape[-1]:].bool() if mask is not None else None):
                raise ValueError(f"generate(): {PACKED_WITH_STATE}")
        inputs = super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs,
                                                       **{CACHE_ARG: cache})
        inputs.pop("position_ids", None)
        return inputs

    def _generation_cache(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor | None,
                          kwargs: dict[str, Any]) -> IsoLLMCache | None:
        """Pop the state ``generate()`` passed (under either name) from ``kwargs``; check that it holds the
        tokens this step continues after (a prompt given as ``inputs_embeds`` included), or start one on the
        first step."""
        states = (kwargs.pop(name, None) for name in ("cache", "past_key_values"))
        given = [state for state in states if state is not None]
        if len(given) == 2 and given[0] is not given[1]:
            raise ValueError(f"generate() got two states, as cache= and as past_key_values=; transformers "
                             f"{transformers.__version__} reads {CACHE_ARG}=")
        cache = given[0] if given else None
        new_tokens = kwargs.get("next_sequence_length")  # None: every token of input_ids is new
        if not isinstance(cache, IsoLLMCache):
            if cache is not None and cache.get_seq_length() > 0:
                raise TypeError(f"{type(self).__name__} generates with its own IsoLLMCache; "
                                f"got a {type(cache).__name__} holding {cache.get_seq_length()} tokens")
            if kwargs.get("use_cache") is False:
                return None
            max_length = cache.get_max_length() if cache is not None else -1  # cache_implementation="static"
            cache = IsoLLMCache(self.config.num_hidden_layers, max_length=max_length if max_length > 0 else None)
        if inputs_embeds is not None and cache.seen_tokens == 0:  # input_ids will hold the generated tokens only
            cache.embedded_prompt = inputs_embeds.shape[1]
        past = input_ids.shape[1] + cache.embedded_prompt - new_tokens if new_tokens is not None else None
        if past is not None and cache.seen_tokens != past:
            raise RuntimeError(
                f"generate() continues after {past} tokens but the model's cache holds {cache.seen_tokens}: the "
                f"state of the last step did not come back (transformers {transformers.__version__} passes it as "
                f"{CACHE_ARG!r}); the tokens would be wrong")
        return cache
