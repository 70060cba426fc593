"""Building a run for the loop (``setup_run``): the Accelerator and its process group, the run directory's lock,
tokenizer, model, optimizer, data, resume, trackers and metrics.jsonl, each registered for release as soon as it
is acquired; and ``Run``, what the loop advances, with its checkpoint and evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, set_seed
from tokenizers import Tokenizer
from torch import nn
from transformers.utils import flatten_dict

from llm.config import RunConfig, save_config
from llm.data import TrainLoader, build_train_loader, build_val_windows, eos_id, load_tokenizer
from llm.data.cache_io import write_atomically
from llm.data.tokenizer import ids_past
from llm.errors import one_line
from llm.metrics.flops import flops_per_token, peak_flops
from llm.metrics.gradnorm import GradNormTracker, GroupGradNorms, grad_norm_groups
from llm.metrics.layers import layer_report
from llm.model import IsoLLMConfig, IsoLLMForCausalLM, param_counts
from llm.model.acceleration import acceleration
from llm.model.attention import ATTN_SCORING_REGISTRY
from llm.model.config import ConfigError, ModelConfig
from llm.train.checkpoint import resume_checkpoint, save_checkpoint
from llm.train.checkpoint_files import POINTER, checkpoint_names
from llm.train.distributed import disagreement, gather_messages, is_distributed, is_main_process, rank_and_world_size
from llm.train.engine import engine_in_use, engine_mismatch, engine_requested, set_deepspeed_micro_batch
from llm.train.evaluate import evaluate
from llm.train.lock import RunLock, RunLockedError
from llm.train.logging import MetricsLog, ProgressBar, drop_tracker, main_print, main_warning, truncate_metrics
from llm.train.optim import build_optimizer, check_engine, multiplier_of, schedule_warnings
from llm.train.step import TrainingError, gradient_accumulation_steps, tf32_matmuls

__all__ = ["Run", "TrainerState", "build_data", "build_model", "resolve_max_steps", "setup_run", "train_attention"]


@dataclass
class TrainerState:
    """Counters saved in every checkpoint's trainer.json."""

    step: int = 0
    tokens: int = 0
    skipped_steps: int = 0
    consecutive_bad_steps: int = 0


def resolve_max_steps(config: RunConfig) -> int:
    """``train.max_steps``, or enough steps to consume ``train.max_tokens`` (rounded up)."""
    return config.train.max_steps or math.ceil(config.train.max_tokens / config.train.global_batch_tokens)


def build_model(model_cfg: ModelConfig) -> IsoLLMForCausalLM:
    """The decoder of ``model_cfg``, initialised from the current torch RNG state."""
    return IsoLLMForCausalLM(IsoLLMConfig.from_model_config(model_cfg))


def train_attention(config: RunConfig, device: torch.device) -> str | None:
    """The attention implementation training runs, named for what runs: packed documents where the device's policy
    makes them a block-sparse mask (``Acceleration.block_mask``: on CUDA), which no SDPA kernel takes, make softmax
    run FlexAttention, as ``flex_attention``; None keeps the model's default. Eval and the hub keep the
    implementation their user asks for."""
    implementations = ATTN_SCORING_REGISTRY[config.model.attn_scoring].IMPLEMENTATIONS
    if config.data.document_masking and acceleration(device).block_mask and "flex_attention" in implementations:
        return "flex_attention"
    return None


def _mixed_precision(config: RunConfig, device_type: str) -> str:
    """Accelerate's mixed_precision for ``TrainConfig.autocast_dtype``."""
    return "no" if config.train.autocast_dtype(device_type) is None else "bf16"


def _flat_hparams(config: RunConfig) -> dict[str, Any]:
    """Tracker-friendly config: dotted keys, scalars only (TensorBoard's hparams reject lists/None)."""
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value)
            for key, value in flatten_dict(asdict(config)).items()}


def _print_params(model_cfg: ModelConfig) -> tuple[int, int]:
    total, non_embedding = param_counts(model_cfg)
    message = f"params: {total:,} total, {non_embedding:,} non-embedding ({model_cfg.variant_name})"
    if model_cfg.ffn != "swiglu":
        ref_total, ref_non_embedding = param_counts(model_cfg.with_variant(ffn="swiglu"))
        message += f"; swiglu at this size: {ref_total:,} total, {ref_non_embedding:,} non-embedding"
    main_print(message)
    return total, non_embedding


def _lock_run_dir(run_dir: Path) -> RunLock | None:
    """The main process takes the run directory's lock. Another live run holding it is the same one-line
    ``ConfigError`` on every rank, naming the holder (exit 2: choose another name or wait); a lock file that
    cannot be written (a full disk) is the same ``TrainingError`` on every rank (exit 1, as other failed writes).
    Returns the lock on the main process, None elsewhere."""
    lock, error = None, None
    if is_main_process():
        try:
            lock = RunLock.acquire(run_dir)
        except RunLockedError as err:
            error = ("held", str(err))
        except OSError as err:
            error = ("write", f"could not create the lock of {run_dir} ({one_line(err)})")
    if errors := gather_messages(error):
        kind, message = errors[0]
        raise ConfigError("name", message) if kind == "held" else TrainingError(message)
    return lock


def _resume(config: RunConfig, ckpt_dir: Path, accelerator: Accelerator, loader: Any,
            tokenizer: Tokenizer) -> tuple[Path | None, dict | None]:
    """Load the newest usable checkpoint (``resume_checkpoint``); return it and its trainer.json, or
    ``(None, None)`` to start at step 0. ``resume=true`` refuses to start over checkpoints that all failed to
    verify or load (history would be overwritten); ``resume=restart`` starts from step 0 then."""
    resume_from, saved = (resume_checkpoint(ckpt_dir, accelerator=accelerator, loader=loader, config=config,
                                            tokenizer=tokenizer) if config.resume else (None, None))
    if saved is not None:
        main_print(f"resumed from {resume_from} at step {saved['state']['step']}")
    elif config.resume is True and (found := checkpoint_names(ckpt_dir)):
        raise ConfigError("resume", f"no usable checkpoint in {ckpt_dir} (found {', '.join(found)}"
                                    f"; each skipped, see the warnings): not starting over them; repair or move "
                                    f"them, or pass resume=restart to start from step 0")
    elif config.resume:
        main_print(f"resume={config.resume} but {ckpt_dir} holds no usable checkpoint: starting from step 0")
    return resume_from, saved


def _prepare_run_dir(config: RunConfig, step: int) -> None:
    """config.yaml, and metrics.jsonl cut back to ``step``, each written whole or not at all (``write_atomically``);
    a failed write (a full disk) is one ``TrainingError`` on every rank."""
    error = None
    if is_main_process():
        try:
            write_atomically(config.run_dir / "config.yaml", lambda tmp: save_config(config, tmp))
            truncate_metrics(config.run_dir / "metrics.jsonl", step)
        except OSError as err:
            error = (f"could not write to {config.run_dir} ({one_line(err)}); its config.yaml and metrics.jsonl are "
                     f"each as they were or wholly rewritten, none cut short")
    if errors := gather_messages(error):
        raise TrainingError(errors[0])


def build_data(config: RunConfig, tokenizer: Tokenizer, accelerator: Accelerator, rank: int, world_size: int
               ) -> tuple[TrainLoader, torch.Tensor]:
    """This rank's training loader and the validation windows. The main process builds them first, listing the
    source's files (every parquet footer) and materialising the validation set into ``data.cache_dir``; the
    other ranks then read both from there instead of each reading every footer and the validation documents."""
    with accelerator.main_process_first():
        data = config.seeded_data()
        loader = build_train_loader(data, tokenizer, config.train.micro_batch_size, rank, world_size)
        return loader, build_val_windows(data, tokenizer)


def _leave_process_group(accelerator: Accelerator, *, failed: bool) -> None:
    """Destroy the process group (gloo otherwise aborts at interpreter exit in about 1 run in 4, seen on CPU),
    after a barrier when the run ended normally. Not after a failure: a rank that failed alone would meet the
    other ranks' next collective with its barrier and hang."""
    if not is_distributed():
        return
    if not failed:
        accelerator.wait_for_everyone()
    dist.destroy_process_group()


def _finish_trackers(accelerator: Accelerator) -> None:
    """``Accelerator.end_training`` without its destroy of the process group: the trackers write into the run
    directory, so they finish before the lock is released, and the process group is left last. A tracker that
    cannot finish is dropped with a warning (``drop_tracker``)."""
    for tracker in list(accelerator.trackers):
        try:
            tracker.finish()
        except Exception as err:  # TensorBoard raises OSError, W&B its own types
            drop_tracker(accelerator, tracker, f"could not finish ({one_line(err)})")


@dataclass
class Run:
    """What ``setup_run`` built for the loop: the prepared model and optimizer, the data, the log, and the
    counters the loop advances (``state``, the grad-norm trackers, ``last_checkpoint``)."""

    config: RunConfig
    accelerator: Accelerator
    model: nn.Module
    """As prepared by Accelerate, its decoder layers compiled when ``train.compile``: what the steps and
    evaluations run, checkpoints save and the isotropy report reads."""
    optimizer: torch.optim.Optimizer
    tokenizer: Tokenizer
    loader: TrainLoader
    batches: Iterator[torch.Tensor]
    val_windows: torch.Tensor
    val_batch: torch.Tensor
    """The fixed isotropy batch: the first ``micro_batch_size`` validation windows."""
    document_eos: int | None
    """The EOS id that separates masked documents (``data.document_masking``), or None."""
    log: MetricsLog
    state: TrainerState
    grad_norms: GradNormTracker
    group_grad_norms: GroupGradNorms
    engine: str
    accum: int
    max_steps: int
    flops_per_token: float
    peak_flops: float
    """Of all ranks together."""
    last_checkpoint: Path | None

    def stop_on_log_failure(self) -> None:
        """Raise the same ``TrainingError`` on every rank when rank 0 could not write metrics.jsonl. A collective:
        every rank calls it at the same point."""
        if errors := gather_messages(self.log.failure):
            raise TrainingError(f"{errors[0]}; the rows and checkpoints written before it are intact (last "
                                f"checkpoint: {self.last_checkpoint or 'none'})")

    def checkpoint(self) -> Path:
        """Save the current step, once every rank knows that its metrics rows were written: a checkpoint past
        a lost row would make a resumed run skip that row."""
        self.stop_on_log_failure()
        trainer_state = {"state": asdict(self.state), "grad_norm_tracker": self.grad_norms.state_dict(),
                         "group_grad_norms": self.group_grad_norms.state_dict(), "engine": self.engine}
        self.last_checkpoint = save_checkpoint(
            self.config.run_dir / "checkpoints", self.state.step, accelerator=self.accelerator, model=self.model,
            tokenizer=self.tokenizer, config=self.config, trainer_state=trainer_state, loader=self.loader,
            keep=self.config.train.keep_checkpoints)
        return self.last_checkpoint

    def evaluate_and_log(self, progress: ProgressBar) -> None:
        train = self.config.train
        metrics = evaluate(self.model, self.val_windows, train.micro_batch_size, self.document_eos)
        layers = layer_report(self.accelerator.unwrap_model(self.model), self.val_batch, train.isotropy_samples,
                              seed=self.config.seeded_data().seed, document_eos=self.document_eos)
        self.log.log("eval", self.state.step, self.state.tokens, val_loss=metrics["val_loss"],
                     val_ppl=metrics["val_ppl"], layers=layers)
        progress.write(f"step {self.state.step}: val_loss {metrics['val_loss']:.4f}")


def compile_decoder_layers(model: IsoLLMForCausalLM, **compile_kwargs: Any) -> None:
    """``train.compile``: compile each decoder layer in place, as torchtitan compiles per block. The layers share
    one compiled graph (same code, parameters passed as inputs), so compile time does not grow with depth, and in
    place the wrappers' hooks (DDP, FSDP2, ZeRO-3) stay on the call path. The embedding, the document masks (built
    once per forward) and the fused loss (a custom op) run around them. Not ``fullgraph``: a wrapper's hooks traced
    with a layer may break its graph; the bare layer compiles whole (tests/model/test_compile.py).
    ``compile_kwargs`` go to ``torch.compile``.

    Past dynamo's recompile limit (8 graphs per code object) a layer would run eagerly behind a log warning, and
    the run would log eager speed under a config that says compiled; it is made an error instead. The option is
    ``torch._dynamo.config``'s (no public equivalent): tests/model/test_compile.py fails the day it goes."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for layer in model.model.layers:
        layer.compile(**compile_kwargs)


def setup_run(config: RunConfig, teardown: ExitStack) -> Run:
    """Build the run. Each resource is registered on ``teardown`` as soon as it is acquired (the process group,
    the run directory's lock, the trackers, metrics.jsonl), so a failure anywhere releases what exists."""
    run_dir, ckpt_dir = config.run_dir, config.run_dir / "checkpoints"
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    accelerator = Accelerator(
        cpu=device_type == "cpu", mixed_precision=_mixed_precision(config, device_type),
        log_with=config.trackers or None,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "tensorboard")),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=config.train.collective_timeout_s))])
    teardown.push(lambda exc_type, *_: _leave_process_group(accelerator, failed=exc_type is not None))
    rank, world_size = rank_and_world_size()
    accum = gradient_accumulation_steps(config, world_size)
    accelerator.gradient_accumulation_steps = accum
    if (lock := _lock_run_dir(run_dir)) is not None:
        teardown.callback(lock.release)
    # Looked at only under the lock: a run of this name ending between an earlier look and the lock would leave
    # checkpoints that this run, starting from step 0, would overwrite.
    if not config.resume and checkpoint_names(ckpt_dir):
        raise ConfigError("resume", f"{run_dir} already holds checkpoints; pass resume=true to continue "
                                    f"that run or choose another name=")
    if (pointer := ckpt_dir / POINTER).exists() and not pointer.is_file():  # no checkpoint could be published
        raise ConfigError("resume", f"{pointer} is not the pointer file the run writes there (a directory?): move "
                                    f"it out of {ckpt_dir}")
    max_steps = resolve_max_steps(config)
    tokenizer = load_tokenizer(config.data.tokenizer)
    if past := ids_past(tokenizer, config.model.vocab_size):  # a row for every id the data can hold
        raise ConfigError("model.vocab_size", f"{config.model.vocab_size} is too small for tokenizer "
                                              f"{config.data.tokenizer or 'Qwen3'}, whose {past}")

    set_seed(config.seed)
    model = build_model(config.model)
    if implementation := train_attention(config, accelerator.device):
        model.set_attn_implementation(implementation)
    if config.train.activation_checkpointing:  # before prepare: FSDP2's hooks then wrap the checkpointed layers
        model.activation_checkpointing_enable(every_n_layers=config.train.activation_checkpointing)
    optimizer = build_optimizer(model, config)
    loader, val_windows = build_data(config, tokenizer, accelerator, rank, world_size)
    set_deepspeed_micro_batch(accelerator, config.train.micro_batch_size)
    model, optimizer = accelerator.prepare(model, optimizer)
    if config.train.compile:
        compile_decoder_layers(accelerator.unwrap_model(model))
    engine, asked_engine = engine_in_use(model, accelerator), engine_requested()
    check_engine(config, engine)  # before the first step and before anything is written
    if (mismatch := engine_mismatch(asked_engine, engine)) is not None:
        main_print(mismatch)

    grad_norms = GradNormTracker(config.train.grad_norm_window, config.train.warmup_steps)
    unwrapped = accelerator.unwrap_model(model)
    group_grad_norms = GroupGradNorms(grad_norm_groups(unwrapped, multiplier_of(unwrapped).keys()),
                                      config.train.grad_norm_window, config.train.warmup_steps)
    resume_from, saved = _resume(config, ckpt_dir, accelerator, loader, tokenizer)
    state = TrainerState(**saved["state"]) if saved is not None else TrainerState()
    if saved is not None:
        # load_state restored Accelerate's micro-batch counter as the saved run counted it; with another number of
        # processes the micro-batches per step differ, and the counter would put the gradient sync (and so the
        # optimizer step) off the step boundary, ranks updating on unsynchronised gradients
        accelerator.step = state.step * accum
        if state.step > max_steps:
            field = "train.max_steps" if config.train.max_steps else "train.max_tokens"
            raise ConfigError(field, f"the run ends at step {max_steps}, but {resume_from} is at step {state.step}: "
                                     f"the run is past that end; pass a later end to extend it")
        grad_norms.load_state_dict(saved["grad_norm_tracker"])
        group_grad_norms.load_state_dict(saved.get("group_grad_norms", {}))
        if (saved_warmup := saved["grad_norm_tracker"]["warmup_steps"]) != config.train.warmup_steps:
            main_print(f"train.warmup_steps changed from {saved_warmup} to {config.train.warmup_steps}: the run-level "
                       f"grad-norm statistics (*_var_run, *_cv_run) restart at step {state.step}")
    _prepare_run_dir(config, state.step)
    try:  # on the main process alone: a failure there must not leave the other ranks waiting
        accelerator.init_trackers(config.wandb_project, config=_flat_hparams(config),
                                  init_kwargs={"wandb": {"name": config.name, "dir": str(run_dir)}})
    except Exception as err:  # TensorBoard raises OSError, W&B its own types
        accelerator.trackers.clear()
        main_warning(f"trackers {', '.join(config.trackers)} could not start ({one_line(err)}); training "
                     f"without them (metrics.jsonl keeps every row)")
    teardown.callback(_finish_trackers, accelerator)
    log = MetricsLog(run_dir / "metrics.jsonl", accelerator)
    teardown.callback(log.close)
    for line in schedule_warnings(config, max_steps):
        main_warning(line)
    total, non_embedding = _print_params(config.model)
    fpt = flops_per_token(config.model, config.data.seq_len)
    log.log("meta", state.step, state.tokens, name=config.name, variant=config.model.variant_name, seed=config.seed,
            params_total=total, params_non_embedding=non_embedding, flops_per_token=fpt, world_size=world_size,
            grad_accum=accum, max_steps=max_steps, mixed_precision=accelerator.mixed_precision, engine=engine,
            engine_requested=asked_engine, resumed_from=str(resume_from) if resume_from else None,
            data_fingerprints=loader.source.fingerprints, config=asdict(config))

    device = accelerator.device
    with tf32_matmuls(device, config.train.tf32):  # the peak of the precision the step's fp32 matmuls run at
        peak = peak_flops(device, config.train.autocast_dtype(device.type) or torch.float32) * world_size
    run = Run(
        config=config, accelerator=accelerator, model=model, optimizer=optimizer, tokenizer=tokenizer, loader=loader,
        val_windows=val_windows, val_batch=val_windows[: config.train.micro_batch_size, :-1].to(device), log=log,
        document_eos=eos_id(tokenizer) if config.data.document_masking else None, batches=iter(loader),
        state=state, grad_norms=grad_norms, group_grad_norms=group_grad_norms, engine=engine, accum=accum,
        max_steps=max_steps, flops_per_token=fpt, peak_flops=peak, last_checkpoint=resume_from)
    run.stop_on_log_failure()  # metrics.jsonl opened and its meta row written, or every rank stops here
    if (mismatch := disagreement({"max_steps": max_steps, "start_step": state.step, "micro_batches": accum})):
        raise TrainingError(mismatch)
    return run
