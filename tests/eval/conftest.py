"""A tiny run trained once per session on the real FineWeb sample (``fineweb``, ``bpe``: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import TINY_MODEL

TINY = [
    *TINY_MODEL, "data.val_bucket=50", "data.val_tokens=2048", "train.lr=3e-3", "train.warmup_steps=2",
    "train.max_steps=4", "train.micro_batch_size=3", "train.global_batch_tokens=192", "train.log_every=1",
    "train.eval_every=2", "train.checkpoint_every=2", "train.isotropy_samples=64", "train.grad_norm_window=4",
    "seed=3",
]


@pytest.fixture(scope="session")
def trained_run(fineweb: Path, bpe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/tiny after 4 steps of an isogmlp model (eval + checkpoint at steps 2 and 4)."""
    from accelerate.state import AcceleratorState, GradientState

    from llm.config import load_config
    from llm.train.trainer import fit

    root = tmp_path_factory.mktemp("eval_run")
    config = load_config(None, [f"data.source={fineweb}", f"data.tokenizer={bpe}",
                                f"data.cache_dir={root / 'data_cache'}", f"out_dir={root / 'runs'}",
                                "name=tiny", "model.ffn=isogmlp", *TINY])
    try:
        result = fit(config)
    finally:  # accelerate's process-wide singletons would leak into later in-process runs
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return result.run_dir
