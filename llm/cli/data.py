"""``isollm-data``: pre-tokenize a source and verify what it wrote, show how a source splits among nodes, or
train a small BPE.

    isollm-data prepare --config configs/demo.yaml data.val_bucket=50 --out data/prepared
    isollm-data verify data/prepared
    isollm-data prepare --source /path/to/fineweb-sample --tokenizer tok/ --out data/prepared --max-tokens 1e8
    isollm-data plan HuggingFaceFW/fineweb --name sample-10BT --world-size 64 --workers 2
    isollm-data train-tokenizer --vocab-size 8192 --out tok/ /path/to/fineweb-sample
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llm.cli.arg_types import at_least
from llm.config import DataConfig, read_yaml
from llm.errors import one_line_warnings
from llm.model.config import ConfigError

__all__ = ["main"]

# Flags that stand for a ``data.*`` override.
SHORTCUTS = (("source", "data.source"), ("name", "data.name"), ("tokenizer", "data.tokenizer"),
             ("val_bucket", "data.val_bucket"))


def _data_config(args: argparse.Namespace) -> DataConfig:
    """The ``data`` section of the run config files, then ``data.key=value`` overrides and the shortcut
    flags: only what reading and tokenizing need (no training fields are required)."""
    overrides = list(args.overrides)
    for flag, key in SHORTCUTS:
        if getattr(args, flag, None) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    for override in overrides:
        if not override.startswith("data.") or "=" not in override:
            raise ConfigError(override, "expected a data.key=value override")
    try:
        sections = [read_yaml(Path(f)).get("data") or {} for f in args.config]  # with their defaults:
        node = OmegaConf.merge(OmegaConf.structured(DataConfig), *sections,
                               OmegaConf.from_dotlist([o.removeprefix("data.") for o in overrides]))
        config = OmegaConf.to_object(node)
    except OmegaConfBaseException as err:
        raise ConfigError(f"data.{getattr(err, 'full_key', '') or ''}", str(err).splitlines()[0]) from None
    assert isinstance(config, DataConfig)
    return config.validate()


def _prepare(args: argparse.Namespace) -> int:
    """Prepare into ``--out`` under its lock (``llm.train.lock``): a second prepare into the same directory, which
    would append to the token files the first one writes, stops in one line naming the first."""
    from llm.data.shards import prepare
    from llm.data.tokenizer import load_tokenizer
    from llm.train.lock import RunLock

    data_cfg = _data_config(args)
    start = time.perf_counter()
    lock = RunLock.acquire(args.out, advice="wait for that prepare to end, or choose another --out")
    try:
        index = prepare(data_cfg, load_tokenizer(data_cfg.tokenizer), args.out, args.max_tokens)
    finally:
        lock.release()
    tokens = sum(p["num_tokens"] for p in index["pieces"])
    docs = sum(p["num_docs"] for p in index["pieces"])
    held_out = sum(p["num_held_out"] for p in index["pieces"])
    seconds = time.perf_counter() - start
    print(f"prepared {docs:,} training documents ({held_out:,} more held out for validation, 1 in "
          f"{data_cfg.val_bucket}), {tokens:,} tokens from {len(index['pieces'])} piece(s) at {args.out} "
          f"({seconds:.1f} s, {tokens / max(seconds, 1e-9):,.0f} tokens/s)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from llm.data.prepared_index import verify

    problems, summary = verify(Path(args.dir))
    for problem in problems:
        print(f"isollm-data verify: damaged: {problem}", file=sys.stderr)
    if not problems:
        print(f"OK {summary}")
    return 1 if problems else 0


def _plan(args: argparse.Namespace) -> int:
    from llm.data.plan import print_plan

    data_cfg = _data_config(args)
    if data_cfg.seed == "run":  # the order is each run's own
        raise ConfigError("data.seed", "run: a run's data order is its seed; plan one with data.seed=<that seed>")
    print_plan(data_cfg, args.world_size, args.workers, args.sample_docs)
    return 0


def _train_tokenizer(args: argparse.Namespace) -> int:
    from llm.data.tokenizer import train_tokenizer

    tok = train_tokenizer(args.files, args.vocab_size, args.out, text_column=args.text_column)
    print(f"trained a byte-level BPE of {tok.get_vocab_size():,} tokens -> {args.out}")
    return 0


def _data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], help="run config YAML (repeatable, merged); "
                        "only its data section is read")
    parser.add_argument("--name", help="shortcut for data.name=...")
    parser.add_argument("--tokenizer", help="shortcut for data.tokenizer=...")
    parser.add_argument("--val-bucket", type=int, help="shortcut for data.val_bucket=...")
    parser.add_argument("overrides", nargs="*", help="data overrides such as data.val_bucket=50")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="isollm-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="pre-tokenize training documents into uint32 memmap files")
    prep.add_argument("--out", required=True, help="output directory (then set data.prepared to it)")
    prep.add_argument("--source", help="shortcut for data.source=...")
    prep.add_argument("--max-tokens", type=at_least(1, lambda s: int(float(s))),
                      help="whole documents in source order up to the first that reaches this many tokens (so at most "
                      "one document more; default: the whole source)")
    _data_arguments(prep)
    prep.set_defaults(run=_prepare)
    check = commands.add_parser("verify", help="check a prepared directory's token files against the sizes, "
                                "checksums and pieces its index.json records (one line per damaged file, exit 1)")
    check.add_argument("dir", help="the prepared directory (isollm-data prepare --out)")
    check.set_defaults(run=_verify)
    plan = commands.add_parser("plan", help="how one epoch of a source splits among ranks x workers")
    plan.add_argument("source", help="hub dataset id, local repository directory, or files (data.source)")
    plan.add_argument("--world-size", type=at_least(1), required=True)
    plan.add_argument("--workers", type=at_least(0), default=0,
                      help="DataLoader workers per process (data.num_workers)")
    plan.add_argument("--sample-docs", type=at_least(1), default=256,
                      help="documents tokenized to estimate tokens per document (or per byte)")
    _data_arguments(plan)
    plan.set_defaults(run=_plan)
    train = commands.add_parser("train-tokenizer", help="train a byte-level BPE on local files")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--out", required=True, help="tokenizer.json path or directory")
    train.add_argument("--text-column", default="text", help="column of parquet/jsonl files holding the text")
    train.add_argument("files", nargs="+", help="text/parquet/jsonl files, directories or globs")
    train.set_defaults(run=_train_tokenizer)
    return parser


def main(argv: list[str] | None = None) -> int:
    one_line_warnings()
    parser = _parser()
    # Overrides may also follow options (``plan SRC --world-size 2 data.seed=1``): argparse fills a positional
    # list only from the arguments before the first option, and leaves later ones unrecognised.
    args, extra = parser.parse_known_args(argv)
    if stray := [arg for arg in extra if arg.startswith("-") or "=" not in arg or not hasattr(args, "overrides")]:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.run(args)
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"isollm-data {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
