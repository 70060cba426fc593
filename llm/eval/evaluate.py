"""Evaluate one checkpoint or hub model: val loss / perplexity / bits per byte, isotropy report, samples.

The validation loss is ``llm.train.evaluate.evaluate`` on ``llm.data.build_val_windows`` with the
run's ``train.micro_batch_size`` and precision, the exact computation the trainer logs, so the
``val_loss`` of a checkpoint equals the logged one at that step (bit for bit on the same device).

Bits per byte (tokenizer-independent, comparable across vocabularies)::

    bpb = sum_t loss_t / ln 2 / sum_t bytes(target_t) = val_loss * n_tokens / (ln 2 * n_bytes)

over every target token ``t`` of the validation windows (``windows[:, 1:]``), with ``loss_t`` in
nats and ``bytes(id)`` the number of UTF-8 bytes the token decodes to: for byte-level BPE
tokenizers (Qwen3, our trained BPE) every vocabulary symbol stands for exactly one byte, so the
per-token counts add up to the UTF-8 length of the decoded text. Special tokens (the document
separator ``<|endoftext|>``) count 0 bytes but their loss is included: predicting where a document
ends is part of the model's job. For tokenizers that are not byte-level, ``bytes(id)`` is the
UTF-8 length of ``decode([id])``, an approximation where a token holds part of a character.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, pre_tokenizers
from torch import nn

from llm.config import PLACEHOLDER_BUDGET, RunConfig, load_config
from llm.eval.errors import EvalError

DEFAULT_PROMPTS = ("The capital of France is", "Once upon a time,",
                   "The most important thing to remember about machine learning is", "In 1969, the first humans",
                   "Here is a simple recipe for bread:")
"""Fixed prompts for the samples: the same text for every checkpoint, so samples are comparable."""

LAYER_COLUMNS = ("layer", "isoscore", "mean_cos", "eff_rank", "basis_alignment", "alpha", "beta",
                 "pathway_ratio")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class ResolvedModel:
    """Where the weights come from: a local model directory (with its checkpoint's files) or a hub id."""

    model_path: str
    checkpoint_dir: Path | None = None
    """The checkpoint directory holding ``config.yaml`` and ``trainer.json``; None for a bare model dir."""

    @property
    def is_local(self) -> bool:
        return Path(self.model_path).is_dir()

    @property
    def config_file(self) -> Path | None:
        if self.checkpoint_dir is not None and (self.checkpoint_dir / "config.yaml").is_file():
            return self.checkpoint_dir / "config.yaml"
        return None

    @property
    def step(self) -> int | None:
        if self.checkpoint_dir is None or not (self.checkpoint_dir / "trainer.json").is_file():
            return None
        return int(json.loads((self.checkpoint_dir / "trainer.json").read_text())["state"]["step"])


def _verify(checkpoint: Path) -> None:
    """A checkpoint named directly must match its manifest (sizes and checksums), as on resume."""
    from llm.train.checkpoint_files import MANIFEST, CheckpointError, verify_checkpoint

    if (checkpoint / MANIFEST).is_file():
        try:
            verify_checkpoint(checkpoint)
        except CheckpointError as err:
            raise EvalError(str(err)) from None


def _named_by_its_step(resolved: ResolvedModel) -> ResolvedModel:
    """Refuse a checkpoint directory named for another step than its trainer.json records (renamed by hand), as a
    resume does: the newest of a run is chosen by name, and its name is the step it is taken for. A checkpoint
    copied under a name of its own (``best/``) is taken for what it records."""
    from llm.train.checkpoint_files import PREFIX, checkpoint_name

    name, step = resolved.checkpoint_dir.name if resolved.checkpoint_dir else "", resolved.step
    if step is not None and name.startswith(PREFIX) and name != checkpoint_name(step):
        raise EvalError(f"{resolved.checkpoint_dir} holds step {step} (its trainer.json): a directory renamed by "
                        f"hand; rename it {checkpoint_name(step)}, or move it out of {resolved.checkpoint_dir.parent}")
    return resolved


def resolve_checkpoint(target: str) -> ResolvedModel:
    """A run directory (-> its newest complete checkpoint), a checkpoint directory (checked against its
    manifest), its ``model/`` directory, or a hub id. Raise FileNotFoundError naming ``target`` for a local
    path that is none, EvalError for a checkpoint named for another step than it holds (``_named_by_its_step``)."""
    path = Path(target).expanduser()
    if path.is_dir():
        if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file():
            from llm.train.checkpoint_files import latest_checkpoint

            checkpoint = latest_checkpoint(path / "checkpoints")
            if checkpoint is None:
                raise FileNotFoundError(f"{target}: run directory without a complete checkpoint "
                                        f"(nothing verifiable in {path / 'checkpoints'})")
            return _named_by_its_step(ResolvedModel(str(checkpoint / "model"), checkpoint))
        if (path / "model" / "config.json").is_file():
            _verify(path)
            return _named_by_its_step(ResolvedModel(str(path / "model"), path))
        if (path / "config.json").is_file():
            parent = path.parent if (path.parent / "config.yaml").is_file() else None
            if parent is not None:
                _verify(parent)  # a checkpoint's model/ named directly is checked as the checkpoint is
            return _named_by_its_step(ResolvedModel(str(path), parent))
        raise FileNotFoundError(f"{target}: not a run, checkpoint or model directory "
                                "(no checkpoints/, model/config.json or config.json)")
    # A hub id is "name" or "owner/name"; anything else that does not exist is a mistyped path. So is
    # "runs/typo" when "runs" exists here: a hub lookup would only hide the mistake.
    if path.exists() or not _HUB_ID.match(target) or Path(target.split("/")[0]).exists():
        raise FileNotFoundError(f"{target}: no such checkpoint, model or run directory")
    return ResolvedModel(target)


def load_model(resolved: ResolvedModel, trust_remote_code: bool = False,
               device: str | torch.device = "cpu") -> nn.Module:
    """Load fp32 weights with ``AutoModelForCausalLM``: ``import llm`` registers our class, so local
    checkpoints need no remote code; a hub model's own code runs only with ``trust_remote_code``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import llm  # noqa: F401  (registers the isollm Auto classes)
    from llm.hub_access import OFFLINE_HINT, offline_unless_reachable
    from llm.train.model_dir import quiet_progress_bars

    unreachable = None if resolved.is_local else offline_unless_reachable()
    try:
        if resolved.is_local:
            config = AutoConfig.from_pretrained(resolved.model_path, trust_remote_code=trust_remote_code)
            check_weights_fit(Path(resolved.model_path), config, trust_remote_code)
        with quiet_progress_bars():  # "Loading weights" bars say nothing here
            model = AutoModelForCausalLM.from_pretrained(resolved.model_path, dtype=torch.float32,
                                                         trust_remote_code=trust_remote_code)
    except EvalError:
        raise
    except (OSError, ValueError) as err:
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        hint = f"; {OFFLINE_HINT} ({unreachable})" if unreachable else ""
        raise EvalError(f"{resolved.model_path}: cannot load the model ({first_line}){hint}") from None
    return model.to(device).eval()


def check_weights_fit(model_dir: Path, config: Any, trust_remote_code: bool = False) -> None:
    """Refuse (``EvalError``) a model directory whose config.json implies other tensors than its safetensors hold,
    before any weight is allocated: the model is built on the meta device and compared with the files' headers.
    Named: the fields whose change reshapes only tensors that do not fit (those that reshape every one of them, if
    any; of those, the ones whose value is a dimension that does not fit, if any). An isollm model must also have
    every tensor, and no other."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    def shapes_of(cfg: Any) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
        tensors = {id(t): (key, tuple(t.shape)) for key, t in reversed(model.state_dict(keep_vars=True).items())}
        return dict(tensors.values())  # a tied tensor under its first name, the one saved

    def reshaped(field: str) -> set[str]:
        changed = copy.deepcopy(config)
        setattr(changed, field, fields[field] * 2)
        with contextlib.suppress(Exception):  # a value the config refuses: no answer
            shapes = shapes_of(changed)
            return {k for k in saved.keys() & expected.keys() if shapes.get(k) != expected[k]}
        return set()

    fields = {k: v for k, v in config.to_dict().items() if type(v) is int}
    try:
        expected = shapes_of(config)
    except RuntimeError as err:  # "Storage size calculation overflowed", even on the meta device
        named = [f"{k}={v}" for k, v in fields.items() if str(v) in re.findall(r"\d+", str(err))] or ["sizes"]
        raise EvalError(f"{model_dir}: config.json's {' or '.join(named)} is too large to build a model "
                        f"({str(err).splitlines()[0]})") from None
    saved: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with contextlib.suppress(Exception), safe_open(path, "pt") as file:  # unreadable: from_pretrained says so
            saved.update({key: tuple(file.get_slice(key).get_shape()) for key in file.keys()})  # noqa: SIM118
    wrong = [k for k in saved if k in expected and saved[k] != expected[k]]
    reshapes = {f: keys for f in fields if wrong and (keys := reshaped(f)) and keys <= set(wrong)}
    # one field that reshapes every tensor that does not fit explains them all: hidden_size, not also an
    # intermediate_size of the same value, which reshapes only some (the MLP's)
    suspects = [f for f, keys in reshapes.items() if keys == set(wrong)] or list(reshapes)
    dimensions = [f for f in suspects if any(fields[f] in expected[k] and fields[f] not in saved[k] for k in wrong)]
    named = [f"{f}={fields[f]}" for f in dimensions or suspects]
    problems = [f"{k} is {list(saved[k])} in the safetensors, {list(expected[k])} by config.json" for k in wrong]
    if saved and config.model_type == "isollm":  # names as saved (transformers renames none of ours)
        problems += [f"{k} is missing from the safetensors" for k in sorted(expected.keys() - saved.keys())]
        problems += [f"{k} in the safetensors is not in config.json's model" for k in sorted(saved.keys() - expected)]
    if problems:
        field = "config.json's " + " or ".join(named) if named else "config.json"
        more = f"; {len(problems) - 1} more" if len(problems) > 1 else ""
        raise EvalError(f"{model_dir}: {field} does not fit its weights ({problems[0]}{more})")


def eval_config(resolved: ResolvedModel, config_files: list[str] | None = None,
                overrides: list[str] | None = None) -> RunConfig:
    """The checkpoint's ``config.yaml`` (if any), then ``config_files``, then ``overrides``. Without a checkpoint
    config (hub ids, bare model directories) the defaults apply: FineWeb's held-out documents."""
    files = [str(resolved.config_file)] if resolved.config_file else []
    base = [] if files else [PLACEHOLDER_BUDGET]
    return load_config([*files, *(config_files or [])], [*base, *(overrides or [])], saved_run=bool(files))


def token_byte_lengths(tokenizer: Tokenizer, size: int) -> torch.Tensor:
    """``LongTensor[size]``: UTF-8 bytes each token id decodes to (0 for special tokens and for the
    padding ids beyond the tokenizer's vocabulary, which never occur in data)."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    byte_level = "ByteLevel" in json.dumps(decoder)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())  # GPT-2's printable stand-ins for the 256 bytes
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    lengths = torch.zeros(size, dtype=torch.long)
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        if index >= size or token in special:
            continue
        if byte_level and all(ch in alphabet for ch in token):
            lengths[index] = len(token)  # one symbol per byte
        else:  # added tokens (stored as text) and non-byte-level vocabularies
            lengths[index] = len(tokenizer.decode([index], skip_special_tokens=False).encode("utf-8"))
    return lengths


def bits_per_byte(val_loss: float, val_windows: torch.Tensor, byte_lengths: torch.Tensor) -> tuple[float, int]:
    """(bits per byte, number of target bytes) from the mean loss in nats over ``val_windows[:, 1:]``."""
    targets = val_windows[:, 1:]
    n_bytes = int(byte_lengths[targets].sum())
    if n_bytes == 0:
        return math.nan, 0
    return val_loss * targets.numel() / (math.log(2) * n_bytes), n_bytes


@torch.no_grad()
def generate_samples(model: nn.Module, tokenizer: Tokenizer, prompts: list[str], max_new_tokens: int,
                     temperature: float = 0.0, seed: int = 0, eos: int | None = None) -> list[dict[str, str]]:
    """Continue each prompt: greedy when ``temperature`` is 0, else sampling seeded by ``seed`` and the prompt, so
    each prompt has its own draw (one seed for all gave a weak model's prompts the same continuation), the same
    whatever the other prompts."""
    device = next(model.parameters()).device
    samples = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids], device=device)
        torch.manual_seed(int.from_bytes(hashlib.blake2b(f"{seed}\0{prompt}".encode(), digest_size=8).digest()))
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {
            "do_sample": False}
        out = model.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos,
                             attention_mask=torch.ones_like(ids), **sampling)
        completion = tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
        samples.append({"prompt": prompt, "completion": completion})
    return samples


@dataclass
class EvalReport:
    target: str
    model_path: str
    step: int | None
    model_type: str
    variant: str | None
    data_source: str
    val_windows: int
    val_tokens: int
    val_bytes: int
    val_loss: float
    val_ppl: float
    bits_per_byte: float
    layers: list[dict[str, float]] = field(default_factory=list)
    samples: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _has_ffn_diagnostics(model: nn.Module) -> bool:
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers is not None and all(hasattr(block.mlp, "diagnostics") for block in layers)


def eval_device(device: str | None) -> torch.device:
    """``device`` (default: cuda when available), refused in one line when this torch cannot place a tensor there."""
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        placed = torch.empty(0, device=name).device
    except (RuntimeError, AssertionError):  # an unknown name; "Torch not compiled with CUDA enabled"; no such GPU
        placed = None
    if placed is None or placed.type == "meta":  # meta tensors hold shapes, no values: nothing to compute with
        available = ", ".join(["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))])
        raise EvalError(f"--device {name}: not a device this torch can use (available: {available})")
    return placed


def load_for_eval(target: str, config_files: list[str] | None = None, overrides: list[str] | None = None,
                  trust_remote_code: bool = False, device: str | None = None,
                  before_model: Callable[[RunConfig], None] | None = None,
                  ) -> tuple[ResolvedModel, RunConfig, nn.Module, Tokenizer, torch.device]:
    """``target``'s checkpoint, its config (with ``config_files`` and ``overrides``), its model on ``device`` (default:
    cuda when available) and the tokenizer to evaluate with, refused when it has ids past the model's embedding.
    ``before_model(config)``: the caller's checks of its input against the config, before the model is loaded."""
    from llm.data import load_tokenizer
    from llm.data.tokenizer import ids_past

    resolved = resolve_checkpoint(target)
    config = eval_config(resolved, config_files, overrides)
    torch_device = eval_device(device)
    if before_model:
        before_model(config)
    model = load_model(resolved, trust_remote_code, torch_device)
    # The checkpoint's own tokenizer files unless the user changed data.tokenizer: the config may name
    # a path that no longer exists, and the saved copy is the exact tokenizer the run trained with.
    user_tokenizer = config.data.tokenizer != eval_config(resolved).data.tokenizer
    own_files = resolved.is_local and (Path(resolved.model_path) / "tokenizer.json").is_file()
    try:
        tokenizer = load_tokenizer(resolved.model_path if own_files and not user_tokenizer else config.data.tokenizer)
    except RuntimeError as err:  # an unreachable hub tokenizer: a usage problem, not a crash
        raise EvalError(str(err)) from None
    vocab = model.get_output_embeddings().weight.shape[0]
    if past := ids_past(tokenizer, vocab):  # an id past the embedding would be a crash, or a device assert on CUDA
        raise EvalError(f"data.tokenizer: {config.data.tokenizer or 'Qwen3'}'s {past}, past the model's {vocab} "
                        f"embedding rows: evaluate with the tokenizer the model was trained with")
    return resolved, config, model, tokenizer, torch_device


def _trained_source(resolved: ResolvedModel) -> str | None:
    """The source fingerprint the checkpoint's data-loader state records (None: a hub model, or older code)."""
    state = resolved.checkpoint_dir / "state" / "data_rank0.pt" if resolved.checkpoint_dir else None
    return torch.load(state, weights_only=True).get("source_fingerprint") if state and state.is_file() else None


def evaluate_checkpoint(target: str, *, samples: int = 3, max_new_tokens: int = 32, temperature: float = 0.0,
                        seed: int = 0, **load: Any) -> EvalReport:
    """Evaluate ``target`` (see ``resolve_checkpoint``) on its run's validation set or an overridden one; ``load``:
    ``load_for_eval``'s keywords (``config_files``, ``overrides``, ``trust_remote_code``, ``device``)."""
    from llm.data import build_val_windows, eos_id
    from llm.data.sources import data_source, source_fingerprint
    from llm.metrics import layer_report
    from llm.train.evaluate import evaluate

    resolved, config, model, tokenizer, torch_device = load_for_eval(target, **load)
    windows = build_val_windows(config.data, tokenizer)
    notes = [] if (was := _trained_source(resolved)) in (None, now := source_fingerprint(data_source(config.data))) \
        else [f"data.source {config.data.source} holds other files than the run trained on (source fingerprint {was} "
              f"in its checkpoint, {now} now): this is not the run's validation set"]

    autocast = config.train.autocast_dtype(torch_device.type)  # the trainer's precision
    with torch.autocast(torch_device.type, dtype=autocast) if autocast else contextlib.nullcontext():
        document_eos = eos_id(tokenizer) if config.data.document_masking else None  # as the run trained
        metrics = evaluate(model, windows, config.train.micro_batch_size, document_eos)
    bpb, n_bytes = bits_per_byte(metrics["val_loss"], windows, token_byte_lengths(tokenizer, int(windows.max()) + 1))

    layers: list[dict[str, float]] = []
    if _has_ffn_diagnostics(model):
        # the trainer's fixed isotropy batch and sampling seed: the logged rows of that step
        layers = layer_report(model, windows[: config.train.micro_batch_size, :-1].to(torch_device),
                              config.train.isotropy_samples, seed=config.seeded_data().seed, document_eos=document_eos)
    else:
        notes.append("no per-layer report: the model's FFNs have no diagnostics() (not an isollm model)")
    model_type = str(getattr(model.config, "model_type", "unknown"))
    generated = generate_samples(model, tokenizer, list(DEFAULT_PROMPTS[:samples]), max_new_tokens,
                                 temperature, seed, eos_id(tokenizer)) if samples > 0 else []
    return EvalReport(
        target=target, model_path=resolved.model_path, step=resolved.step, model_type=model_type,
        variant=model.config.to_model_config().variant_name if model_type == "isollm" else None,
        data_source=config.data.source, val_windows=windows.shape[0], val_tokens=int(metrics["val_tokens"]),
        val_bytes=n_bytes, val_loss=metrics["val_loss"], val_ppl=metrics["val_ppl"], bits_per_byte=bpb,
        layers=layers, samples=generated, notes=notes)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)  # NaN formats as nan


def format_report(report: EvalReport) -> str:
    """Human-readable report: summary lines, the per-layer table, samples."""
    lines = [f"model       {report.model_path}" + (f" (step {report.step})" if report.step is not None else ""),
             f"variant     {report.variant or report.model_type}",
             f"data        {report.data_source}: {report.val_windows} windows, "
             f"{report.val_tokens:,} target tokens, {report.val_bytes:,} bytes",
             f"val loss    {report.val_loss:.6f} nats/token", f"perplexity  {report.val_ppl:.4f}",
             f"bits/byte   {report.bits_per_byte:.6f}"]
    if report.layers:
        keys = [k for k in LAYER_COLUMNS if any(k in row for row in report.layers)]
        table = [keys, *([_cell(row.get(k)) for k in keys] for row in report.layers)]
        widths = [max(len(r[i]) for r in table) for i in range(len(keys))]
        lines += ["", "per-layer report (layer 0 = embedding output; hidden-state isotropy, FFN alpha/beta)"]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    if report.samples:
        lines += ["", "samples", *(f"  {s['prompt']!r} -> {s['completion']!r}" for s in report.samples)]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines) + "\n"
