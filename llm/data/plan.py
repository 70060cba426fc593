"""``isollm-data plan``: how one epoch of a source splits among ranks x workers, before a job is launched.

Per node: documents, bytes and tokens of one epoch, and its read amplification (bytes read over bytes of
its share: a node decodes whole parquet row groups); then the imbalance between nodes. Documents are exact
for parquet (rows from the footers); for jsonl/txt (measured in bytes) they are estimated, like tokens, from
the first ``sample_docs`` documents, tokenized with ``data.tokenizer``. Only footers and that sample are read.
"""

from __future__ import annotations

from llm.config import DataConfig
from llm.data.pieces import PieceReader, list_pieces
from llm.data.sources import data_source, source_files
from llm.data.split import epoch_order, node_shares
from llm.data.tokenizer import encode_documents, eos_id, load_tokenizer

__all__ = ["print_plan", "sample_rates"]


def sample_rates(data_cfg: DataConfig, sample_docs: int) -> tuple[float, float, int]:
    """(documents per unit, tokens per unit, documents sampled) over the source's first documents."""
    source = data_source(data_cfg)
    reader = PieceReader(source, data_cfg)
    tokenizer = load_tokenizer(data_cfg.tokenizer)
    docs = tokens = units = 0
    for index, piece in enumerate(reader.pieces):
        for before, rows, after in reader.batches(index, 0, piece.size):
            texts = [t[: data_cfg.max_doc_chars] for t in rows[source.text_column] if t]
            tokens += len(encode_documents(tokenizer, texts, eos_id(tokenizer))[0]) if texts else 0
            docs += len(rows[source.text_column])
            units += after - before
            if docs >= sample_docs:
                return docs / units, tokens / units, docs
    return docs / units, tokens / units, docs


def print_plan(data_cfg: DataConfig, world_size: int, workers: int, sample_docs: int) -> None:
    source = data_source(data_cfg)
    kind, files = source_files(source)
    pieces = list_pieces(source)
    nodes = world_size * max(workers, 1)
    shares = node_shares(pieces, epoch_order(len(pieces), data_cfg.seed, 0, data_cfg.shuffle_shards), nodes)
    docs_per_unit, tokens_per_unit, sampled = sample_rates(data_cfg, sample_docs)
    unit = "rows" if kind == "parquet" else "bytes"
    total_units = sum(p.size for p in pieces)
    name = f" config {source.name}" if source.name else ""
    print(f"{source.path}{name}: {len(files)} {kind} file(s), {len(pieces)} piece(s), {total_units:,} {unit}, "
          f"{sum(p.num_bytes for p in pieces):,} bytes")
    print(f"{world_size} rank(s) x {max(workers, 1)} worker(s) = {nodes} node(s); one epoch per node:")
    approx = "" if kind == "parquet" else "~"
    print(f"{'node':>6}{'rank':>6}{'worker':>8}{'documents':>14}{'bytes':>16}{'tokens~':>16}{'read amp.':>11}")
    for node, share in enumerate(shares):
        docs = share.units * docs_per_unit
        print(f"{node:>6}{node // max(workers, 1):>6}{node % max(workers, 1):>8}{approx + f'{docs:,.0f}':>14}"
              f"{share.share_bytes:>16,.0f}{share.units * tokens_per_unit:>16,.0f}{share.amplification:>10.2f}x")
    units = [s.units for s in shares]
    mean = sum(units) / nodes
    print(f"imbalance: the largest share is {max(units) - min(units):,} {unit} above the smallest "
          f"(max/mean - 1 = {max(units) / mean - 1:.2%}); read amplification: max "
          f"{max(s.amplification for s in shares):.2f}x, all nodes "
          f"{sum(s.read_bytes for s in shares) / sum(s.share_bytes for s in shares):.2f}x")
    print(f"tokens estimated from {sampled:,} document(s): {tokens_per_unit / docs_per_unit:,.0f} tokens per "
          f"document (validation documents, 1 in {data_cfg.val_bucket}, included)")
