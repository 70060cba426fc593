"""Test-side worker: a few optimizer steps of the tiny model under DDP, FSDP2 or DeepSpeed ZeRO-2/3 on CPU.

Under torchrun (2 processes) each rank draws its micro-batches from the real training loader
(``build_train_loader`` with its torch.distributed rank), checks after every step that all ranks hold
bit-identical full parameters, and writes ``batches_rank<r>.pt`` plus ``result.pt`` (per-step losses,
final full parameters). Run as one plain process with ``--reference DIR`` it replays the batches of the
2-process run in DIR as gradient-accumulation micro-batches through the trainer's ``train_step``: the
same global batch, so the losses, the per-group gradient norms and the parameters must agree to fp32
round-off. ``--runs`` names the runs one launch makes in turn (``RUNS``), each into its own folder: ``bf16`` runs
each engine's bf16 mode as on a GPU (Accelerate's autocast, FSDP2's bf16 ``param_dtype``, DeepSpeed's bf16);
``focus`` gives the FFN focusing-neuron input projections whose apertures start at the top of their clip range, so
the clipping after each step decides their values.

    torchrun --nproc_per_node 2 dist_worker.py --mode fsdp2 --runs plain bf16 --out DIR --data SRC --tokenizer TOK
    python dist_worker.py --mode fsdp2 --out REF --data SRC --tokenizer TOK --reference DIR/plain

Why not Accelerate for FSDP2 / ZeRO: on CPU Accelerate ignores its FSDP plugin and reports rank 0 of
1 under DeepSpeed (verified on CPU with accelerate 1.15), so the engines are used directly; DDP goes through Accelerate
exactly as train.py does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from llm.config import RunConfig, load_config
from llm.data import build_train_loader, load_tokenizer
from llm.metrics.gradnorm import GroupGradNorms, grad_norm_groups
from llm.train.deepspeed_step import deepspeed_backward
from llm.train.distributed import rank_and_world_size
from llm.train.optim import build_optimizer, multiplier_of, set_schedule
from llm.train.setup import build_model
from llm.train.step import gradient_accumulation_steps, train_step

STEPS = 3
LR = 3e-3
TINY = [
    "model.vocab_size=512", "model.hidden_size=32", "model.intermediate_size=64",
    "model.num_hidden_layers=2", "model.num_attention_heads=2", "model.num_key_value_heads=1",
    "model.max_position_embeddings=64", "data.seq_len=32", "data.shuffle_block=8", "data.val_bucket=50",
    f"train.lr={LR}", "train.warmup_steps=1", f"train.max_steps={STEPS}", "train.micro_batch_size=4",
    "train.global_batch_tokens=256", "train.grad_clip=1.0", "trackers=[]",
]
# sigma starts at the top of Algorithm 3's range and moves 10x faster than the weights: about half the apertures
# step above 1.0 at once and only the clip brings them back
FOCUS = ["model.ffn_linear=focus", "model.focus_sigma_init=1.0", "model.focus_sigma_lr_mult=10",
         "model.focus_mu_lr_mult=10"]
DEEPSPEED_DIR = Path(__file__).resolve().parents[2] / "launch" / "deepspeed"


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered in full (a collective under FSDP2 and ZeRO-3: call on all ranks)."""
    gathered = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # ZeRO-3 holds each rank's partition only
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))
    out = {}
    with gathered:
        for name, p in model.named_parameters():
            t = p.detach()
            out[name.removeprefix("module.")] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def assert_ranks_identical(params: dict[str, torch.Tensor], step: int) -> None:
    flat = torch.cat([p.flatten() for p in params.values()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for rank, other in enumerate(gathered):
        if not torch.equal(other, gathered[0]):
            raise AssertionError(f"step {step}: rank {rank}'s parameters differ from rank 0's by "
                                 f"{(other - gathered[0]).abs().max().item():.3e}")


def assert_disjoint(batches: torch.Tensor) -> None:
    """No training window of this rank appears on another rank."""
    gathered = [torch.empty_like(batches) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, batches)
    seen = [{tuple(row.tolist()) for row in b.flatten(0, 1)} for b in gathered]
    shared = set.intersection(*seen)
    if shared:
        raise AssertionError(f"{len(shared)} training windows were given to every rank")


def deepspeed_engine(model: nn.Module, config: RunConfig, accum: int, stage: int) -> nn.Module:
    """``deepspeed.initialize`` with launch/deepspeed/zero<stage>.json, its "auto" values filled as
    Accelerate fills them (from the trainer's micro batch, accumulation, clipping and precision)."""
    import deepspeed

    ds = json.loads((DEEPSPEED_DIR / f"zero{stage}.json").read_text())
    world = dist.get_world_size()
    ds.update(train_micro_batch_size_per_gpu=config.train.micro_batch_size, gradient_accumulation_steps=accum,
              train_batch_size=config.train.micro_batch_size * accum * world,
              gradient_clipping=config.train.grad_clip, bf16={"enabled": config.train.precision == "bf16"})
    # every parameter of the tiny model is below the file's 100k-element threshold: partition them all,
    # so that each forward has to gather its weights (the LM head's too, inside the fused loss)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    optimizer = build_optimizer(model, config)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    if stage == 3:  # outside a forward each rank holds an empty placeholder for every full weight
        assert all(p.numel() == 0 for p in engine.module.parameters()), "ZeRO-3 left weights whole"
    return engine


def deepspeed_step(engine: nn.Module, batches: list[torch.Tensor], grad_groups: GroupGradNorms) -> float:
    """One optimizer step through the trainer's ``deepspeed_backward``: DeepSpeed scales by accumulation, reduces
    and clips inside backward/step; the group norms are measured before the step, focus clipped after it."""
    loss_sum = torch.zeros(())
    for i, batch in enumerate(batches):
        loss = engine(input_ids=batch[:, :-1], shift_labels=batch[:, 1:], fused_loss=True).loss
        norms = deepspeed_backward(engine, loss, i == len(batches) - 1, grad_groups)
        loss_sum += loss.detach()
    grad_groups.record(norms.tolist())
    dist.all_reduce(loss_sum)
    return (loss_sum / (len(batches) * dist.get_world_size())).item()


def measured_group_norms(grad_groups: GroupGradNorms, step: int) -> dict[str, float]:
    """The pre-clip norm of each parameter group measured in step ``step``."""
    fields = grad_groups.update(step)
    return {name: fields[f"grad_norm_{name}"] for name in grad_groups.groups}


RUNS = {
    "plain": [],
    "activation_checkpointing": ["train.activation_checkpointing=1"],  # every layer recomputed in the backward
    "bf16": ["train.precision=bf16"],
    "focus": FOCUS,
    "muon": ["train.optimizer=muon"],
}
"""The runs one launch can make, each on the same batches (the data settings are ``TINY``'s in all): name -> its
overrides. One launch runs several in turn (the process group, imports and engine set up once; each run builds its
model afresh from the seed), so that the suite pays a 2-process start-up per engine, not per run."""


def init_distributed(zero_stage: int | None, ddp_bf16: bool) -> Accelerator | None:
    """The process group: DeepSpeed's for ZeRO, else Accelerate's (from torchrun's environment, as train.py does;
    bf16 autocast for DDP's bf16 run, which Accelerate fixes per process)."""
    if zero_stage is None:
        return Accelerator(cpu=True, mixed_precision="bf16" if ddp_bf16 else "no")
    import importlib

    import deepspeed

    # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op at init (a C++ build,
    # minutes on a busy machine); without it DeepSpeed uses gloo's all-reduce, the same numbers.
    # (``deepspeed.comm.torch`` as an attribute is the torch package: patch the module itself.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    return None


def run_one(mode: str, zero_stage: int | None, config: RunConfig, out: Path, reference: Path | None,
            accelerator: Accelerator | None) -> None:
    """One run of ``STEPS`` steps into ``out`` (``result.pt``; its batches unless replaying ``reference``'s)."""
    out.mkdir(parents=True, exist_ok=True)
    bf16 = config.train.precision == "bf16"
    rank, world = rank_and_world_size()
    accum = gradient_accumulation_steps(config, world)
    torch.manual_seed(config.seed)
    model = build_model(config.model)
    if config.train.activation_checkpointing:  # as the trainer does it: before DDP / fully_shard / deepspeed
        model.activation_checkpointing_enable(every_n_layers=config.train.activation_checkpointing)
    if mode == "fsdp2" and world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16: FSDP2 casts the gathered weights to bf16 and reduces the gradients in fp32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                      reduce_dtype=torch.float32 if bf16 else None)
        for layer in model.model.layers:  # the wrap unit of launch/accelerate/fsdp2.yaml
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    # after fully_shard, which replaces the parameters with DTensor ones (the trainer builds it after prepare)
    grad_groups = GroupGradNorms(grad_norm_groups(model, multiplier_of(model).keys()), window=STEPS, warmup_steps=1)

    if reference is not None:
        per_rank = [torch.load(reference / f"batches_rank{r}.pt") for r in range(2)]
        steps = [[per_rank[r][i] for r in range(2)] for i in range(STEPS)]
    else:
        loader = iter(build_train_loader(config.data, load_tokenizer(config.data.tokenizer),
                                         config.train.micro_batch_size, rank, world))
        steps = [[next(loader) for _ in range(accum)] for _ in range(STEPS)]
        mine = torch.stack([b for step in steps for b in step])
        torch.save(mine, out / f"batches_rank{rank}.pt")
        assert_disjoint(mine)

    if zero_stage:
        engine = deepspeed_engine(model, config, accum, zero_stage)
        run_step = lambda batches: deepspeed_step(engine, batches, grad_groups)  # noqa: E731
        module, optimizer = engine.module, engine.optimizer
    else:
        optimizer = build_optimizer(model, config)
        if mode == "ddp":
            model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.gradient_accumulation_steps = accum
        run_step = lambda batches: train_step(model, batches, optimizer, accelerator,  # noqa: E731
                                              config.train.grad_clip, grad_groups=grad_groups).loss
        module = model

    losses, group_norms = [], []
    for i, batches in enumerate(steps):
        set_schedule(optimizer, config, STEPS, i)  # as fit() does before every step
        losses.append(run_step(batches))
        group_norms.append(measured_group_norms(grad_groups, i + 1))
        params = full_params(module)
        if world > 1:
            assert_ranks_identical(params, i + 1)
    if rank == 0:
        torch.save({"losses": losses, "group_norms": group_norms, "params": params, "world_size": world,
                    "accum": accum}, out / "result.pt")
    if mode == "fsdp2" and world > 1:
        import torch.distributed.checkpoint as dcp

        # Sharded save (each rank writes its shards), as accelerator.save_state does under FSDP2.
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(out / "dcp"))
    if zero_stage:
        engine.destroy()  # ZeRO-3's hooks on the module and its partitioned parameters go with it
    elif accelerator is not None:
        accelerator.free_memory()  # the prepared model and optimizer, before the next run's


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "fsdp2", "zero2", "zero3"), required=True)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=["plain"], help="in turn, each into OUT/<run>")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--reference", type=Path, help="replay the batches of the 2-process run in this folder in "
                                                       "one process")
    args = parser.parse_args()
    configs = {name: load_config(None, [*TINY, f"data.source={args.data}", f"data.tokenizer={args.tokenizer}",
                                        f"data.cache_dir={args.out / 'data_cache'}", *RUNS[name]])
               for name in args.runs}
    # the one-process reference replays the batches through the trainer's step, whatever the engine
    zero_stage = {"zero2": 2, "zero3": 3}.get(args.mode) if args.reference is None else None
    ddp_bf16 = args.mode == "ddp" and "bf16" in args.runs
    if ddp_bf16 and len(args.runs) > 1:
        parser.error("DDP's bf16 run needs a launch of its own (Accelerate fixes the precision per process)")
    accelerator = init_distributed(zero_stage, ddp_bf16)
    for name, config in configs.items():
        run_one(args.mode, zero_stage, config, args.out / name, args.reference, accelerator)
    if rank_and_world_size()[1] > 1:  # avoids gloo's abort at interpreter exit (verified on CPU)
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
