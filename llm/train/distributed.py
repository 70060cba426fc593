"""The few torch.distributed facts the trainer needs, read from torch rather than from Accelerate.

Through Accelerate on CPU with DeepSpeed, ``process_index`` / ``num_processes`` read 0 / 1 on every
rank (seen with accelerate 1.15 and deepspeed 0.19), so data sharding and cross-rank agreement use
``torch.distributed`` directly whenever a process group exists.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

__all__ = ["all_ranks_agree", "disagreement", "gather_messages", "is_distributed", "is_main_process",
           "rank_and_world_size"]

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world_size() -> tuple[int, int]:
    """``(rank, world_size)`` of the process group, ``(0, 1)`` without one."""
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """Rank 0 of the process group (or the only process): the one that writes shared files."""
    return rank_and_world_size()[0] == 0


def all_ranks_agree(flag: bool, *, any_rank: bool) -> bool:
    """``flag`` reduced over ranks: True if it holds on any rank (``any_rank``) or on every rank."""
    if not is_distributed():
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if any_rank else dist.ReduceOp.MIN)
    return bool(t.item())


def gather_messages(message: T | None) -> list[T]:
    """Every rank's non-None ``message`` (an error: its text, or a picklable value that says what kind it is), in
    rank order: the same list on every rank, so every rank can stop with the same error."""
    if not is_distributed():
        return [message] if message is not None else []
    gathered: list[T | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    return [m for m in gathered if m is not None]


def disagreement(values: dict[str, int]) -> str | None:
    """Where a rank's ``values`` differ from rank 0's, as one line naming the rank and the value (the same line on
    every rank), or None when every rank has the same. A rank that would run one step or micro-batch more than the
    others would wait in a collective that never comes: this is asked once before the first step."""
    gathered = gather_messages(values)
    for rank, theirs in enumerate(gathered):
        for key, value in theirs.items():
            if value != gathered[0][key]:
                return (f"rank {rank} disagrees with rank 0 on {key} ({value} vs {gathered[0][key]}): every rank must "
                        f"run the same steps and micro-batches")
    return None
