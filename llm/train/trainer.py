"""The training loop: ``train_step`` (one optimizer step), ``evaluate`` (llm.train.evaluate), ``fit``.

HF Accelerate is the engine: DDP, FSDP2 or DeepSpeed come from the launch configuration
(``accelerate launch --config_file launch/...`` or ``torchrun``). The loop calls only
``accelerator.accumulate / backward / clip_grad_norm_`` and the prepared optimizer and scheduler, which
each engine implements, with one exception: DeepSpeed takes its optimizer step inside the backward pass,
so a non-finite step is handled by DeepSpeed itself rather than skipped here, and the backward goes through
llm/train/deepspeed_step.py, which measures the group gradient norms before that step and applies the
focus clipping after it.

Conventions:

- ``step`` counts optimizer steps *attempted*, each consuming ``global_batch_tokens`` of data;
  ``tokens`` counts training tokens consumed. A step whose loss or gradient norm is not finite
  is skipped (gradients zeroed, no optimizer or scheduler step) but still advances ``step``,
  ``tokens`` and the data stream, so a run's token budget and data order do not depend on how
  many steps were skipped, and a resumed run does not retry the bad batch. The lr schedule
  therefore lags by the number of skipped steps (logged as ``skipped_steps``). A train row is
  logged every ``log_every`` steps, at the last step and for every skipped step. The parameters are
  checked after every applied update: an update that made any of them non-finite (a finite loss and
  gradient norm with a huge lr) stops the run at once, before any eval or checkpoint, so no checkpoint
  ever holds non-finite weights.
- The main process holds the run directory's lock (``llm.train.lock``) before reading or writing there; it is
  taken as soon as the process group exists, before the tokenizer, model, data and validation set are built,
  so a second launch on a run in use is refused at once.
- Every resource ``fit`` acquires (process group, lock, trackers, metrics.jsonl, signal handlers, progress
  bar) is released exactly once, in reverse order, whether setup fails, the loop fails or the run ends.
- A metrics row that rank 0 cannot write (a full disk) stops every rank with the same ``TrainingError``: the
  failure rides on the loss's all-reduce of the next step, and every checkpoint (the last step's included)
  first agrees on it, so no checkpoint is written past a lost row and nothing written before is touched.
- On resume, metrics.jsonl rows past the checkpoint's step (logged after it by the interrupted
  run) are dropped before the resumed run logs them again, so each step appears once.
- The model is initialised from ``seed`` (``accelerate.utils.set_seed``: python, numpy, torch,
  cuda); the data order depends only on ``data.seed``, so variants compared under one
  ``data.seed`` see identical batches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
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

from llm.config import RunConfig, flatten, save_config
from llm.data import TrainLoader, build_train_loader, build_val_windows, eos_id, load_tokenizer
from llm.data.packing import model_inputs
from llm.errors import one_line
from llm.metrics.flops import flops_per_token, mfu, peak_flops
from llm.metrics.gradnorm import GradNormTracker, GroupGradNorms, grad_norm_groups
from llm.metrics.layers import layer_report
from llm.model import IsoLLMConfig, IsoLLMForCausalLM, param_counts
from llm.model.config import ConfigError, ModelConfig
from llm.train.checkpoint import resume_checkpoint, save_checkpoint
from llm.train.checkpoint_files import checkpoint_names, has_checkpoints
from llm.train.deepspeed_step import deepspeed_backward, deepspeed_engine
from llm.train.distributed import (
    all_ranks_agree,
    disagreement,
    gather_messages,
    is_distributed,
    is_main_process,
    rank_and_world_size,
)
from llm.train.engine import engine_in_use, engine_mismatch, engine_requested, set_deepspeed_micro_batch
from llm.train.evaluate import evaluate
from llm.train.lock import RunLock, RunLockedError
from llm.train.logging import MetricsLog, ProgressBar, drop_tracker, main_print, peak_memory, truncate_metrics
from llm.train.optim import build_optimizer, build_scheduler, multiplier_of, schedule_warnings
from llm.train.signals import StopRequest

__all__ = [
    "FitResult",
    "StepResult",
    "TrainingError",
    "build_data",
    "build_model",
    "fit",
    "gradient_accumulation_steps",
    "resolve_max_steps",
    "train_step",
]


class TrainingError(RuntimeError):
    """The run stopped on its own account (too many consecutive non-finite steps, non-finite parameters,
    a run-directory file, its lock included, that it could not write)."""


@dataclass
class StepResult:
    loss: float
    """Mean token loss of the step over all micro-batches and ranks (fp32)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    skipped: bool
    """True when loss or norm was not finite and the update was not applied."""
    stop: bool
    """True on every rank when ``stop_requested()`` returned True on any rank."""
    params_finite: bool = True
    """False on every rank when the applied update left a non-finite parameter on any rank."""
    write_failed: bool = False
    """True on every rank when any rank passed ``write_failed`` (it could not write a run-directory file)."""


@dataclass
class TrainerState:
    """Counters saved in every checkpoint's trainer.json."""

    step: int = 0
    tokens: int = 0
    skipped_steps: int = 0
    consecutive_bad_steps: int = 0


@dataclass
class FitResult:
    run_dir: Path
    step: int
    tokens: int
    stopped_by_signal: bool
    """A signal on any rank stopped the run (every rank stops at the same step and says so)."""
    last_checkpoint: Path | None


def gradient_accumulation_steps(config: RunConfig, world_size: int) -> int:
    """``global_batch_tokens / (micro_batch_size * seq_len * world_size)``; must be a whole number >= 1."""
    per_pass = config.train.micro_batch_size * config.data.seq_len * world_size
    accum, remainder = divmod(config.train.global_batch_tokens, per_pass)
    if accum < 1 or remainder:
        raise ConfigError("train.global_batch_tokens", (
            f"{config.train.global_batch_tokens} is not a positive multiple of micro_batch_size * seq_len * "
            f"processes = {config.train.micro_batch_size} * {config.data.seq_len} * {world_size} "
            f"= {per_pass}"))
    return accum


def resolve_max_steps(config: RunConfig) -> int:
    """``train.max_steps``, or enough steps to consume ``train.max_tokens`` (rounded up)."""
    t = config.train
    return t.max_steps or math.ceil(t.max_tokens / t.global_batch_tokens)


def build_model(model_cfg: ModelConfig) -> IsoLLMForCausalLM:
    """The decoder of ``model_cfg``, initialised from the current torch RNG state."""
    return IsoLLMForCausalLM(IsoLLMConfig.from_model_config(model_cfg))


def _all_reduce_step_scalars(loss: torch.Tensor, *flags: bool) -> torch.Tensor:
    """``[loss averaged over ranks, each flag's count over ranks]`` in one all-reduce, left on the device: the flags
    ride on the collective the loss needs anyway (a count > 0 means some rank set the flag), and the host copy is
    made once per step with the gradient norms (``train_step``)."""
    packed = torch.stack([loss, *(loss.new_tensor(float(flag)) for flag in flags)])
    if is_distributed():
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        packed[0] /= dist.get_world_size()
    return packed


def _parameters_finite(model: nn.Module) -> bool:
    """Whether every parameter is finite: one max-abs reduction per tensor (``_foreach_norm`` with ord=inf: no
    overflow, NaN propagates) and one sync, a fraction of the optimizer's own passes over the parameters.
    Replicated parameters (one process, DDP) give every rank the same answer with no collective; FSDP2's
    shards (DTensors) are checked locally and agreed over ranks."""
    params = list(model.parameters())
    sharded = any(hasattr(p, "to_local") for p in params)
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in params]
    local = [t for t in local if t.numel()]  # DeepSpeed ZeRO-3 leaves empty placeholders
    finite = not local or bool(torch.isfinite(torch.stack(torch._foreach_norm(local, ord=math.inf))).all())
    return all_ranks_agree(finite, any_rank=False) if sharded else finite


def train_step(
    model: nn.Module,
    batches: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    accelerator: Accelerator,
    grad_clip: float,
    stop_requested: Callable[[], bool] | None = None,
    grad_groups: GroupGradNorms | None = None,
    write_failed: bool = False,
    document_eos: int | None = None,
) -> StepResult:
    """One optimizer step over ``len(batches)`` micro-batches (``accelerator.gradient_accumulation_steps``
    of them), each ``LongTensor[B, seq_len + 1]`` on the model's device.

    Works with any model ``accelerator.prepare`` returned (DDP, FSDP, DeepSpeed): ``accumulate``
    skips the gradient all-reduce on all but the last micro-batch and ``backward`` divides each
    micro-batch loss by the number of micro-batches, so the gradient is that of the mean loss over
    the whole global batch (all micro-batches hold the same number of tokens). The model computes the
    loss itself (in training mode: fused with the LM head, softmax in fp32, no ``[B, T, V]`` logits).
    The norm is the global pre-clip norm (``grad_clip = 0``: no clipping).
    The decision to skip uses rank-averaged loss and the all-reduced gradient norm, so every rank
    takes the same branch. ``stop_requested()`` (this rank was asked to stop) is polled once, after the
    backward passes, and agreed over ranks in the loss's all-reduce as ``StepResult.stop``, so all ranks
    stop after the same step. ``write_failed`` (this rank could not write a run-directory file) rides on the
    same all-reduce (``StepResult.write_failed``). ``grad_groups`` measures its per-group norms once the gradients
    are complete, before clipping. The loss, the flags and every norm reach the host in one copy (a
    synchronisation drains a GPU's queue); after an applied update the parameters are checked
    (``params_finite``, the step's second and last synchronisation). ``document_eos``: the EOS id when the
    documents packed into a window are masked from each other (``data.document_masking``), else None.
    """
    model.train()
    loss_sum = torch.zeros((), device=accelerator.device)
    engine, group_norms = deepspeed_engine(model), None
    for batch in batches:
        with accelerator.accumulate(model):
            loss = model(**model_inputs(batch[:, :-1], document_eos), shift_labels=batch[:, 1:]).loss
            if engine is None:
                accelerator.backward(loss)
            else:  # the engine steps on the boundary; the group norms are read before, focus clipped after
                group_norms = deepspeed_backward(engine, loss, accelerator.sync_gradients, grad_groups)
            loss_sum += loss.detach()
    this_rank_stops = stop_requested is not None and stop_requested()
    scalars = _all_reduce_step_scalars(loss_sum / len(batches), this_rank_stops, write_failed)
    if engine is None and grad_groups is not None:
        group_norms = grad_groups.norms()
    norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    on_device = [scalars, torch.as_tensor(norm, dtype=torch.float32, device=scalars.device).reshape(1)]
    if group_norms is not None:
        on_device.append(group_norms.to(scalars.device))
    mean_loss, stops, write_fails, grad_norm, *groups = torch.cat(on_device).tolist()
    stop, any_write_failed = stops > 0, write_fails > 0
    if grad_groups is not None:
        grad_groups.record(groups if group_norms is not None else None)
    skipped = not (math.isfinite(mean_loss) and math.isfinite(grad_norm))
    params_finite = True
    if not skipped:
        optimizer.step()
        scheduler.step()
        params_finite = _parameters_finite(model)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=mean_loss, grad_norm=grad_norm, skipped=skipped, stop=stop, params_finite=params_finite,
                      write_failed=any_write_failed)


def _mixed_precision(config: RunConfig, device_type: str) -> str:
    """Accelerate's mixed_precision for ``TrainConfig.autocast_dtype``."""
    return "no" if config.train.autocast_dtype(device_type) is None else "bf16"


def _flat_hparams(config: RunConfig) -> dict[str, Any]:
    """Tracker-friendly config: dotted keys, scalars only (TensorBoard's hparams reject lists/None)."""
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value)
            for key, value in flatten(asdict(config)).items()}


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
    errors = gather_messages(error)
    if errors:
        kind, message = errors[0]
        raise ConfigError("name", message) if kind == "held" else TrainingError(message)
    return lock


def _resume(config: RunConfig, ckpt_dir: Path, accelerator: Accelerator,
            loader: Any) -> tuple[Path | None, dict | None]:
    """Load the newest usable checkpoint (``resume_checkpoint``); return it and its trainer.json, or
    ``(None, None)`` to start at step 0. ``resume=true`` refuses to start over checkpoints that all failed to
    verify or load (history would be overwritten); ``resume=restart`` starts from step 0 then."""
    resume_from, saved = (resume_checkpoint(ckpt_dir, accelerator=accelerator, loader=loader, config=config)
                          if config.resume else (None, None))
    if saved is not None:
        main_print(f"resumed from {resume_from} at step {saved['state']['step']}")
    elif config.resume is True and has_checkpoints(ckpt_dir):
        raise ConfigError("resume", f"no usable checkpoint in {ckpt_dir} (found {', '.join(checkpoint_names(ckpt_dir))}"
                                    f"; each skipped, see the warnings): not starting over them; repair or move "
                                    f"them, or pass resume=restart to start from step 0")
    elif config.resume:
        main_print(f"resume={config.resume} but {ckpt_dir} holds no usable checkpoint: starting from step 0")
    return resume_from, saved


def _prepare_run_dir(config: RunConfig, step: int) -> None:
    """config.yaml, and metrics.jsonl cut back to ``step``; a failed write (a full disk) is one
    ``TrainingError`` on every rank."""
    error = None
    if is_main_process():
        try:
            save_config(config, config.run_dir / "config.yaml")
            truncate_metrics(config.run_dir / "metrics.jsonl", step)
        except OSError as err:
            error = f"could not write to {config.run_dir} ({one_line(err)}); nothing in it was changed"
    errors = gather_messages(error)
    if errors:
        raise TrainingError(errors[0])


def build_data(config: RunConfig, tokenizer: Tokenizer, accelerator: Accelerator, rank: int, world_size: int
               ) -> tuple[TrainLoader, torch.Tensor]:
    """This rank's training loader and the validation windows. The main process builds them first, listing the
    source's files (every parquet footer) and materialising the validation set into ``data.cache_dir``; the
    other ranks then read both from there instead of each reading every footer and the validation documents."""
    with accelerator.main_process_first():
        loader = build_train_loader(config.data, tokenizer, config.train.micro_batch_size, rank, world_size)
        return loader, build_val_windows(config.data, tokenizer)


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
class _Run:
    """What ``_setup`` built for the loop: the prepared model and optimizer, the data, the log, and the
    counters the loop advances (``state``, the grad-norm trackers, ``last_checkpoint``)."""

    config: RunConfig
    accelerator: Accelerator
    model: nn.Module
    """As prepared by Accelerate: what checkpoints save and the isotropy report reads."""
    train_model: nn.Module
    """``model``, compiled when ``train.compile``: what the steps and evaluations run."""
    optimizer: torch.optim.Optimizer
    scheduler: Any
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
        errors = gather_messages(self.log.failure)
        if errors:
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
        metrics = evaluate(self.train_model, self.val_windows, train.micro_batch_size, self.document_eos)
        isotropy_batch = model_inputs(self.val_batch, self.document_eos)
        layers = layer_report(self.accelerator.unwrap_model(self.model), self.val_batch, train.isotropy_samples,
                              seed=self.config.data.seed, position_ids=isotropy_batch.get("position_ids"))
        self.log.log("eval", self.state.step, self.state.tokens, val_loss=metrics["val_loss"],
                     val_ppl=metrics["val_ppl"], layers=layers)
        progress.write(f"step {self.state.step}: val_loss {metrics['val_loss']:.4f}")


def _setup(config: RunConfig, teardown: ExitStack) -> _Run:
    """Build the run. Each resource is registered on ``teardown`` as soon as it is acquired (the process group,
    the run directory's lock, the trackers, metrics.jsonl), so a failure anywhere releases what exists."""
    run_dir, ckpt_dir = config.run_dir, config.run_dir / "checkpoints"
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    accelerator = Accelerator(
        cpu=device_type == "cpu",
        mixed_precision=_mixed_precision(config, device_type),
        log_with=config.trackers or None,
        project_config=ProjectConfiguration(project_dir=str(run_dir),
                                            logging_dir=str(run_dir / "tensorboard")),
        step_scheduler_with_optimizer=False,  # we step it once per optimizer step ourselves
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=config.train.collective_timeout_s))],
    )
    teardown.push(lambda exc_type, *_: _leave_process_group(accelerator, failed=exc_type is not None))
    rank, world_size = rank_and_world_size()
    accum = gradient_accumulation_steps(config, world_size)
    accelerator.gradient_accumulation_steps = accum
    lock = _lock_run_dir(run_dir)
    if lock is not None:
        teardown.callback(lock.release)
    # Looked at only under the lock: a run of this name ending between an earlier look and the lock would leave
    # checkpoints that this run, starting from step 0, would overwrite.
    if not config.resume and has_checkpoints(ckpt_dir):
        raise ConfigError("resume", f"{run_dir} already holds checkpoints; pass resume=true to continue "
                                    f"that run or choose another name=")
    max_steps = resolve_max_steps(config)
    tokenizer = load_tokenizer(config.data.tokenizer)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if config.model.vocab_size < vocab:
        raise ConfigError("model.vocab_size", f"{config.model.vocab_size} is smaller than the tokenizer's "
                                              f"{vocab} tokens")

    set_seed(config.seed)
    model = build_model(config.model)
    if config.train.activation_checkpointing:  # before prepare: FSDP2's hooks then wrap the checkpointed layers
        model.activation_checkpointing_enable(every_n_layers=config.train.activation_checkpointing)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, max_steps)
    loader, val_windows = build_data(config, tokenizer, accelerator, rank, world_size)
    set_deepspeed_micro_batch(accelerator, config.train.micro_batch_size)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    train_model = torch.compile(model) if config.train.compile else model
    engine, asked_engine = engine_in_use(model, accelerator), engine_requested()
    if (mismatch := engine_mismatch(asked_engine, engine)) is not None:
        main_print(mismatch)

    state = TrainerState()
    grad_norms = GradNormTracker(config.train.grad_norm_window, config.train.warmup_steps)
    unwrapped = accelerator.unwrap_model(model)
    group_grad_norms = GroupGradNorms(grad_norm_groups(unwrapped, multiplier_of(unwrapped).keys()),
                                      config.train.grad_norm_window, config.train.warmup_steps)
    resume_from, saved = _resume(config, ckpt_dir, accelerator, loader)
    if saved is not None:
        state = TrainerState(**saved["state"])
        # load_state restored Accelerate's micro-batch counter as the saved run counted it; with another number of
        # processes the micro-batches per step differ, and the counter would put the gradient sync (and so the
        # optimizer step) off the step boundary, ranks updating on unsynchronised gradients
        accelerator.step = state.step * accum
        grad_norms.load_state_dict(saved["grad_norm_tracker"])
        group_grad_norms.load_state_dict(saved.get("group_grad_norms", {}))
    _prepare_run_dir(config, state.step)
    try:  # on the main process alone: a failure there must not leave the other ranks waiting
        accelerator.init_trackers(config.wandb_project, config=_flat_hparams(config),
                                  init_kwargs={"wandb": {"name": config.name, "dir": str(run_dir)}})
    except Exception as err:  # TensorBoard raises OSError, W&B its own types
        accelerator.trackers.clear()
        main_print(f"warning: trackers {', '.join(config.trackers)} could not start ({one_line(err)}); training "
                   f"without them (metrics.jsonl keeps every row)")
    teardown.callback(_finish_trackers, accelerator)
    log = MetricsLog(run_dir / "metrics.jsonl", accelerator)
    teardown.callback(log.close)
    for line in schedule_warnings(config, max_steps):
        main_print(f"warning: {line}")
    total, non_embedding = _print_params(config.model)
    fpt = flops_per_token(config.model, config.data.seq_len)
    log.log("meta", state.step, state.tokens, name=config.name, variant=config.model.variant_name,
            seed=config.seed, params_total=total, params_non_embedding=non_embedding, flops_per_token=fpt,
            world_size=world_size, grad_accum=accum, max_steps=max_steps,
            mixed_precision=accelerator.mixed_precision, engine=engine, engine_requested=asked_engine,
            resumed_from=str(resume_from) if resume_from else None, config=asdict(config))

    device = accelerator.device
    run = _Run(
        config=config, accelerator=accelerator, model=model, train_model=train_model, optimizer=optimizer,
        scheduler=scheduler, tokenizer=tokenizer, loader=loader, val_windows=val_windows,
        val_batch=val_windows[: config.train.micro_batch_size, :-1].to(device), batches=iter(loader), log=log,
        document_eos=eos_id(tokenizer) if config.data.document_masking else None,
        state=state, grad_norms=grad_norms, group_grad_norms=group_grad_norms, engine=engine, accum=accum,
        max_steps=max_steps, flops_per_token=fpt,
        peak_flops=peak_flops(device, config.train.autocast_dtype(device.type) or torch.float32) * world_size,
        last_checkpoint=resume_from)
    run.stop_on_log_failure()  # metrics.jsonl opened and its meta row written, or every rank stops here
    if (mismatch := disagreement({"max_steps": max_steps, "start_step": state.step, "micro_batches": accum})):
        raise TrainingError(mismatch)
    return run


def _train(run: _Run, teardown: ExitStack) -> bool:
    """The steps from ``run.state.step`` to ``max_steps``, each with its rows, evaluation and checkpoint as due;
    True when a signal stopped the run (after a checkpoint)."""
    config, state, log = run.config, run.state, run.log
    device = run.accelerator.device
    tokens_per_step = config.train.global_batch_tokens
    stop = StopRequest(config.train.stop_grace_s)
    teardown.callback(stop.restore)
    progress = ProgressBar(state.step, run.max_steps)
    teardown.callback(progress.close)
    interval_tokens, interval_time, data_wait = 0, 0.0, 0.0
    while state.step < run.max_steps:
        started = time.perf_counter()
        batches = [next(run.batches).to(device, non_blocking=True) for _ in range(run.accum)]
        data_wait += time.perf_counter() - started
        lr = run.optimizer.param_groups[0]["lr"]
        result = train_step(run.train_model, batches, run.optimizer, run.scheduler, run.accelerator,
                            config.train.grad_clip, stop_requested=stop.received,
                            grad_groups=run.group_grad_norms, write_failed=log.failure is not None,
                            document_eos=run.document_eos)
        if result.write_failed:  # a row of an earlier step was lost on rank 0: every rank stops here
            run.stop_on_log_failure()
        interval_time += time.perf_counter() - started
        interval_tokens += tokens_per_step
        state.step += 1
        state.tokens += tokens_per_step
        state.skipped_steps += result.skipped
        state.consecutive_bad_steps = state.consecutive_bad_steps + 1 if result.skipped else 0
        grad_stats = {**run.grad_norms.update(state.step, result.grad_norm), **run.group_grad_norms.update(state.step)}
        tokens_per_s = interval_tokens / max(interval_time, 1e-9)
        progress.update(result.loss, tokens_per_s)

        if state.step % config.train.log_every == 0 or state.step == run.max_steps or result.skipped:
            memory, memory_kind = peak_memory(device)
            log.log("train", state.step, state.tokens, loss=result.loss,
                    ppl=math.exp(min(result.loss, 700.0)), lr=lr, **grad_stats,
                    tokens_per_s=tokens_per_s, mfu=mfu(tokens_per_s, run.flops_per_token, run.peak_flops),
                    peak_mem_bytes=memory, peak_mem_kind=memory_kind, data_wait_s=data_wait,
                    skipped_steps=state.skipped_steps)
            interval_tokens, interval_time, data_wait = 0, 0.0, 0.0

        if not result.params_finite:
            raise TrainingError(
                f"stopping: the update of step {state.step} made parameters non-finite (its loss and gradient "
                f"norm were finite: is train.lr={config.train.lr} too large?); nothing of it was saved, the "
                f"last good checkpoint is {run.last_checkpoint or 'none'}")
        if state.consecutive_bad_steps >= config.train.max_bad_steps:
            saved = run.checkpoint()
            raise TrainingError(
                f"stopping: {state.consecutive_bad_steps} consecutive steps had a non-finite loss or "
                f"gradient norm (train.max_bad_steps={config.train.max_bad_steps}); the last good "
                f"weights and optimizer state are saved in {saved}")
        if state.step % config.train.eval_every == 0 or state.step == run.max_steps:
            run.evaluate_and_log(progress)
        if result.stop or state.step % config.train.checkpoint_every == 0 or state.step == run.max_steps:
            run.checkpoint()
        if result.stop:
            main_print(f"stopped by signal at step {state.step}; checkpoint {run.last_checkpoint}")
            return True
    return False


def _communication_failed(err: RuntimeError) -> bool:
    """Whether ``err`` comes from the process group: torch's ``DistError`` types, or the RuntimeError that DDP's
    reducer raises from the backward pass when its all-reduce fails (it names the backend's transport)."""
    return isinstance(err, dist.DistError) or any(marker in str(err) for marker in ("gloo", "NCCL", "Connection reset"))


def fit(config: RunConfig) -> FitResult:
    """Train ``config`` to ``max_steps`` (or until SIGTERM/SIGINT); write runs/<name>/ as documented in
    docs/ARCHITECTURE.md. Configuration problems found without reading anything (``config.validate``, the batch
    split over the processes) raise ``ConfigError`` before any file is written; the others (a run of this name
    in use or holding checkpoints, the tokenizer's vocabulary, data inputs, a checkpoint that does not fit) once
    the run directory's lock is taken, which is then released. Everything acquired is released on every way out
    (``_setup``, ``_train``)."""
    config.validate()
    try:
        with ExitStack() as teardown:
            run = _setup(config, teardown)
            stopped_by_signal = _train(run, teardown)
    except RuntimeError as err:  # a peer died, or ranks fell out of step: gloo / NCCL say so in many lines
        if not _communication_failed(err):
            raise
        raise TrainingError(f"a collective failed or waited longer than train.collective_timeout_s="
                            f"{config.train.collective_timeout_s:g}: another rank stopped or is stuck (see its "
                            f"output) [{one_line(err)}]") from None
    return FitResult(run_dir=config.run_dir, step=run.state.step, tokens=run.state.tokens,
                     stopped_by_signal=stopped_by_signal, last_checkpoint=run.last_checkpoint)
