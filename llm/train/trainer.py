"""The training loop, ``fit``: ``setup_run`` (llm/train/setup.py) builds the run, then each step is ``train_step``
(llm/train/step.py) with its metrics row, evaluation (llm/train/evaluate.py) and checkpoint as due, until
``max_steps`` or a signal (llm/train/signals.py).

HF Accelerate is the engine: DDP, FSDP2 or DeepSpeed come from the launch configuration
(``accelerate launch --config_file launch/...`` or ``torchrun``).

Conventions:

- ``step`` counts optimizer steps *attempted*, each consuming ``global_batch_tokens`` of data; ``tokens`` counts
  training tokens consumed. A step whose loss or gradient norm is not finite is skipped (gradients zeroed, no
  optimizer update) but still advances ``step``, ``tokens`` and the data stream, so a run's token budget and data
  order do not depend on how many steps were skipped, and a resumed run does not retry the bad batch. The lr of
  each step is that of the number of updates applied before it (``llm.train.optim.set_schedule``), so the
  schedule lags by the number of skipped steps (``skipped_steps``, in a train row logged at every skipped step).
  The parameters are checked after every applied update: an update that made any of them non-finite (a finite
  loss and gradient norm with a huge lr) stops the run at once, before any eval or checkpoint, so no checkpoint
  ever holds non-finite weights.
- Every resource ``fit`` acquires (process group, run-directory lock, trackers, metrics.jsonl, signal handlers,
  progress bar) is released exactly once, in reverse order, whether setup fails, the loop fails or the run ends.
- A metrics row that rank 0 cannot write (a full disk) stops every rank with the same ``TrainingError`` at the
  next step (``Run.stop_on_log_failure``), before any checkpoint past the lost row.
- The model is initialised from ``seed`` (``accelerate.utils.set_seed``: python, numpy, torch, cuda); the data
  order depends only on ``data.seed`` (with ``data.seed: run``, the run's ``seed``), so variants compared under one
  ``data.seed`` (or one seed, with ``run``) see identical batches.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from llm.config import RunConfig
from llm.errors import one_line
from llm.metrics.flops import mfu
from llm.train.logging import ProgressBar, main_print, peak_memory
from llm.train.optim import set_schedule
from llm.train.setup import Run, setup_run
from llm.train.signals import StopRequest
from llm.train.step import TrainingError, train_step

__all__ = ["FitResult", "fit"]


@dataclass
class FitResult:
    run_dir: Path
    step: int
    tokens: int
    stopped_by_signal: bool
    """A signal on any rank stopped the run (every rank stops at the same step and says so)."""
    last_checkpoint: Path | None


def _train(run: Run, teardown: ExitStack) -> bool:
    """The steps from ``run.state.step`` to ``max_steps``, each with its rows, evaluation and checkpoint as due;
    True when a signal stopped the run (after a checkpoint)."""
    config, state, log = run.config, run.state, run.log
    device = run.accelerator.device
    tokens_per_step = config.train.global_batch_tokens
    progress = ProgressBar(state.step, run.max_steps)
    teardown.callback(progress.close)
    stop = StopRequest(config.train.stop_grace_s, bar_drawn=progress.drawn)
    teardown.callback(stop.restore)
    interval_tokens, interval_time, data_wait = 0, 0.0, 0.0
    while state.step < run.max_steps:
        started = time.perf_counter()
        batches = [next(run.batches).to(device, non_blocking=True) for _ in range(run.accum)]
        data_wait += time.perf_counter() - started
        lr = set_schedule(run.optimizer, config, run.max_steps, state.step - state.skipped_steps)
        result = train_step(run.model, batches, run.optimizer, run.accelerator, config.train.grad_clip,
                            stop_requested=stop.received, grad_groups=run.group_grad_norms,
                            write_failed=log.failure is not None, document_eos=run.document_eos, tf32=config.train.tf32)
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

        if (state.step % config.train.log_every == 0 or state.step == run.max_steps or result.skipped
                or result.no_target_batches):
            memory, memory_kind = peak_memory(device)
            log.log("train", state.step, state.tokens, loss=result.loss, ppl=math.exp(min(result.loss, 700.0)), lr=lr,
                    **grad_stats, tokens_per_s=tokens_per_s, mfu=mfu(tokens_per_s, run.flops_per_token, run.peak_flops),
                    peak_mem_bytes=memory, peak_mem_kind=memory_kind, data_wait_s=data_wait,
                    skipped_steps=state.skipped_steps, no_target_batches=result.no_target_batches)
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
    the run directory's lock is taken, which is then released."""
    config.validate()
    try:
        with ExitStack() as teardown:
            run = setup_run(config, teardown)
            stopped_by_signal = _train(run, teardown)
    except RuntimeError as err:  # a peer died, or ranks fell out of step: gloo / NCCL say so in many lines
        if not _communication_failed(err):
            raise
        raise TrainingError(f"a collective failed or waited longer than train.collective_timeout_s="
                            f"{config.train.collective_timeout_s:g}: another rank stopped or is stuck (see its "
                            f"output) [{one_line(err)}]") from None
    return FitResult(run_dir=config.run_dir, step=run.state.step, tokens=run.state.tokens,
                     stopped_by_signal=stopped_by_signal, last_checkpoint=run.last_checkpoint)
