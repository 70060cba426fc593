"""The hub model card (``README.md``): metadata, the variant and its equations, size, training, usage, citations.

``model_card(config, run=..., qwen3=...)`` is pure text from a ``ModelConfig`` and an optional
``RunSummary``; ``run_summary(checkpoint_dir)`` reads what a run recorded (its ``config.yaml``,
``trainer.json`` and ``metrics.jsonl``). ``save_for_hub`` and ``isollm-hub push`` write the same card.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from llm.model import ModelConfig, param_counts
from llm.model.ffn import resolve_intermediate_size
from llm.train.model_dir import save_model_dir

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from llm.model import IsoLLMForCausalLM

FFN_EQUATIONS: dict[str, str] = {
    "swiglu": "FFN(x) = W_down( SiLU(W_g x) ⊙ (W_u x) )   (the Qwen3 baseline)",
    "isogmlp": "FFN(x) = W_down( α·SiLU(W_g x)⊙(W_u x) + (1−α)·(γ⊙(W_i x) + β) ),  "
               "α = sigmoid(w_a·s + b_a)   (IsoGMLP eq. 1-4; s per `isogmlp_gate`)",
    "iso_ln": "FFN(x) = W_down( α·SiLU(W_g x)⊙(W_u x) + (2−α)·LayerNorm(W_i x) + β ),  α ∈ [0.5, 2], "
              "|β| ≤ 0.1   (isotropy-preserving pathway)",
    "iso_mlp": "FFN(x) = W_down( f(W_up x) ),  f(v) = σ(|v|) v/|v|   "
               "(isotropic deep learning eq. 13; σ per `iso_activation`)",
}
"""``ModelConfig.ffn`` -> the block's formula (llm/model/ffn.py)."""

ATTENTION_EQUATIONS: dict[str, str] = {
    "softmax": "out_i = Σ_{j≤i} softmax_j(q_i·k_j/√D) v_j",
    "iso_tanh": "out_i = tanh(|s_i|)/|s_i| · Σ_{j≤i} s_ij v_j,  s_ij = q_i·k_j/√D   "
                "(isotropic deep learning eq. 16, 28; linear time through S = Σ k vᵀ, G = Σ k kᵀ)",
}
"""``ModelConfig.attn_scoring`` -> the scoring's formula (llm/model/attention.py)."""

LINEAR_EQUATIONS: dict[str, str] = {
    "linear": "z = W x",
    "affine_like": "z = (W x + b) / √(|x|² + 1)   (affine divergence eq. 19)",
    "focus": "z = (W ⊙ Φ) x,  Φ_ji = s_j exp(−(τ_i − μ_j)² / 2σ_j²)   (focusing neuron eq. 5-7)",
}
"""``ModelConfig.ffn_linear`` -> the FFN input projections' formula (llm/model/linear.py)."""

CITATIONS: dict[str, str] = {
    "qwen3": "Qwen Team. *Qwen3 Technical Report*. arXiv:2505.09388, 2025.",
    "fineweb": "G. Penedo et al. *The FineWeb Datasets: Decanting the Web for the Finest Text Data at Scale*. "
               "arXiv:2406.17557, 2024.",
    "isotropic": "*Towards Isotropic Deep Learning: A New Default Inductive Bias*. Position paper, 2025.",
    "isogmlp": "Aardvark. *IsoGMLP: A Systematic Exploration of Isotropy in Gated MLP Architectures*. 2025.",
    "iso_ln": "Aardvark. *Systematic Analysis of Isotropy-Preserving Pathways in Transformer Feedforward "
              "Networks*. 2025.",
    "affine_like": "G. Bird. *The Affine Divergence: Aligning Activation Updates Beyond Normalisation*. 2025.",
    "focus": "F. B. Tek. *An Adaptive Locally Connected Neuron Model: Focusing Neuron*.",
}
"""Short references; ``_citations`` picks those of a variant."""


@dataclass
class RunSummary:
    """What a run recorded about the checkpoint being published."""

    name: str
    step: int
    tokens: int
    config: str
    """The run's resolved config: the text of the checkpoint's ``config.yaml``."""
    val_loss: float | None = None
    """The last ``eval`` row of ``metrics.jsonl`` at or before ``step``; None if there is none."""
    bits_per_byte: float | None = None
    data: str | None = None
    """The run's ``data.source`` when its metrics show training on it (a train row with tokens at or before
    ``step``); None for an untrained model, whose card then names no training data."""


def run_summary(checkpoint_dir: str | Path) -> RunSummary:
    """The summary of checkpoint ``checkpoint_dir`` (``runs/NAME/checkpoints/step_X``) from its run's files; bits
    per byte are not in ``metrics.jsonl`` (they need the validation text): ``val_bits_per_byte`` gives them."""
    from llm.eval.errors import EvalError
    from llm.eval.runs import read_metrics, step_rows

    checkpoint_dir = Path(checkpoint_dir)
    state = json.loads((checkpoint_dir / "trainer.json").read_text())["state"]
    step = int(state["step"])
    run_dir = checkpoint_dir.parent.parent
    try:  # compare's reader: a truncated last line is skipped, a step re-logged after a resume supersedes
        rows = read_metrics(run_dir)
    except (FileNotFoundError, EvalError):  # no metrics.jsonl, or a line of it that is not JSON
        rows = []
    evals = [r for r in step_rows(rows, "eval") if r["step"] <= step]
    tokens = int(state["tokens"])  # what the checkpoint trained on: its data is named only when it did
    config = (checkpoint_dir / "config.yaml").read_text()
    return RunSummary(name=run_dir.name, step=step, tokens=tokens, config=config,
                      val_loss=float(evals[-1]["val_loss"]) if evals else None,
                      data=yaml.safe_load(config)["data"]["source"] if tokens > 0 else None)


def val_bits_per_byte(checkpoint_dir: str | Path, val_loss: float) -> float | None:
    """Bits per byte of ``val_loss`` on the run's validation windows (``llm.eval.evaluate.bits_per_byte``:
    the windows' targets and their UTF-8 bytes; the model is not run). None when the data is unreachable."""
    from llm.data import build_val_windows, load_tokenizer
    from llm.data.errors import DataError
    from llm.eval.evaluate import bits_per_byte, resolve_checkpoint, token_byte_lengths
    from llm.eval.evaluate import eval_config as load_eval_config

    resolved = resolve_checkpoint(str(checkpoint_dir))
    try:
        tokenizer = load_tokenizer(resolved.model_path)
        windows = build_val_windows(load_eval_config(resolved).data, tokenizer)
    except (DataError, OSError, RuntimeError):
        return None
    size = max(tokenizer.get_vocab_size(with_added_tokens=True), int(windows.max()) + 1)
    bpb, _ = bits_per_byte(val_loss, windows, token_byte_lengths(tokenizer, size))
    return None if math.isnan(bpb) else bpb


def _fineweb(run: RunSummary | None) -> bool:
    return run is not None and run.data is not None and "fineweb" in run.data.lower()


def _citations(config: ModelConfig, run: RunSummary | None) -> list[str]:
    keys = ["qwen3", "fineweb"] if _fineweb(run) else ["qwen3"]
    if config.ffn != "swiglu" or config.attn_scoring != "softmax":
        keys.append("isotropic")
    keys += [k for k in (config.ffn, config.ffn_linear) if k in CITATIONS]
    return [CITATIONS[k] for k in dict.fromkeys(keys)]


def _front_matter(config: ModelConfig, qwen3: bool, run: RunSummary | None) -> str:
    tags = ["isollm", "qwen3" if qwen3 else "custom_code", config.ffn, config.attn_scoring]
    if config.ffn_linear != "linear":
        tags.append(config.ffn_linear)
    meta = {"library_name": "transformers", "license": "apache-2.0", "language": ["en"],
            "pipeline_tag": "text-generation", "tags": tags,  # the hub's dataset link: only for a model trained on it
            **({"datasets": ["HuggingFaceFW/fineweb"]} if _fineweb(run) else {})}
    # JSON values are YAML: the hub reads this block as its metadata
    return "---\n" + "".join(f"{key}: {json.dumps(value)}\n" for key, value in meta.items()) + "---\n"


def _usage(qwen3: bool, repo_id: str) -> str:
    if qwen3:
        load = (f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
                f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")  # stock Qwen3ForCausalLM\n')
        note = "The weights are in the stock Qwen3 format: transformers loads them with no remote code."
    else:
        load = (f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}", trust_remote_code=True)\n'
                f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)\n')
        note = ("The modelling code ships with the weights (`auto_map`): `trust_remote_code=True` runs it; "
                "`pip install isollm` is not needed. The tokenizer is a stock fast tokenizer; transformers "
                "reads the model config before it, so pass `trust_remote_code` (either value) to "
                "`AutoTokenizer` as well to avoid its interactive prompt.")
    return ("## How to use\n\n" + note + "\n\n```python\nfrom transformers import AutoModelForCausalLM, "
            "AutoTokenizer\n\n" + load + 'inputs = tokenizer(["The capital of France is", "Once upon a time,"], '
            'return_tensors="pt", padding=True)\nout = model.generate(**inputs, max_new_tokens=32)\n'
            "print(tokenizer.batch_decode(out, skip_special_tokens=True))\n```\n\n"
            "Padded batches (left or right) give each row what it gives alone.\n")


def _format(value: float | None, digits: int) -> str:
    return "not recorded" if value is None else f"{value:.{digits}f}"


def model_card(config: ModelConfig, *, repo_id: str, run: RunSummary | None = None, qwen3: bool = False) -> str:
    """The ``README.md`` of model ``config`` published as ``repo_id``; ``qwen3`` for the stock-Qwen3 export."""
    total, non_embedding = param_counts(config)
    lines = [
        _front_matter(config, qwen3, run), f"# isollm {config.variant_name}" + (f" ({run.name})" if run else ""), "",
        "A Qwen3-style decoder (RMSNorm, rotary positions, grouped-query attention with QK-norm, "
        f"{'tied' if config.tie_word_embeddings else 'untied'} input and output embeddings)"
        + (f" pretrained on {'FineWeb' if _fineweb(run) else 'text'} (`{run.data}`)" if run and run.data else "")
        + " with isollm, a codebase that swaps the feed-forward block and the attention scoring to "
        "compare isotropic variants like for like.",
        "", "## Variant", "",
        f"- FFN `{config.ffn}`: `{FFN_EQUATIONS[config.ffn]}`",
        f"- FFN input projections `{config.ffn_linear}`: `{LINEAR_EQUATIONS[config.ffn_linear]}`",
        f"- attention scoring `{config.attn_scoring}`: `{ATTENTION_EQUATIONS[config.attn_scoring]}`",
    ]
    if config.ffn == "isogmlp":
        lines.append(f"- alpha gate input `{config.isogmlp_gate}`")
    if config.ffn == "iso_mlp":
        lines.append(f"- isotropic activation `{config.iso_activation}`")
    lines += [
        "", "## Size", "",
        "| parameters | non-embedding | layers | hidden | FFN | heads (KV) | head dim | vocabulary | context |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {total:,} | {non_embedding:,} | {config.num_hidden_layers} | {config.hidden_size} | "
        f"{resolve_intermediate_size(config)} | {config.num_attention_heads} ({config.num_key_value_heads}) | "
        f"{config.resolved_head_dim} | {config.vocab_size:,} | {config.max_position_embeddings:,} |",
        "", "## Training", ""]
    if run is None:
        lines.append("No training run was recorded with this model directory.")
    else:
        lines += [
            f"- tokens seen: {run.tokens:,} ({run.step:,} optimizer steps)",
            f"- final validation loss: {_format(run.val_loss, 4)} nats/token",
            f"- bits per byte: {_format(run.bits_per_byte, 4)} (the same loss over the UTF-8 bytes of the "
            "validation text)",
            "", "<details><summary>Run config</summary>", "", "```yaml", run.config.rstrip(), "```", "", "</details>"]
    lines += ["", _usage(qwen3, repo_id), "## Citation", "", *(f"- {citation}" for citation in _citations(config, run))]
    return "\n".join(lines) + "\n"


def save_for_hub(model: IsoLLMForCausalLM, directory: str | Path, tokenizer: Tokenizer | None = None,
                 run: RunSummary | None = None, repo_id: str | None = None) -> Path:
    """A hub-ready directory: ``save_model_dir`` (``llm.train.model_dir``, what every checkpoint's ``model/`` is,
    loadable where ``llm`` is absent) plus the ``README.md`` model card, which reports ``run``'s training (tokens,
    final val loss, bits per byte, config) when given and shows loading from ``repo_id`` (default: the directory)."""
    directory = save_model_dir(model, directory, tokenizer)
    card = model_card(model.config.to_model_config(), run=run, repo_id=repo_id or str(directory))
    (directory / "README.md").write_text(card)
    return directory
