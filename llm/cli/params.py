"""``isollm-params``: parameter counts of a configured model, without building it (meta device).

    isollm-params configs/sizes/83m.yaml
    isollm-params configs/sizes/83m.yaml --config exp.yaml model.ffn=isogmlp model.ffn_param_match=true
    isollm-params configs/sizes/134m.yaml --plan --mode fsdp2 --gpus 8 --gpu-mem 80 --seq-len 2048

Prints the total and non-embedding parameter counts (the size presets are named by the total with the tied
Qwen3 vocabulary, so the non-embedding count says how much is decoder) and the FFN's resolved
intermediate size, which ``ffn_param_match`` shrinks for the wider variants. ``--plan`` adds the estimated
memory per GPU of training it (``llm.memory_plan``) and the largest micro batch that fits.
"""

from __future__ import annotations

import argparse

from llm.config import PLACEHOLDER_BUDGET, ConfigError, load_config
from llm.memory_plan import MODES, RESERVED_FRACTION, checkpointed_layers, largest_micro_batch, plan_memory
from llm.model import ModelConfig, param_counts
from llm.model.ffn import resolve_intermediate_size
from llm.model.modeling_isollm import meta_model, mup_scaled_parameters
from llm.train.optim import check_engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="isollm-params", description=__doc__.split("\n\n")[0])
    parser.add_argument("size", help="a YAML config, e.g. configs/sizes/83m.yaml")
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="more YAML files merged after SIZE (repeatable)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. model.ffn=iso_ln")
    plan = parser.add_argument_group("memory plan")
    plan.add_argument("--plan", action="store_true", help="also print the estimated memory per GPU")
    plan.add_argument("--mode", choices=MODES, default="ddp", help="launch mode (default ddp)")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs the run is sharded over (default 1)")
    plan.add_argument("--gpu-mem", type=float, default=80.0, metavar="GIB", help="memory of one GPU (default 80)")
    plan.add_argument("--seq-len", type=int, default=None, help="default: the config's data.seq_len")
    plan.add_argument("--micro-batch", type=int, default=None, help="default: the config's train.micro_batch_size")
    plan.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_intermixed_args(argv)  # overrides may follow options (--plan key=value)
    try:
        run = load_config([args.size, *args.config], [PLACEHOLDER_BUDGET, *args.overrides])
        if args.plan:
            check_engine(run, args.mode)  # a muon run under a sharding mode: refused as train.py refuses it
    except ConfigError as err:
        parser.exit(2, f"isollm-params: error: {err}\n")
    config = run.model
    total, non_embedding = param_counts(config)
    print(f"variant:               {config.variant_name}")
    print(f"total parameters:      {total:,}")
    print(f"non-embedding:         {non_embedding:,}")
    print(f"embedding:             {total - non_embedding:,} (vocab {config.vocab_size:,} x hidden "
          f"{config.hidden_size}, {'tied' if config.tie_word_embeddings else 'untied: input + output'})")
    print(f"ffn intermediate size: {resolve_intermediate_size(config)} "
          f"(config {config.intermediate_size}{', parameter-matched' if config.ffn_param_match else ''})")
    print_parametrization(config)
    if args.plan:
        if args.gpus < 1 or args.gpu_mem <= 0:
            parser.exit(2, "isollm-params: error: --gpus and --gpu-mem: expected positive numbers\n")
        print_plan(config, args.mode, args.gpus, args.gpu_mem * 2**30, args.seq_len or run.data.seq_len,
                   args.micro_batch or run.train.micro_batch_size, args.precision, run.train.activation_checkpointing,
                   run.train.optimizer)
    return 0


def print_parametrization(config: ModelConfig) -> None:
    """What ``parametrization=mup`` scales at this width (``ModelConfig.parametrization``)."""
    if config.parametrization != "mup":
        print("parametrization:       standard (nothing scaled with width)")
        return
    m = config.width_multiplier
    hidden = sum(p.numel() for p in mup_scaled_parameters(meta_model(config)))
    print(f"parametrization:       muP, base width {config.mup_base_hidden_size}, m = {m:g}")
    print(f"  hidden matrices:     {hidden:,} parameters (qkv, o, FFN in/down, isogmlp's gate): init std "
          f"{config.hidden_init_std:.4g} (= {config.initializer_range:g} / sqrt(m)), Adam lr x {1 / m:.4g}")
    print(f"  logits:              x {1 / m:.4g}; attention scores q.k x sqrt({config.mup_base_head_dim}) / "
          f"{config.resolved_head_dim} (standard: / sqrt({config.resolved_head_dim}); q x {config.query_scale:.4g})")
    print("  not scaled:          embedding, norms, mixing parameters but isogmlp's gate, focus centres and apertures")


def print_plan(config: ModelConfig, mode: str, gpus: int, gpu_bytes: float, seq_len: int, micro_batch: int,
               precision: str, checkpoint_every: int = 0, optimizer: str = "adamw") -> None:
    plan = plan_memory(config, mode, gpus, micro_batch, seq_len, precision, checkpoint_every, optimizer)
    gib = 2**30
    layers = checkpointed_layers(config.num_hidden_layers, checkpoint_every)
    print(f"memory plan:           {mode} over {gpus} GPU(s) of {gpu_bytes / gib:.0f} GiB, {precision}, {optimizer}, "
          f"seq_len {seq_len}, micro batch {micro_batch}, activation checkpointing "
          f"{f'{layers} of {config.num_hidden_layers} layers' if layers else 'off'} (estimates, GiB per GPU)")
    for part in ("weights", "gradients", "optimizer", "activations", "logits"):
        print(f"  {part + ':':<20} {getattr(plan, part) / gib:8.2f}")
    usable = (1 - RESERVED_FRACTION) * gpu_bytes
    print(f"  {'total:':<20} {plan.total / gib:8.2f} of {usable / gib:.1f} usable "
          f"({'fits' if plan.total <= usable else 'does NOT fit'})")
    print(f"largest micro batch:   "
          f"{largest_micro_batch(config, mode, gpus, gpu_bytes, seq_len, precision, checkpoint_every, optimizer)} "
          f"at seq_len {seq_len}")


if __name__ == "__main__":
    raise SystemExit(main())
