"""``isollm-data plan``: how one epoch of a source splits among ranks x workers, before a job is launched.

Per node: documents, bytes and tokens of one epoch, and its read amplification (bytes read over bytes of
its share: a node decodes whole parquet row groups); then the imbalance between nodes. Documents are exact
for parquet (rows from the footers); for jsonl/txt (measured in bytes) they are estimated, like tokens, from
the first ``sample_docs`` documents, tokenized with ``data.tokenizer``. Only footers and that sample are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llm.config import DataConfig
from llm.data.pieces import PieceReader, list_pieces
from llm.data.sources import data_source, source_files
from llm.data.split import epoch_order, node_shares
from llm.data.tokenizer import encode_documents, eos_id, load_tokenizer

__all__ = ["Sample", "print_plan", "sample_rates"]


@dataclass(frozen=True)
class Sample:
    """What the source's first documents say about the rest."""

    docs: int
    docs_per_unit: float
    tokens_per_unit: float
    tokens_per_doc_cv: float
    """Coefficient of variation (std / mean) of the documents' token counts."""


def sample_rates(data_cfg: DataConfig, sample_docs: int) -> Sample:
    """Rates over the source's first ``sample_docs`` documents (in batches of ``data.tokenize_batch``)."""
    source = data_source(data_cfg)
    reader = PieceReader(source, data_cfg)
    tokenizer = load_tokenizer(data_cfg.tokenizer)
    lengths: list[np.ndarray] = []
    docs = units = 0
    batches = (batch for index, piece in enumerate(reader.pieces) for batch in reader.batches(index, 0, piece.size))
    for before, rows, after in batches:
        if texts := [t for t in rows[source.text_column] if t]:
            lengths.append(encode_documents(tokenizer, texts, eos_id(tokenizer), data_cfg.max_doc_chars)[1])
        docs += len(rows[source.text_column])
        units += after - before
        if docs >= sample_docs:
            break
    tokens = np.concatenate(lengths) if lengths else np.zeros(1)
    spread = float(tokens.std() / tokens.mean()) if tokens.sum() else 0.0  # every sampled document empty
    return Sample(docs, docs / units, float(tokens.sum()) / units, spread)


def print_plan(data_cfg: DataConfig, world_size: int, workers: int, sample_docs: int) -> None:
    source = data_source(data_cfg)
    kind, files = source_files(source)
    pieces = list_pieces(source)
    nodes = world_size * max(workers, 1)
    shares = node_shares(pieces, epoch_order(len(pieces), data_cfg.seed, 0, data_cfg.shuffle_shards), nodes)
    sample = sample_rates(data_cfg, sample_docs)
    unit = "rows" if kind == "parquet" else "bytes"
    total_units = sum(p.size for p in pieces)
    name = f" config {source.name}" if source.name else ""
    print(f"{source.path}{name}: {len(files)} {kind} file(s), {len(pieces)} piece(s), {total_units:,} {unit}, "
          f"{sum(p.num_bytes for p in pieces):,} bytes")
    print(f"{world_size} rank(s) x {max(workers, 1)} worker(s) = {nodes} node(s); one epoch per node:")
    approx = "" if kind == "parquet" else "~"
    print(f"{'node':>6}{'rank':>6}{'worker':>8}{'documents':>14}{'bytes':>16}{'tokens~':>16}{'read amp.':>11}")
    for node, share in enumerate(shares):
        docs = share.units * sample.docs_per_unit
        print(f"{node:>6}{node // max(workers, 1):>6}{node % max(workers, 1):>8}{approx + f'{docs:,.0f}':>14}"
              f"{share.share_bytes:>16,.0f}{share.units * sample.tokens_per_unit:>16,.0f}{share.amplification:>10.2f}x")
    units = [s.units for s in shares]
    mean = sum(units) / nodes
    print(f"imbalance: the largest share is {max(units) - min(units):,} {unit} above the smallest (max/mean - 1 = "
          f"{max(units) / mean - 1:.2%}); read amplification: max {max(s.amplification for s in shares):.2f}x, all "
          f"nodes {sum(s.read_bytes for s in shares) / sum(s.share_bytes for s in shares):.2f}x")
    per_doc = sample.tokens_per_unit / sample.docs_per_unit
    print(f"tokens estimated from {sample.docs:,} document(s): {per_doc:,.0f} tokens per document "
          f"(validation documents, 1 in {data_cfg.val_bucket}, included)")
    # shares hold equal documents (rows) or bytes; their tokens vary with the documents' lengths: a sum of
    # n lengths of coefficient of variation c has a relative standard deviation of c / sqrt(n)
    spread = sample.tokens_per_doc_cv / np.sqrt(max(mean * sample.docs_per_unit, 1.0))
    print(f"tokens per node vary by about {spread:.2%} (1 std) with the documents' lengths: nodes running in "
          f"lockstep end their epoch that far apart; prepared tokens (data.prepared) split windows exactly")
