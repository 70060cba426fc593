"""The isollm decoder: a Qwen3-style transformer with swappable FFN blocks and attention scoring.

One module serves plain-PyTorch training (``model(input_ids).logits``) and the Hugging Face hub
(``PreTrainedModel`` + ``GenerationMixin``). Its classes are those of transformers' Qwen3 modelling file:
``IsoLLMPreTrainedModel``, ``IsoLLMModel`` (the base model), ``IsoLLMForCausalLM`` and transformers' generic
sequence- and token-classification heads on top. Module and parameter names follow transformers' Qwen3
(``model.layers[i].self_attn.o_proj`` ...), except that the attention's q/k/v projections are fused
into ``qkv_proj`` and the FFN's input projections into ``mlp.in_proj`` (one matmul each); the stock
Qwen3 export (``llm/hf``) splits them back.

    x = embed_tokens(ids)
    for each layer:  x = x + self_attn(input_layernorm(x))           # RoPE, GQA, QK-norm, scoring
                     x = x + mlp(post_attention_layernorm(x))         # FFN_REGISTRY[config.ffn]
    logits = lm_head(norm(x))                                         # lm_head tied to embed_tokens

Generation keeps an ``IsoLLMCache`` (cache.py, a transformers ``Cache``): per layer, the scoring's state (the
KV cache for softmax, the O(1) ``(S, G)`` sums for iso_tanh) and a dict the FFN may keep running statistics in;
a static one (``max_length``) decodes each token after the prompt as one CUDA graph replay (static_decoding.py).
``generate()`` reaches the model through public hooks only (``prepare_inputs_for_generation``, ``forward``:
generation.py).
Siblings: decoder_layer.py (one block: attention and FFN), attention.py (scoring registry; iso_tanh's forms in
iso_tanh.py), ffn.py (FFN registry), fused_ops.py (RMSNorm and rotary kernels), padding.py (padded rows),
lm_head.py (the LM head and its fused cross-entropy).

Copied to the hub with its relative imports: torch and transformers only.
"""

from typing import Any, ClassVar, Unpack

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, PreTrainedModel
from transformers.modeling_layers import (
    GenericForSequenceClassification,
    GenericForTokenClassification,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from .attention import ATTN_SCORING_REGISTRY
from .cache import IsoLLMCache
from .config import ModelConfig
from .configuration_isollm import IsoLLMConfig
from .decoder_layer import IsoLLMAttention, IsoLLMDecoderLayer
from .fused_ops import RMSNorm
from .generation import BASE_CACHE_ARG, CACHE_ARG, IsoLLMGenerationMixin, keeps_every_token
from .layout import PackedDocuments, document_starts
from .lm_head import IGNORE_INDEX, LMHead
from .padding import from_last_real_token, real_token_mask, refuse_restarts
from .rotary import IsoLLMRotaryEmbedding
from .static_decoding import static_prompt, static_step


def mup_scaled_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters whose init std and Adam lr muP scales by 1/sqrt(m) and 1/m: those each module of ``model``
    lists in ``MUP_SCALED`` (names relative to the module). Two kinds (Tensor Programs V, Table 3): hidden
    matrices, both of whose dimensions grow with width, and readouts of the hidden state to a fixed size
    (isogmlp's token and causal_mean alpha gates). What is not scaled: ``ModelConfig.parametrization``."""
    return [module.get_parameter(name) for module in model.modules() for name in getattr(module, "MUP_SCALED", ())]


AUTO_CLASSES = {"AutoModel": "IsoLLMModel", "AutoModelForCausalLM": "IsoLLMForCausalLM",
                "AutoModelForSequenceClassification": "IsoLLMForSequenceClassification",
                "AutoModelForTokenClassification": "IsoLLMForTokenClassification"}
"""transformers' Auto class -> the isollm class it builds (``llm/__init__.py`` registers them)."""


class IsoLLMPreTrainedModel(PreTrainedModel):
    """What every isollm model shares with transformers: its config class, the base model's name (``model``), the
    attention implementations its scoring applies, gradient checkpointing, the outputs ``capture_outputs`` records
    (``_can_record_outputs``: each decoder layer's output, each attention's weights)."""

    config_class = IsoLLMConfig
    config: IsoLLMConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["IsoLLMDecoderLayer"]
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_record_outputs: ClassVar[dict[str, type[nn.Module]]] = {"hidden_states": IsoLLMDecoderLayer,
                                                                  "attentions": IsoLLMAttention}

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """Every scoring reads the config's ``_attn_implementation`` at each call (transformers' own test of this,
        a search of the source for its attention interface, does not see that)."""
        return True

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """transformers' choice among the scoring's ``IMPLEMENTATIONS`` (the first by default); one that does not
        apply to the scoring is refused, naming those that do."""
        applicable = ATTN_SCORING_REGISTRY[self.config.attn_scoring].IMPLEMENTATIONS
        if requested_attention is None:
            return applicable[0]
        if requested_attention in (*ALL_ATTENTION_FUNCTIONS.valid_keys(), "eager") and \
                requested_attention not in applicable:
            raise ValueError(f'attn_implementation="{requested_attention}" does not apply to attn_scoring='
                             f'{self.config.attn_scoring}; it runs {", ".join(applicable)}')
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' init, and this package's FFN blocks and projections (``reset_parameters``) where
        ``from_pretrained`` built them on the meta device (``drew_at_construction`` False) and the checkpoint lacks
        a value: transformers guards ``torch.nn.init`` here, so what was loaded is kept. Built for real, a block
        keeps what its constructor drew (transformers' would draw an ``nn.Linear`` projection again): drawing again
        would change the weights a seed gives."""
        drew = getattr(module, "drew_at_construction", None)
        if drew is None:
            super()._init_weights(module)
        elif not drew:
            module.reset_parameters()

    def save_pretrained(self, *args: Any, **kwargs: Any) -> None:
        """transformers' ``save_pretrained``; a class registered for an Auto class (as importing the llm package
        does) lists every ``AUTO_CLASSES`` entry in the directory's ``auto_map``, so that a causal-LM checkpoint
        also loads into ``AutoModel`` and the heads with ``trust_remote_code``."""
        if self._auto_class is not None:
            module = type(self).__module__.rsplit(".", 1)[-1]  # the name of the file copied beside the weights
            entries = {auto: f"{module}.{name}" for auto, name in AUTO_CLASSES.items()}
            self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **entries}
        return super().save_pretrained(*args, **kwargs)


class IsoLLMModel(IsoLLMPreTrainedModel):
    """Embedding, decoder layers and final norm: token ids (or their embeddings) -> normalised hidden states."""

    def __init__(self, config: IsoLLMConfig, inside_causal_lm: bool = False) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(IsoLLMDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = IsoLLMRotaryEmbedding(config)  # the cos/sin every layer shares
        self.document_mask = ATTN_SCORING_REGISTRY[config.attn_scoring].document_mask
        self.keeps_every_token = keeps_every_token(config)
        self._init_by_causal_lm = inside_causal_lm
        self.post_init()

    def init_weights(self) -> None:
        """transformers' init, except once inside ``IsoLLMForCausalLM``, whose ``post_init`` initialises the whole
        model in one pass after its head is built: in the order, and from the random state, of the decoder before
        it was a ``PreTrainedModel``, so that a seed gives the weights it gave then."""
        if self._init_by_causal_lm:
            self._init_by_causal_lm = False
            return
        super().init_weights()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @capture_outputs
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: IsoLLMCache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                past_key_values: IsoLLMCache | None = None, **kwargs: Unpack[TransformersKwargs],
                ) -> BaseModelOutputWithPast:
        """``norm(x_L)`` as ``last_hidden_state``. Either ``input_ids`` or ``inputs_embeds`` (``[B, T, hidden_size]``,
        e.g. soft prompts) is given.

        transformers' ``capture_outputs`` (as in Qwen3) reads ``output_hidden_states``, ``output_attentions`` and
        ``return_dict`` from the keywords, else the config, and records with hooks it installs on first request:
        ``hidden_states``, the embedding output and every block's output, the last replaced by ``last_hidden_state``
        (after the final norm; ``output_hidden_states`` may also be indices into them, the others then None);
        ``attentions``, each layer's weights, which the attention computes only then (``IsoLLMAttention``).
        Nothing asked, nothing is hooked or computed. (The per-layer metrics read the blocks' outputs before the
        final norm with their own hooks: llm/metrics/layers.py.)

        ``cache`` (or its older name ``past_key_values``, which transformers before 5.24 uses): an
        ``IsoLLMCache`` from an earlier call; the inputs then hold only the new tokens. ``use_cache=True``
        without one starts a cache.

        ``attention_mask``: ``[B, T_past + T]``, 1 at real tokens and 0 at padding (left or right), as
        transformers' tokenizers and ``generate()`` give it. Each row then gives exactly what its real
        tokens give alone; a padded position repeats the hidden state of the row's last real token before it.
        Without ``position_ids``, positions count each row's real tokens from 0, as transformers does
        (``cumsum(mask) - 1``), so a left-padded row is rotated as if it stood alone. ``position_ids`` that
        restart (not continuing the previous position by 1) mark packed documents, as transformers' own
        models read them: each document is then scored as if alone. That holds without a cache or padding mask
        only; with either, restarts between real tokens, or after the cache's, are refused rather than attended across.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("pass the generation state as cache= or past_key_values=, not two different ones")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, IsoLLMCache):
            raise TypeError(f"the generation state must be an IsoLLMCache; got {type(cache).__name__}")
        if cache is None and use_cache:
            cache = IsoLLMCache(self.config.num_hidden_layers)
        if cache is not None:  # whether assisted decoding may roll it back (IsoLLMCache.crop)
            cache.keeps_every_token = self.keeps_every_token
        # the flags as capture_outputs resolves them: keyword, else config
        output_attentions = kwargs.get("output_attentions", self.config.output_attentions)
        output_hidden_states = kwargs.get("output_hidden_states", self.config.output_hidden_states)
        b, t = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        padding_mask = real_token_mask(attention_mask, (b, t), cache)
        if cache is not None and cache.max_length is not None:  # a static cache: its prompt, then one-token steps
            if cache.seen_tokens:  # a captured graph: no hook sees its layers
                if inputs_embeds is not None or output_attentions or output_hidden_states:
                    raise ValueError("a static cache's steps take input_ids, without output_attentions or "
                                     "output_hidden_states")
                hidden = self.norm(static_step(self, input_ids, padding_mask, cache))
                return BaseModelOutputWithPast(last_hidden_state=hidden, **{BASE_CACHE_ARG: cache})
            if t > cache.max_length:
                raise ValueError(f"the prompt has {t} tokens, more than the static cache's max_length "
                                 f"{cache.max_length}")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        packed = position_ids is not None and cache is None and padding_mask is None
        if position_ids is not None and not packed and t > 1:  # one token (a decoding step) is not read back
            refuse_restarts(position_ids, padding_mask, cache)
        doc_starts = document_starts(position_ids, b) if packed else None
        documents = PackedDocuments(doc_starts, self.document_mask(doc_starts)) if doc_starts is not None else None
        if position_ids is None and padding_mask is not None:
            position_ids = (padding_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -t:]
        elif position_ids is None:
            start = cache.seen_tokens if cache is not None else 0
            position_ids = torch.arange(start, start + t, device=x.device)[None]
        cos, sin = self.rotary_emb(x, position_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.layers[i] if cache is not None else None, padding_mask, documents,
                      output_attentions=bool(output_attentions))
        if cache is not None:
            if cache.max_length is not None:  # the prompt's states move into the buffers of the steps
                static_prompt(self, cache, padding_mask, (b, t), x.device)
            cache.seen_tokens += t
        if padding_mask is not None and t > 1:  # one token (a generation step) is its own source: nothing to do
            x = from_last_real_token(x, padding_mask[:, -t:])
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), **{BASE_CACHE_ARG: cache})


class IsoLLMForCausalLM(IsoLLMPreTrainedModel, IsoLLMGenerationMixin):
    """The decoder plus LM head; the training module and the hub model at once."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}
    """A dict in transformers 5; without it tie_word_embeddings is silently ignored."""
    _tp_plan: ClassVar[dict[str, str]] = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: IsoLLMConfig) -> None:
        super().__init__(config)
        self.model = IsoLLMModel(config, inside_causal_lm=True)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, config.lm_head_precision)
        self.post_init()  # transformers' init (normal(0, initializer_range), norms to 1) and weight tying
        self.logit_multiplier = 1 / config.width_multiplier  # muP's output multiplier (1 under standard)
        with torch.no_grad():
            for param in mup_scaled_parameters(self):
                param.mul_(config.hidden_init_std / config.initializer_range)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: IsoLLMCache | None = None,
                use_cache: bool | None = None, labels: torch.LongTensor | None = None,
                shift_labels: torch.LongTensor | None = None, logits_to_keep: int = 0,
                past_key_values: IsoLLMCache | None = None, inputs_embeds: torch.Tensor | None = None,
                fused_loss: bool = False, num_items_in_batch: torch.Tensor | int | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> CausalLMOutputWithPast:
        """Logits ``[B, T, V]`` (only the last ``logits_to_keep`` positions when > 0, as ``generate()``
        asks) and, given targets, the mean next-token cross-entropy in fp32 over targets != -100.

        Targets come as ``labels`` (transformers' convention: position t predicts ``labels[:, t + 1]``)
        or as ``shift_labels`` (already aligned: position t predicts ``shift_labels[:, t]``, so a packed
        ``[B, T + 1]`` window trains on all T predictions). The logits come back with the loss, as from
        transformers' models (TRL's token accuracy and custom losses read them), unless the caller asks for
        ``fused_loss=True`` (the project's trainer and bench do): the loss is then fused with the LM head
        (``lm_head.linear_cross_entropy``), the ``[B, T, V]`` logits are never materialised and ``logits`` is
        None. Under tensor parallelism, or with a head that is not this package's ``LMHead`` (transformers'
        ``resize_token_embeddings`` puts a plain ``nn.Linear`` on an untied model), the loss reads the logits.

        ``num_items_in_batch`` (``Trainer`` passes it under gradient accumulation): the targets of every
        micro-batch of the optimizer step; the loss is then this micro-batch's sum over its targets divided by
        it, as transformers' own loss functions give it, so that the accumulated gradient is the step's mean.

        The inputs, the cache, the attention mask and the output flags (``kwargs``) are ``IsoLLMModel.forward``'s;
        ``return_dict=False`` (by keyword, else the config's) gives the output's ``to_tuple()``. The output
        carries the cache under ``CACHE_ARG``, the name the installed transformers reads (``out.cache`` /
        ``out.past_key_values``). At a padded position the logits repeat those of the row's last real token
        before it, so ``logits[:, -1]`` is each row's next-token prediction, whichever side is padded.
        """
        base = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, past_key_values,
                          return_dict=True, **kwargs)
        hidden = base.last_hidden_state
        if self.logit_multiplier != 1:  # logits = lm_head(hidden) / m: scaling the head's input is the same
            hidden = hidden * self.logit_multiplier
        if shift_labels is None and labels is not None:
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        logits = loss = None
        # Under tensor parallelism (a ``tp_plan`` at load) the head holds a slice of the vocabulary: the loss then
        # reads the logits its plan gathers, exactly; the fused kernel needs the whole weight.
        if fused_loss and shift_labels is not None and (self.tp_size or 1) == 1 and isinstance(self.lm_head, LMHead):
            loss = self.lm_head(hidden, shift_labels)
        else:
            logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
            if shift_labels is not None:
                stats_dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 in tests
                loss = F.cross_entropy(logits.flatten(0, 1).to(stats_dtype), shift_labels.flatten(),
                                       ignore_index=IGNORE_INDEX)
        if loss is not None and num_items_in_batch is not None:  # the mean times this micro-batch's targets: its sum
            targets = (shift_labels != IGNORE_INDEX).sum()  # (none: 0, not the mean's NaN, with a zero gradient)
            loss = torch.where(targets > 0, loss * targets, 0) / num_items_in_batch
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=base.hidden_states,
                                      attentions=base.attentions, **{CACHE_ARG: getattr(base, BASE_CACHE_ARG)})

class _BaseModelByAutoModel:
    """transformers' generic heads build their base model with ``AutoModel.from_config(config)``: the class of the
    config they are given maps to this module's ``IsoLLMModel`` first. (As a hub directory's remote code, the config
    class comes from a module of its own, which ``llm``'s registration of ``AutoModel`` cannot know.)"""

    def __init__(self, config: IsoLLMConfig) -> None:
        AutoModel.register(type(config), IsoLLMModel, exist_ok=True)
        super().__init__(config)


class IsoLLMForSequenceClassification(_BaseModelByAutoModel, GenericForSequenceClassification, IsoLLMPreTrainedModel):
    """``IsoLLMModel`` plus a linear ``score`` head read at each row's last non-padding token (transformers' generic
    head, as Qwen3's); ``config.num_labels`` classes, ``config.pad_token_id`` marks padding."""

    accepts_loss_kwargs = False
    """The generic head's loss is each micro-batch's mean and ignores ``num_items_in_batch``: declared, ``Trainer``
    divides it by the accumulation steps itself (its forward's ``**kwargs`` would tell it the opposite)."""


class IsoLLMForTokenClassification(_BaseModelByAutoModel, GenericForTokenClassification, IsoLLMPreTrainedModel):
    """``IsoLLMModel`` plus a linear ``score`` head at every token (transformers' generic head, as Qwen3's)."""

    accepts_loss_kwargs = False  # as the sequence head's


def meta_model(config: ModelConfig) -> IsoLLMForCausalLM:
    """The model ``config`` describes, on the meta device: its shapes without memory or init."""
    hf_config = config if isinstance(config, IsoLLMConfig) else IsoLLMConfig.from_model_config(config)
    with torch.device("meta"):
        return IsoLLMForCausalLM(hf_config)


def param_counts(config: ModelConfig) -> tuple[int, int]:
    """``(total, non_embedding)`` parameters of the model ``config`` describes, built on the meta device.

    Tied weights count once. ``non_embedding`` leaves out ``embed_tokens`` and an untied ``lm_head``
    (the usual convention for scaling laws: both are lookups/readouts of size V x d).
    """
    model = meta_model(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    if not model.config.tie_word_embeddings:
        embedding += model.lm_head.weight.numel()
    return total, total - embedding
