"""Data: tokenizer, sources -> tokenize -> pack -> shuffle stream, validation split, pre-tokenized shards.

The trainer needs three calls (docs/ARCHITECTURE.md): ``load_tokenizer``, ``build_train_loader`` and
``build_val_windows``.
"""

from llm.data.stream import TrainLoader, build_train_loader
from llm.data.tokenizer import eos_id, load_tokenizer, padded_vocab_size, train_tokenizer
from llm.data.validation import build_val_windows

__all__ = ["TrainLoader", "build_train_loader", "build_val_windows", "eos_id", "load_tokenizer", "padded_vocab_size",
           "train_tokenizer"]
