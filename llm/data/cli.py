"""``isollm-data``: pre-tokenize a source into shards, or train a small byte-level BPE tokenizer.

    isollm-data prepare --config configs/demo.yaml data.val_bucket=50 --out data/prepared
    isollm-data prepare --source /path/to/fineweb-sample --tokenizer tok/ --out data/prepared
    isollm-data train-tokenizer --vocab-size 8192 --out tok/ /path/to/fineweb-sample
"""

from __future__ import annotations

import argparse
import sys
import time

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llm.config import DataConfig, load_config
from llm.model.config import ConfigError

__all__ = ["main"]


def _data_config(files: list[str], overrides: list[str]) -> DataConfig:
    """The ``data`` section of the run config (files + ``data.key=value`` overrides), or, without config
    files, a ``DataConfig`` from the overrides alone (so no training fields are required)."""
    if files:
        return load_config(files, overrides).data
    try:
        node = OmegaConf.merge(OmegaConf.structured(DataConfig),
                               OmegaConf.from_dotlist([o.removeprefix("data.") for o in overrides]))
        config = OmegaConf.to_object(node)
    except OmegaConfBaseException as err:
        raise ConfigError(f"data.{getattr(err, 'full_key', '') or ''}", str(err).splitlines()[0]) from None
    assert isinstance(config, DataConfig)
    return config.validate()


def _prepare(args: argparse.Namespace) -> int:
    from llm.data.shards import prepare
    from llm.data.tokenizer import load_tokenizer

    overrides = list(args.overrides)
    for flag, key in (("source", "data.source"), ("name", "data.name"), ("tokenizer", "data.tokenizer"),
                      ("val_bucket", "data.val_bucket")):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    data_cfg = _data_config(args.config, overrides)
    start = time.perf_counter()
    index = prepare(data_cfg, load_tokenizer(data_cfg.tokenizer), args.out)
    tokens = sum(s["num_tokens"] for s in index["shards"])
    docs = sum(s["num_docs"] for s in index["shards"])
    seconds = time.perf_counter() - start
    print(f"prepared {docs:,} documents, {tokens:,} tokens in {len(index['shards'])} shard(s) at {args.out} "
          f"({seconds:.1f} s, {tokens / max(seconds, 1e-9):,.0f} tokens/s)")
    return 0


def _train_tokenizer(args: argparse.Namespace) -> int:
    from llm.data.tokenizer import train_tokenizer

    tok = train_tokenizer(args.files, args.vocab_size, args.out, text_column=args.text_column)
    print(f"trained a byte-level BPE of {tok.get_vocab_size():,} tokens -> {args.out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="isollm-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="pre-tokenize training documents into uint32 memmap shards")
    prep.add_argument("--config", action="append", default=[], help="run config YAML (repeatable, merged)")
    prep.add_argument("--out", required=True, help="output directory (then set data.prepared to it)")
    prep.add_argument("--source", help="shortcut for data.source=...")
    prep.add_argument("--name", help="shortcut for data.name=...")
    prep.add_argument("--tokenizer", help="shortcut for data.tokenizer=...")
    prep.add_argument("--val-bucket", type=int, help="shortcut for data.val_bucket=...")
    prep.add_argument("overrides", nargs="*", help="config overrides such as data.val_bucket=50")
    prep.set_defaults(run=_prepare)
    train = commands.add_parser("train-tokenizer", help="train a byte-level BPE on local files")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--out", required=True, help="tokenizer.json path or directory")
    train.add_argument("--text-column", default="text", help="column of parquet/jsonl files holding the text")
    train.add_argument("files", nargs="+", help="text/parquet/jsonl files, directories or globs")
    train.set_defaults(run=_train_tokenizer)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"isollm-data {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
