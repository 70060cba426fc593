"""``isollm-params``: parameter counts of a configured model, without building it (meta device).

    isollm-params configs/sizes/83m.yaml
    isollm-params configs/sizes/83m.yaml --config exp.yaml model.ffn=isogmlp model.ffn_param_match=true

Prints the total and non-embedding parameter counts (SPEC.md, "Sizes") and the FFN's resolved
intermediate size, which ``ffn_param_match`` shrinks for the wider variants.
"""

from __future__ import annotations

import argparse

from llm.config import ConfigError, load_config
from llm.model import param_counts
from llm.model.ffn import resolve_intermediate_size

# A size preset holds only a `model:` section and so no training budget, which RunConfig.validate
# requires; this placeholder satisfies it (files or overrides that set one win) and is never used.
_PLACEHOLDER_BUDGET = "train.max_steps=1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="isollm-params", description=__doc__.split("\n\n")[0])
    parser.add_argument("size", help="a YAML config, e.g. configs/sizes/83m.yaml")
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="more YAML files merged after SIZE (repeatable)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. model.ffn=iso_ln")
    args = parser.parse_args(argv)
    try:
        config = load_config([args.size, *args.config], [_PLACEHOLDER_BUDGET, *args.overrides]).model
    except ConfigError as err:
        parser.exit(2, f"isollm-params: error: {err}\n")
    total, non_embedding = param_counts(config)
    print(f"variant:               {config.variant_name}")
    print(f"total parameters:      {total:,}")
    print(f"non-embedding:         {non_embedding:,}")
    print(f"embedding:             {total - non_embedding:,} (vocab {config.vocab_size:,} x hidden "
          f"{config.hidden_size}, {'tied' if config.tie_word_embeddings else 'untied: input + output'})")
    print(f"ffn intermediate size: {resolve_intermediate_size(config)} "
          f"(config {config.intermediate_size}{', parameter-matched' if config.ffn_param_match else ''})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
