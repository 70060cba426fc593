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
The text is one document: no separator is added, so no document masking applies.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llm.errors import one_line
from llm.eval.errors import EvalError
from llm.eval.evaluate import load_for_eval, run_precision, token_byte_lengths


@torch.no_grad()
def sliding_window_nll(model: torch.nn.Module, ids: torch.Tensor, seq_len: int, stride: int) -> torch.Tensor:
    """-log p(ids[t] | the earlier tokens of the window that scores it), in nats, for each t; NaN where no window
    scores a token: ids[0], and a window's first token when ``stride == seq_len`` (windows that do not overlap)."""
    nll = torch.full((len(ids),), math.nan, dtype=torch.float64)
    scored_to = 0
    for begin in range(0, len(ids), stride):
        end = min(begin + seq_len, len(ids))
        first = max(scored_to, begin + 1)  # a window's first token has no context in it
        window = ids[begin:end].unsqueeze(0).to(next(model.parameters()).device)
        logits = model(input_ids=window).logits[0, first - begin - 1 : -1].float()
        nll[first:end] = F.cross_entropy(logits, window[0, first - begin :], reduction="none").double().cpu()
        scored_to = end
        if end == len(ids):
            break
    return nll


def evaluate_text(target: str, text_file: str, stride: int | None = None, *, config_files: list[str] | None = None,
                  overrides: list[str] | None = None, trust_remote_code: bool = False,
                  device: str | None = None) -> dict[str, Any]:
    """Score every token of ``text_file`` with ``target`` (``llm.eval.evaluate.resolve_checkpoint``) in windows of its
    run's ``data.seq_len`` every ``stride`` tokens, in the run's precision. The report: ``tokens`` (scored), ``bytes``
    (theirs), ``loss`` (nats/token), ``ppl``, ``bits_per_byte``, and what was scored with what."""
    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:  # before the model is loaded
        raise EvalError(f"--text {text_file}: not a readable UTF-8 text file ({one_line(err)})") from None
    resolved, config, model, tokenizer, torch_device = load_for_eval(target, config_files, overrides,
                                                                     trust_remote_code, device)
    seq_len, stride = config.data.seq_len, stride or config.data.seq_len // 2
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids)
    if stride > seq_len or len(ids) < 2:
        raise EvalError(f"--stride {stride}: at most the window, data.seq_len={seq_len}" if stride > seq_len else
                        f"--text {text_file}: {len(ids)} token(s), nothing to score (a token needs one before it)")
    with run_precision(config, torch_device):
        nll = sliding_window_nll(model, ids, seq_len, stride)
    scored = ~nll.isnan()
    n_bytes, loss = int(token_byte_lengths(tokenizer, int(ids.max()) + 1)[ids[scored]].sum()), float(nll[scored].mean())
    bits = float(nll[scored].sum()) / math.log(2) / n_bytes if n_bytes else math.nan
    return {"file": text_file, "model_path": resolved.model_path, "step": resolved.step, "seq_len": seq_len,
            "stride": stride, "tokens": int(scored.sum()), "bytes": n_bytes, "loss": loss,
            "ppl": math.exp(min(loss, 700.0)), "bits_per_byte": bits}


def format_text_report(report: dict[str, Any]) -> str:
    step = f" (step {report['step']})" if report["step"] is not None else ""
    return (f"model       {report['model_path']}{step}\n"
            f"text        {report['file']}: {report['tokens']:,} tokens scored, {report['bytes']:,} bytes "
            f"(windows of {report['seq_len']}, stride {report['stride']})\n"
            f"loss        {report['loss']:.6f} nats/token\nperplexity  {report['ppl']:.4f}\n"
            f"bits/byte   {report['bits_per_byte']:.6f}\n")
