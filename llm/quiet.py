"""Silence third-party output that tells a user of this package nothing.

DeepSpeed, when installed, is imported by Accelerate and transformers whenever they unwrap a model
(``save_pretrained``, ``Accelerator.unwrap_model``), even in runs that never use it; on a machine
without CUDA its import then warns "Setting accelerator to CPU". The warning is dropped unless the run
was launched with DeepSpeed (Accelerate sets ``ACCELERATE_USE_DEEPSPEED``), where it is news.
"""

from __future__ import annotations

import logging
import os

DEEPSPEED_CPU_FALLBACK = "Setting accelerator to CPU"


def _not_deepspeed_cpu_fallback(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(DEEPSPEED_CPU_FALLBACK)


def quiet_deepspeed_banner() -> None:
    """Filter DeepSpeed's CPU-fallback warning out of its logger (created on import; the filter persists)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return
    logger = logging.getLogger("DeepSpeed")
    if _not_deepspeed_cpu_fallback not in logger.filters:
        logger.addFilter(_not_deepspeed_cpu_fallback)
