"""What a run is, for a resume, derived from the whole ``RunConfig``: every field outside its ``model`` and ``data``
sections (the checkpoint's model config is compared field by field in ``llm.train.checkpoint.load_checkpoint``, the
data's identity is ``llm.data.identity``'s), a section such as ``train`` by its dotted fields, but a declared few.
A field added to ``RunConfig`` or ``TrainConfig`` (or a section added to it) is part of the identity by default:
leaving one out takes an entry in ``RESUMABLE``, with why.

What decides an entry is what the code does with the field, not what it is called: a resume that changes it must
give the run an uninterrupted run with the new config would be from the resumed step on (the same tokens and
updates, up to rounding, the same values at the steps it logs), or be exactly what the user asks for and the docs
say, and compare labels the run with (a later end, another schedule). The schedule's fields (``train.lr``,
``min_lr_ratio``, ``warmup_steps``, ``weight_decay``) may change: the schedule is a function of the step and the
config in force (``llm.train.optim.set_schedule``), applied from the resumed step on, and compare keeps such a run
in a row of its own labelled with the change (``train.lr=0.003 -> 0.0015@500``), the documented way to lower the lr
after a spike. The optimizer's other hyperparameters are identity: ``beta1``, ``beta2`` and ``eps`` are saved with
the optimizer state, which a resume loads over the config's, so a changed value would be logged and not used. So are
the batch (``global_batch_tokens``: the tokens of every step, and under ``max_tokens`` the number of steps), the
clipping, ``precision`` and ``tf32`` (the arithmetic of every update), the ``seed`` (the weights and RNG state are
that seed's) and ``planned_by`` (the plan that added the seed, which ``compare --plan`` and ``--planned`` read).
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

from llm.config import RunConfig

__all__ = ["CHECKED_APART", "RESUMABLE", "run_identity"]

CHECKED_APART = ("model", "data")
"""The sections compared by checks of their own, each over all of its fields (module docstring)."""

RESUMABLE = {
    **dict.fromkeys(("name", "out_dir"), "where the run directory is: the checkpoint resumed is the one found there, "
                                         "whatever the directory is called now or wherever it was moved"),
    "resume": "how this launch starts (continue, or start over unusable checkpoints), not what it trains",
    **dict.fromkeys(("trackers", "wandb_project"), "where the rows are also sent: metrics.jsonl holds every one"),
    # the purpose of a later end; the schedule is a function of the step and the end in force (llm.train.optim), so
    # the cosine is laid out to the new end from the resumed step on, and compare labels the run with the change
    **dict.fromkeys(("train.max_steps", "train.max_tokens"), "the run's end: a resume may extend (or shorten) it"),
    # set_schedule gives every group its lr and weight decay from the config in force before each step; a changed
    # warmup restarts the run-level grad-norm statistics at the resumed step, said in one line (llm.train.setup)
    **dict.fromkeys(("train.lr", "train.min_lr_ratio", "train.warmup_steps", "train.weight_decay"),
                    "the schedule from the resumed step on, as the config in force gives it: compare labels the "
                    "change"),
    # the data loader's state holds micro_batch_size with its topology, and the loader decides when it may change
    # (llm.data.stream: with another number of processes, on prepared tokens); it also sizes the fixed isotropy
    # batch, as in an uninterrupted run with it
    **dict.fromkeys(("train.micro_batch_size", "train.activation_checkpointing", "train.compile"),
                    "how a step's tokens are computed, not which: the same updates up to rounding"),
    **dict.fromkeys(("train.log_every", "train.eval_every", "train.checkpoint_every", "train.keep_checkpoints"),
                    "when rows, evaluations and checkpoints are written, not what is trained"),
    # a resume reseeds the rolling window from the saved norms (llm.metrics.gradnorm): a longer one fills up again
    **dict.fromkeys(("train.isotropy_samples", "train.grad_norm_window"),
                    "what the isotropy report and the rolling grad-norm statistics measure from the resume on, "
                    "never trained on; the run-level grad-norm statistics do not depend on the window"),
    **dict.fromkeys(("train.max_bad_steps", "train.collective_timeout_s", "train.stop_grace_s"),
                    "when a failing or stuck run gives up: nothing of a run that goes on"),
}
"""The fields outside ``CHECKED_APART`` that a resume may change, with why; every other one is identity."""


def run_identity(config: RunConfig) -> dict[str, Any]:
    """Every field of ``config`` outside ``CHECKED_APART`` and ``RESUMABLE``, by dotted name (``train.lr``)."""
    flat: dict[str, Any] = {}
    for field in (f for f in fields(config) if f.name not in CHECKED_APART):
        value = getattr(config, field.name)
        flat |= ({f"{field.name}.{f.name}": getattr(value, f.name) for f in fields(value)} if is_dataclass(value)
                 else {field.name: value})
    return {key: value for key, value in flat.items() if key not in RESUMABLE}
