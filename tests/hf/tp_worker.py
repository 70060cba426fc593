"""Test-side worker: under torchrun (2 CPU processes, gloo) each rank loads every fp64 checkpoint directory given on
the command line twice, whole and with transformers' tensor-parallel plan (``tp_plan="auto"``), and checks that the
plan shards the vocabulary (embedding and LM head) and computes what the whole model computes: eval logits and loss,
the training loss and every parameter's gradient, greedy ``generate()``. Any difference fails the process.

    torchrun --nproc_per_node 2 tests/hf/tp_worker.py CHECKPOINT_DIR ...
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import DistributedConfig

import llm  # noqa: F401  (registers the Auto classes)
from llm.model import IsoLLMForCausalLM

# fp64 round-off only: the sharded head sums each logit's d products as the whole one does; the training loss and
# gradients differ in summation order (the whole model's fused loss, the sharded one's gathered logits).
close = functools.partial(torch.testing.assert_close, rtol=1e-12, atol=1e-12)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def check(directory: str) -> None:
    whole = IsoLLMForCausalLM.from_pretrained(directory, dtype=torch.float64)
    sharded = IsoLLMForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                distributed_config=DistributedConfig(tp_plan="auto"))
    vocab = whole.config.vocab_size
    rank_rows = -(-vocab // 2) if dist.get_rank() == 0 else vocab // 2  # the last rank holds the shorter slice
    for head_or_embedding in (sharded.model.embed_tokens.weight, sharded.lm_head.weight):
        assert isinstance(head_or_embedding, DTensor) and head_or_embedding.to_local().shape[0] == rank_rows
    assert (sharded.lm_head.weight is sharded.model.embed_tokens.weight) == whole.config.tie_word_embeddings

    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    whole.eval(), sharded.eval()
    with torch.no_grad():
        expected, got = whole(ids, attention_mask=mask, labels=ids), sharded(ids, attention_mask=mask, labels=ids)
    close(got.logits, expected.logits)
    close(got.loss, expected.loss)
    greedy = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(sharded.generate(ids, **greedy), whole.generate(ids, **greedy))

    whole.train(), sharded.train()
    expected, got = whole(ids, labels=ids), sharded(ids, labels=ids)
    close(got.loss, expected.loss)
    expected.loss.backward()
    got.loss.backward()
    for (name, param), sharded_param in zip(whole.named_parameters(), sharded.parameters(), strict=True):
        close(full(sharded_param.grad), param.grad, msg=lambda text, name=name: f"{name}.grad: {text}")


if __name__ == "__main__":
    for checkpoint in sys.argv[1:]:
        check(checkpoint)
    print(f"rank {dist.get_rank()}: {len(sys.argv) - 1} checkpoints sharded exactly")
