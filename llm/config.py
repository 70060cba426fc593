"""Run configuration: flat, documented dataclasses, loaded from YAML presets plus dotted overrides.

``load_config(["configs/sizes/tiny.yaml", "configs/demo.yaml"], ["model.ffn=isogmlp", "train.lr=1e-3"])``
merges the files left to right (a file may list ``defaults:``, paths relative to itself, merged
before it), applies the overrides with OmegaConf, converts to ``RunConfig`` (unknown keys and
mistyped values fail there) and validates values. Every failure is a ``ConfigError`` whose text
is one line naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llm.model.config import ConfigError, ModelConfig, check_choice, upgrade_saved

__all__ = ["FORMAT_NAMES", "PLACEHOLDER_BUDGET", "ConfigError", "DataConfig", "ModelConfig", "RunConfig",
           "TrainConfig", "load_config", "read_saved", "read_yaml", "save_config"]


# An override giving ``TrainConfig.validate`` the training budget it requires where nothing is trained (a size
# preset is only a ``model:`` section; a hub model has no run config); files or overrides that set one win.
PLACEHOLDER_BUDGET = "train.max_steps=1"
# Seeds reach numpy's legacy seeding (``accelerate.utils.set_seed``) and torch generators, which take [0, 2**32).
SEED_RANGE = range(2**32)
# ``data.format`` -> how its documents are read (llm.data.sources), for local files whatever their suffix
# (WikiText-2's ``wiki.test.raw`` is text). Here, so that the config validates it without importing the data
# layer.
FORMAT_NAMES = {"text": "text", "parquet": "parquet", "jsonl": "json", "json": "json"}


def _check_at_least(section: object, low: int, *names: str) -> None:
    """A ``ConfigError`` naming the first of the fields ``names`` below ``low`` (1: a positive integer, or 0)."""
    for name in names:
        if (value := getattr(section, name)) < low:
            raise ConfigError(name, f"expected {'a positive integer' if low else '>= 0'}, got {value}")


@dataclass
class DataConfig:
    source: str = "HuggingFaceFW/fineweb"
    """A hub dataset id, or a local parquet/jsonl/json/txt file, directory or glob."""
    format: str | None = None
    """Format of local files: text | parquet | jsonl | json; None: from each file's suffix (a ``.raw``
    file, as WikiText-2 ships, needs ``text``)."""
    name: str | None = "sample-10BT"
    """Hub config name (FineWeb: sample-10BT, CC-MAIN-2024-10, ...); ignored for local files."""
    split: str = "train"
    text_column: str = "text"
    id_column: str | None = "id"
    """Column hashed for the validation split; documents without it are hashed by their text."""
    tokenizer: str | None = None
    """Hub id, tokenizer.json or directory; None: the Qwen3 files of the `offline` extra, else the hub."""
    seq_len: int = 2048
    """Tokens a model sees per sequence; windows hold seq_len + 1 tokens (inputs and shifted targets)."""
    document_masking: bool = True
    """Score each document packed into a window as if alone, in training and validation alike: positions restart
    after every EOS (``llm.data.packing``), and attention, iso_tanh's state and IsoGMLP's causal gates restart
    with them. Off, a token sees the documents packed before it in its window. On by default because the FFN
    variants that mix positions (IsoGMLP's gates) would otherwise be compared partly on cross-document mixing.
    Runs saved before this option existed read back as false (they trained without it)."""
    seed: int | str = 0
    """Data order seed. An integer: shared by every run that sets it, so a comparison's runs read one data order and
    the run's ``seed`` sets only the initialisation (its claims hold for that one order). ``run``: the run's ``seed``,
    so that seeds replicate the whole run (initialisation and data order); the two runs of a pair (one seed, two
    variants) still read the same order."""
    shuffle_block: int = 256
    """Windows permuted together by the deterministic window-level shuffle; 1 disables it."""
    shuffle_shards: bool = True
    """Shuffle the order of pieces (parquet row groups, jsonl/txt files) per epoch with ``seed`` before the
    epoch is split among ranks x workers (exactly resumable)."""
    val_bucket: int = 1000
    """One document in ``val_bucket`` (by hash) is held out for validation and never trained on."""
    val_tokens: int = 1_048_576
    """Size of the fixed validation set, materialised once and shared by every variant and rank."""
    num_workers: int = 0
    """DataLoader workers per process; each reads a disjoint subset of the stream."""
    tokenize_batch: int = 64
    """Source rows read per batched tokenizer call (validation rows dropped first); also the re-read
    granularity of a resume."""
    max_doc_chars: int = 1_000_000
    """A longer document is tokenized in parts of at most ``max_doc_chars`` characters (about 250k Qwen3
    tokens; FineWeb's documents average ~3k characters), cut before a word, so one huge document (a text file
    without blank lines is one) costs a tokenizer call what a batch does; every part is kept, and the tokens
    are the whole document's. Training and validation documents alike."""
    prepared: str | None = None
    """Directory of pre-tokenized uint32 tokens written by `isollm-data prepare`; overrides streaming, and a run
    reading it resumes with any number of processes and workers."""
    cache_dir: str = "data_cache"
    """Where the materialised validation set (keyed by source, tokenizer and seq_len) and what the parquet
    footers say (keyed by the files, each checked by size and mtime or hub blob id) are cached; shared by the
    ranks of a job (the main process writes first), later jobs and ``isollm-data plan`` / ``prepare``."""
    read_retries: int = 5
    """Retries of a failed streaming read (connection drop, timeout, unreadable shard) before the run stops
    with a ``DataError`` naming the shard; each retry re-opens the shard at the last good position. Counted
    per failure: a successful read resets it, so transient drops over a long run never add up."""
    retry_backoff_s: float = 1.0
    """Sleep before retry k (1-based) is ``retry_backoff_s * 2**(k - 1)``: 1+2+4+8+16 s over the defaults."""

    def validate(self) -> DataConfig:
        if isinstance(self.seed, str) and self.seed != "run":
            raise ConfigError("seed", f"expected an integer or run (the run's seed), got {self.seed!r}")
        if self.format is not None:
            check_choice("format", self.format, FORMAT_NAMES)
        _check_at_least(self, 1, "seq_len", "shuffle_block", "val_bucket", "val_tokens", "tokenize_batch",
                        "max_doc_chars")
        _check_at_least(self, 0, "num_workers", "read_retries", "retry_backoff_s")
        return self


@dataclass
class TrainConfig:
    lr: float = 3e-4
    """Peak learning rate (the papers: 3e-4)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 100
    max_steps: int = 0
    """Optimizer steps; 0 derives them from ``max_tokens``."""
    max_tokens: int = 0
    """Token budget of the run (used when max_steps is 0); the same for every run of a comparison."""
    global_batch_tokens: int = 524_288
    """Tokens per optimizer step over all processes; gradient accumulation makes up the difference."""
    micro_batch_size: int = 8
    """Sequences per forward pass per process."""
    optimizer: str = "adamw"
    """adamw | muon: muon orthogonalises the updates of the hidden matrices (attention and FFN projections, each
    fused part apart) with torch's Muon at AdamW's lr and weight decay (the RMS-matching rule); every other
    parameter stays on AdamW (llm/train/optim.py, docs/training.md). Part of the run's identity: a checkpoint
    resumes with the optimizer it was trained with only."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices; norms, biases, gains and embeddings get none."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the pre-clip norm is logged)."""
    precision: str = "auto"
    """auto (bf16 autocast on GPU, fp32 elsewhere) | fp32 | bf16 (bf16 autocast on any device)."""
    tf32: bool = True
    """On CUDA, the training step's fp32 matmuls run on TF32 tensor cores (fp32 accumulation, 10-bit operands).
    Under bf16 autocast those are only iso_tanh's running sums, whose bf16-born operands TF32 holds exactly (1.13x
    on the swiglu+iso_tanh step); with ``precision: fp32``, every matmul, as nanoGPT trains. Evaluation and
    the metrics always run full fp32; false keeps the step there too."""
    compile: bool = False
    """torch.compile each decoder layer (in place, one compiled graph shared by all layers)."""
    activation_checkpointing: int = 0
    """Recompute every n-th decoder layer in the backward pass instead of keeping its activations (non-reentrant
    ``torch.utils.checkpoint`` through transformers' ``activation_checkpointing_enable``): 0 off, 1 every layer,
    n layers 0, n, 2n, ... Same loss and gradients; less activation memory (``isollm-params --plan``) for time."""
    log_every: int = 10
    eval_every: int = 200
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    """Keep the newest K complete checkpoints."""
    grad_norm_window: int = 100
    """Rolling window (steps) of the gradient-norm variance and coefficient of variation."""
    max_bad_steps: int = 5
    """Stop after this many consecutive non-finite losses or gradients (each one is skipped)."""
    collective_timeout_s: float = 900.0
    """How long a rank waits in a collective (all-reduce, barrier) before the run fails with one line: a peer that
    died or is stuck ends the whole run in bounded time. Long enough for rank 0 to build the validation set or
    write a checkpoint while the others wait; raise it if that takes longer on your storage."""
    stop_grace_s: float = 300.0
    """After SIGTERM/SIGINT a run finishes its step, checkpoints and exits 0; a rank still running this long after
    the signal (blocked in a collective whose peer is gone) exits 1 with one line instead of hanging."""
    isotropy_samples: int = 2048
    """Token vectors per layer used for the isotropy metrics at each eval."""

    def validate(self) -> TrainConfig:
        # NaN and inf would fail plain comparisons too (a NaN grad_clip silently disables clipping), but are
        # named plainly; 0 is a valid weight_decay or grad_clip (off), never a valid lr or eps
        for name, zero_ok in (("lr", False), ("eps", False), ("weight_decay", True), ("grad_clip", True),
                              ("collective_timeout_s", False), ("stop_grace_s", False)):
            value = getattr(self, name)
            if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
                raise ConfigError(name, f"expected a finite {'number >= 0' if zero_ok else 'positive number'}, "
                                        f"got {value}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio", f"expected a value in [0, 1], got {self.min_lr_ratio}")
        _check_at_least(self, 0, "warmup_steps", "max_steps", "max_tokens", "activation_checkpointing")
        if self.max_steps == 0 and self.max_tokens == 0:
            raise ConfigError("max_steps", "set train.max_steps or train.max_tokens (both are 0)")
        _check_at_least(self, 1, "global_batch_tokens", "micro_batch_size", "log_every", "eval_every",
                        "checkpoint_every", "keep_checkpoints", "grad_norm_window", "max_bad_steps", "isotropy_samples")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(name, f"expected a value in [0, 1), got {getattr(self, name)}")
        check_choice("precision", self.precision, ("auto", "fp32", "bf16"))
        check_choice("optimizer", self.optimizer, ("adamw", "muon"))  # llm/train/optim.py OPTIMIZERS
        return self

    def autocast_dtype(self, device_type: str) -> torch.dtype | None:
        """The dtype ``precision`` autocasts matmuls to on a ``device_type`` device ("cuda", "cpu", ...); None: plain
        fp32. ``auto`` keeps CPUs in fp32 (bf16 is slower there without bf16 matrix units); ``bf16`` on a CPU runs
        the GPU's numerics, slowly."""
        if self.precision == "bf16" or (self.precision == "auto" and device_type == "cuda"):
            return torch.bfloat16
        return None


@dataclass
class RunConfig:
    name: str = "run"
    """Run directory name under ``out_dir``."""
    out_dir: str = "runs"
    seed: int = 0
    """Model-initialisation and dropout seed; the data order's too with ``data.seed: run``."""
    resume: bool | str = False
    """true: continue from the newest usable checkpoint in the run directory (none there yet: start at step
    0; only unusable ones: refuse, naming them, rather than overwrite them); restart: the same, but start at
    step 0 over unusable checkpoints."""
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Accelerate trackers besides metrics.jsonl: tensorboard, wandb (the `track` extra), or none."""
    wandb_project: str = "isollm"
    planned_by: str = ""
    """The plan.csv whose sweep added this run's seed (``eval.py compare --plan`` writes it into each planned
    config); empty for any other run. Planning again from such a seed is a second look, which ``--plan`` names."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    def seeded_data(self) -> DataConfig:
        """The ``data`` section the data layer reads: ``data.seed: run`` resolved to this run's ``seed`` (a pure
        function of the saved config, so a resumed run keeps its data order)."""
        return replace(self.data, seed=self.seed) if self.data.seed == "run" else self.data

    def validate(self) -> RunConfig:
        if self.name in ("", ".", "..") or "/" in self.name or "\\" in self.name:
            raise ConfigError("name", f"expected a plain directory name (no '/', not '.' or '..'), got {self.name!r}")
        if self.resume not in (True, False, "restart"):
            raise ConfigError("resume", f"expected true, false or restart, got {self.resume!r}")
        for tracker in self.trackers:
            check_choice("trackers", tracker, ("tensorboard", "wandb"))
        # every integer field named like a seed, in every section, not a list of them: a new one is checked too
        for prefix, section in (("", self), ("model.", self.model), ("data.", self.data), ("train.", self.train)):
            for name in (f.name for f in fields(section) if "seed" in f.name):
                if type(value := getattr(section, name)) is int and value not in SEED_RANGE:
                    raise ConfigError(f"{prefix}{name}", f"expected an integer in [0, 2**32), got {value}")
        for section in ("model", "data", "train"):
            try:
                getattr(self, section).validate()
            except ConfigError as err:
                raise err.prefixed(section) from None
        if self.data.seq_len > self.model.max_position_embeddings:
            raise ConfigError("data.seq_len", f"{self.data.seq_len} exceeds model.max_position_embeddings "
                                              f"({self.model.max_position_embeddings}), the longest sequence the "
                                              f"exported model declares; raise it or shorten data.seq_len")
        return self


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    """Read one YAML file, merging the files it lists under ``defaults:`` (relative to it) first."""
    path = path.resolve()
    if path in seen:
        raise ConfigError("defaults", f"{path} includes itself")
    if not path.is_file():
        raise ConfigError("config", f"no such config file: {path}")
    try:
        node = OmegaConf.load(path)
    except Exception as err:  # yaml errors come in several types; all mean "not valid YAML"
        raise ConfigError("config", f"{path} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(node, DictConfig):
        raise ConfigError("config", f"{path} must hold a mapping at the top level")
    merged = OmegaConf.create()
    for include in node.pop("defaults", []) or []:
        merged = OmegaConf.merge(merged, read_yaml(path.parent / str(include), (*seen, path)))
    return OmegaConf.merge(merged, node)


def _read_back_saved(node: DictConfig) -> DictConfig:
    """A config a run saved, with its ``model`` section as today's ``ModelConfig`` reads a saved one
    (``llm.model.config.upgrade_saved``: a run from before ``ffn_init`` existed trained with the papers' raw
    scales and holds the option defaults of its time), a ``data`` section from before document masking read
    as unmasked and a ``train`` section from before ``tf32`` as without it; the schema then fills fields added
    since."""
    if isinstance(node.get("model"), DictConfig):
        node.model = OmegaConf.create(upgrade_saved(OmegaConf.to_container(node.model)))
    if isinstance(node.get("data"), DictConfig) and "document_masking" not in node.data:
        node.data.document_masking = False
    if isinstance(node.get("train"), DictConfig) and "tf32" not in node.train:  # before it, the step ran full fp32
        node.train.tf32 = False
    return node


def _container_mismatch(schema: DictConfig, node: DictConfig, prefix: str = "") -> str | None:
    """The dotted key where ``node`` gives a list and ``schema`` holds a mapping, or the reverse (OmegaConf's
    "incompatible container types" names none). It reads OmegaConf's nodes (``_get_node``, ``_is_none``: private, as
    a field whose value is None has no public node); tests/train/test_cli.py fails the day they change."""
    for key in (key for key in node if key in schema):  # an unknown key is OmegaConf's to name
        have, given = schema._get_node(key), node._get_node(key)
        if not isinstance(have, DictConfig | ListConfig) or not isinstance(given, DictConfig | ListConfig):
            continue
        if type(have) is not type(given):
            return f"{prefix}{key}"
        if isinstance(given, DictConfig) and not have._is_none() and not given._is_none() and (
                found := _container_mismatch(have, given, f"{prefix}{key}.")):
            return found
    return None


def _merge(merged: DictConfig, node: DictConfig, value: str | None = None) -> DictConfig:
    """``OmegaConf.merge``; a list where the merged config holds a mapping (or the reverse) is one ``ConfigError``
    naming its key (and the override's ``value``)."""
    try:
        return OmegaConf.merge(merged, node)
    except TypeError:
        message = "a list where a mapping is expected, or the reverse"
        raise ConfigError(_container_mismatch(merged, node) or "config",
                          f"{value}: {message}" if value else message) from None


def _resolve(layers: list[DictConfig | dict[str, Any]], overrides: list[str], saved_run: bool) -> RunConfig:
    """Merge ``layers`` (the first one saved by a run when ``saved_run``) and overrides over the schema."""
    try:
        nodes = [OmegaConf.create(layer) for layer in layers]
        if saved_run and nodes:
            nodes[0] = _read_back_saved(nodes[0])
        merged = OmegaConf.structured(RunConfig)
        for node in nodes:
            merged = _merge(merged, node)
        for override in overrides:
            if "=" not in override:
                raise ConfigError(override, "expected key.sub=value")
            key, value = override.split("=", 1)
            try:
                node = OmegaConf.from_dotlist([override])
            except yaml.YAMLError:  # OmegaConf parses the value as YAML and lets the parser's error through
                raise ConfigError(key, f"{value!r} is not a YAML value") from None
            merged = _merge(merged, node, repr(value))
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:  # in one line, naming the key
        message, key = str(err).splitlines()[0], getattr(err, "full_key", None) or "config"
        if "not in struct" in message or ("Key '" in message and "not" in message):
            message = "unknown key"
        if key == "resume":  # resume=1 is an int, refused by the schema's type before ``validate`` names the choices
            message = f"expected true, false or restart, got {message.split(' of type')[0].removeprefix('Value ')}"
        raise ConfigError(key, message) from None
    assert isinstance(config, RunConfig)
    return config.validate()


def load_config(files: list[str] | str | None = None, overrides: list[str] | None = None, *,
                saved_run: bool = False) -> RunConfig:
    """YAML files (merged left to right) + ``key.sub=value`` overrides -> a validated ``RunConfig``.

    ``saved_run``: the first file is a ``config.yaml`` that a run wrote, read back as ``read_saved`` reads
    a saved config; one without a section that every run saves is damaged, and refused rather than filled with
    today's defaults."""
    files = [files] if isinstance(files, str) else list(files or [])
    layers = [read_yaml(Path(f)) for f in files]
    if saved_run and (missing := [section for section in ("model", "data", "train")
                                  if not isinstance(layers[0].get(section), DictConfig)]):
        raise ConfigError("config", f"{files[0]} lacks the {' and '.join(missing)} section(s) every run saves (the "
                                    f"file is damaged): restore it, or pass the run's config files with --config")
    return _resolve(layers, list(overrides or []), saved_run)


def read_saved(values: dict[str, Any]) -> RunConfig:
    """A config a run saved (all of it, or sections such as a metrics.jsonl meta row's ``model``, ``data`` and
    ``train``) as today's code reads it back (``_read_back_saved``), validated; a field today's schema does not know
    or cannot hold is a ``ConfigError`` naming it."""
    return _resolve([values], [], saved_run=True)


def save_config(config: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (loadable again with ``load_config``)."""
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(config)))
