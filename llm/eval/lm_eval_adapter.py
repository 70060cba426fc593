"""Downstream tasks through EleutherAI's lm-evaluation-harness (the optional ``lmeval`` extra).

``pip install -e '.[lmeval]'``, then ``python eval.py lm-eval runs/NAME --tasks hellaswag,arc_easy``.
The loaded model object (our registered HF class, no remote code) and the checkpoint's tokenizer
are handed to lm_eval's ``HFLM`` and evaluated with ``lm_eval.simple_evaluate``; batches are padded
(the model gives each row what it gives alone, so ``generate_until`` tasks batch too). Hub tasks
download their datasets (offline, a task that cannot is named in one error line);
``--include-path DIR`` adds task YAMLs of your own, e.g. over a local jsonl (docs/evaluation.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from torch import nn

from llm.eval.errors import EvalError

__all__ = ["hf_tokenizer", "lm_eval_available", "run_lm_eval"]


def lm_eval_available() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


LOCAL_TASK_HINT = ("offline, evaluate a local copy: --include-path DIR with a task YAML whose dataset_path "
                   "is json, csv or parquet and whose data_files are local (docs/evaluation.md)")


def hf_tokenizer(model_path: str, trust_remote_code: bool = False) -> Any:
    """The transformers tokenizer saved beside the weights (checkpoints save one for this purpose).

    ``trust_remote_code`` is always passed: transformers reads the model config first, and left unset
    for a directory with remote code it asks on stdin "[y/N]", which stalls a batch job.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise EvalError(f"{model_path}: no loadable tokenizer ({str(err).splitlines()[0]})") from None


def run_lm_eval(model: nn.Module, tokenizer: Any, tasks: list[str], *, num_fewshot: int | None = None,
                limit: int | float | None = None, batch_size: int = 8, include_path: str | None = None,
                include_defaults: bool = True, device: str = "cpu") -> dict[str, dict[str, Any]]:
    """``lm_eval.simple_evaluate`` on a loaded model; returns ``results`` (task -> metric -> value).

    ``include_defaults=False`` knows only the tasks under ``include_path``: it skips indexing lm_eval's
    thousands of built-in task YAMLs (tens of seconds on a small machine).
    """
    if not lm_eval_available():
        raise ModuleNotFoundError("lm-eval is not installed: pip install -e '.[lmeval]'")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"--include-path: no such directory: {include_path}")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
              max_length=model.config.max_position_embeddings)
    task_manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    if unknown := [t for t in tasks if t not in task_manager.all_tasks]:
        raise EvalError(f"--tasks: unknown task(s) {', '.join(unknown)} (see lm_eval --tasks list)")
    return lm_eval.simple_evaluate(model=lm, tasks=_load_tasks(task_manager, tasks), num_fewshot=num_fewshot,
                                   limit=limit, task_manager=task_manager)["results"]


def _load_tasks(task_manager: Any, tasks: list[str]) -> list[Any]:
    """Each task built (its dataset loaded) one at a time, so that one whose dataset cannot be fetched
    is named in a single line instead of a long traceback. Plain tasks are handed on built; groups by
    name (lm_eval rebuilds them from the datasets cache)."""
    built: list[Any] = []
    for task in tasks:
        try:
            loaded = task_manager.load(task)
        except OSError as err:  # ConnectionError (offline mode included), requests' HTTP errors
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise EvalError(f"--tasks {task}: cannot load its dataset ({reason}); {LOCAL_TASK_HINT}") from None
        built += [task] if loaded["groups"] else list(loaded["tasks"].values())
    return built
