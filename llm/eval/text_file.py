"""Perplexity of a whole text file with a sliding window (``eval.py RUN --text FILE [--stride N]``).

Hugging Face's recipe for fixed-length models (https://huggingface.co/docs/transformers/perplexity):
the file is one token sequence ``x_0 .. x_{N-1}``; windows of ``L`` tokens (the run's ``data.seq_len``)
start every ``stride`` tokens (default ``L // 2``, the recipe's 512 of 1024), and each window scores
only the tokens the previous window did not reach. So every token but the first (which has no
context) is scored exactly once, with at least ``L - stride`` tokens of context (the first window's
tokens: all before them)::

    loss = -1/(N-1) · Σ_{t=1}^{N-1} log p(x_t | x_{b_t} .. x_{t-1})

with ``b_t`` the start of the window that scores ``x_t``. With ``stride == L`` (windows that do not
overlap) each window's first token has no context and is not scored either, as in the recipe.
Unlike the recipe's code, which takes one token off each window's count for the label shift even
where the first label was masked, the mean divides by the tokens actually scored. Bits per byte
are that sum over the UTF-8 bytes of the scored tokens (``llm.eval.evaluate``'s module docstring).
The text is the file's bytes decoded as UTF-8, as training reads a txt file (a CRLF file's carriage returns
kept; a special token's string, a literal "<|endoftext|>", encoded as its characters and counted in the bytes),
and one document: no separator is added, so no document masking applies. Refused before the model is
loaded: a ``data.seq_len`` under 2 (a window of one token scores none), a stride over it, an empty file.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llm.config import RunConfig
from llm.data.tokenizer import special_tokens_as_text
from llm.errors import one_line
from llm.eval.errors import EvalError
from llm.eval.evaluate import load_for_eval, token_byte_lengths


@torch.no_grad()
def sliding_window_nll(model: torch.nn.Module, ids: torch.Tensor, seq_len: int, stride: int) -> torch.Tensor:
    """-log p(ids[t] | the earlier tokens of the window that scores it), in nats, for each t; NaN where no window
    scores a token: ids[0], and a window's first token when ``stride == seq_len`` (windows that do not overlap)."""
    nll = torch.full((len(ids),), math.nan, dtype=torch.float64)
    for begin in range(0, max(len(ids) - seq_len, 0) + stride, stride):  # up to the first window reaching the end
        end = min(begin + seq_len, len(ids))
        # from where the previous window (which ended at begin - stride + seq_len) stopped; a window's first token
        # has no context in it
        first = max(begin + seq_len - stride, begin + 1) if begin else 1
        window = ids[begin:end].unsqueeze(0).to(next(model.parameters()).device)
        logits = model(input_ids=window).logits[0, first - begin - 1 : -1].float()
        nll[first:end] = F.cross_entropy(logits, window[0, first - begin :], reduction="none").double().cpu()
    return nll


def evaluate_text(target: str, text_file: str, stride: int | None = None, **load: Any) -> dict[str, Any]:
    """Score the tokens of ``text_file`` (the module's docstring) with ``target``
    (``llm.eval.evaluate.resolve_checkpoint``) in windows of its run's ``data.seq_len`` every ``stride`` tokens, in
    the run's precision; ``load``: ``load_for_eval``'s keywords (config files, overrides, device...). The report:
    ``tokens`` (scored), ``bytes`` (theirs), ``loss`` (nats/token), ``ppl``, ``bits_per_byte``, and what was scored
    with what."""
    try:  # bytes decoded as training reads a txt file: a CRLF file's \r are text too (read_text would drop them)
        text = Path(text_file).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:  # before the model is loaded
        raise EvalError(f"--text {text_file}: not a readable UTF-8 text file ({one_line(err)})") from None
    if not text:
        raise EvalError(f"--text {text_file}: empty, nothing to score")

    def check_windows(config: RunConfig) -> None:
        if config.data.seq_len < 2:
            raise EvalError(f"data.seq_len={config.data.seq_len}: a window of one token scores none (--text needs 2 "
                            "or more)")
        if (stride or 0) > config.data.seq_len:
            raise EvalError(f"--stride {stride}: at most the window, data.seq_len={config.data.seq_len}")

    resolved, config, model, tokenizer, torch_device = load_for_eval(target, before_model=check_windows, **load)
    seq_len, stride = config.data.seq_len, stride or config.data.seq_len // 2
    with special_tokens_as_text(tokenizer):  # as training encodes a txt file; every byte then has its token
        ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids)
    if len(ids) < 2:  # a file of one token (an empty one was refused before the model was loaded)
        raise EvalError(f"--text {text_file}: {len(ids)} token(s), nothing to score (a token needs one before it)")
    autocast = config.train.autocast_dtype(torch_device.type)  # the trainer's precision
    with torch.autocast(torch_device.type, dtype=autocast) if autocast else contextlib.nullcontext():
        nll = sliding_window_nll(model, ids, seq_len, stride)
    scored = ~nll.isnan()
    n_bytes, loss = int(token_byte_lengths(tokenizer, int(ids.max()) + 1)[ids[scored]].sum()), float(nll[scored].mean())
    bits = float(nll[scored].sum()) / math.log(2) / n_bytes if n_bytes else math.nan
    return {"file": text_file, "model_path": resolved.model_path, "step": resolved.step, "seq_len": seq_len,
            "stride": stride, "tokens": int(scored.sum()), "bytes": n_bytes, "loss": loss,
            "ppl": math.exp(min(loss, 700.0)), "bits_per_byte": bits}


def format_text_report(report: dict[str, Any]) -> str:
    """One ``name value`` line per entry of the report (loss in nats per token)."""
    return "".join(f"{key:14s}{value:.6f}\n" if isinstance(value, float) else f"{key:14s}{value}\n"
                   for key, value in report.items())
