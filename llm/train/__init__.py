"""Training: ``fit`` (the loop), ``train_step``, ``evaluate``, optimizer/schedule and checkpoints."""

from llm.train.checkpoint import load_checkpoint, save_checkpoint
from llm.train.checkpoint_files import latest_checkpoint
from llm.train.evaluate import evaluate, lm_loss
from llm.train.step import train_step
from llm.train.trainer import fit

__all__ = [
    "evaluate", "fit", "latest_checkpoint", "lm_loss", "load_checkpoint", "save_checkpoint", "train_step",
]
