"""The memory planner against what a training step really holds on CPU (fp32, one process): weights, gradients
and AdamW state exactly, and the activations autograd keeps (counted through saved-tensor hooks, a deterministic
count rather than a noisy process measurement) within 10% at shapes other than those its coefficients came from."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llm.cli.params import main
from llm.config import load_config
from llm.memory_plan import activation_bytes, checkpointed_layers, largest_micro_batch, plan_memory, recompute_bytes
from llm.model import IsoLLMConfig, IsoLLMForCausalLM, ModelConfig, param_counts
from llm.train.optim import build_optimizer

SHAPE = ModelConfig(vocab_size=384, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                    num_key_value_heads=3, head_dim=16, max_position_embeddings=256)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


def saved_for_backward(model: IsoLLMForCausalLM, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in the forward pass, the weights excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True)
    return storage_bytes(saved)


@pytest.mark.parametrize("ffn", ["swiglu", "isogmlp", "iso_ln", "iso_mlp"])
@pytest.mark.parametrize("scoring", ["softmax", "iso_tanh"])
def test_activation_estimate_within_10_percent_of_what_autograd_keeps(ffn: str, scoring: str) -> None:
    config = dataclasses.replace(SHAPE, ffn=ffn, attn_scoring=scoring)
    batch, seq = 3, 96
    torch.manual_seed(0)
    model = IsoLLMForCausalLM(IsoLLMConfig.from_model_config(config))
    measured = saved_for_backward(model, torch.randint(0, config.vocab_size, (batch, seq + 1)))
    # the fused LM head keeps the fp32 gradient of the tied embedding it computed in the forward pass
    estimate = activation_bytes(config, batch, seq, "fp32") + 4 * config.vocab_size * config.hidden_size
    assert 0.9 < estimate / measured < 1.1, (estimate, measured)


@pytest.mark.parametrize("every", [1, 2])
def test_checkpointed_layers_keep_only_their_input(every: int) -> None:
    """What autograd keeps after the forward pass with activation checkpointing, against the estimate less the
    one layer the backward pass recomputes at a time."""
    config = dataclasses.replace(SHAPE, num_hidden_layers=4)
    batch, seq = 3, 96
    torch.manual_seed(0)
    model = IsoLLMForCausalLM(IsoLLMConfig.from_model_config(config)).train()
    model.activation_checkpointing_enable(every_n_layers=every)
    measured = saved_for_backward(model, torch.randint(0, config.vocab_size, (batch, seq + 1)))
    estimate = (activation_bytes(config, batch, seq, "fp32", checkpoint_every=every)
                - recompute_bytes(config, batch, seq, "fp32") + 4 * config.vocab_size * config.hidden_size)
    assert 0.9 < estimate / measured < 1.1, (estimate, measured)
    assert checkpointed_layers(4, every) == 4 // every


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_static_memory_of_one_process_is_exact(tiny_overrides: list[str], name: str) -> None:
    """Weights, gradients and the state the run's optimizer holds after a step: AdamW's two moments, or Muon's one
    momentum buffer on its matrices and AdamW's moments on the rest (isogmlp's gate among them); AdamW's scalar step
    counters are left out."""
    shape = dataclasses.replace(SHAPE, ffn="isogmlp")
    config = dataclasses.replace(load_config(None, [*tiny_overrides, f"train.optimizer={name}"]), model=shape)
    torch.manual_seed(0)
    model = IsoLLMForCausalLM(IsoLLMConfig.from_model_config(shape))
    optimizer = build_optimizer(model, config)
    ids = torch.randint(0, shape.vocab_size, (2, 33))
    model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True).loss.backward()
    optimizer.step()
    plan = plan_memory(shape, "single", 1, 2, 32, precision="fp32", optimizer=name)
    params = list(model.parameters())
    assert plan.weights == storage_bytes(params) == 4 * param_counts(shape)[0]
    assert plan.gradients == storage_bytes([p.grad for p in params])
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.ndim > 0]
    assert plan.optimizer == storage_bytes(state)
    assert (plan.optimizer < 8 * param_counts(shape)[0]) == (name == "muon")


@pytest.mark.parametrize("mode", ["single", "ddp", "fsdp2", "zero2", "zero3"])
def test_largest_micro_batch_is_the_last_that_fits(mode: str) -> None:
    config = ModelConfig()  # the Qwen3-vocabulary default shape
    gpu = 80 * 2**30
    best = largest_micro_batch(config, mode, 8, gpu, 2048)
    assert best > 0
    assert plan_memory(config, mode, 8, best, 2048).total <= 0.9 * gpu < plan_memory(config, mode, 8, best + 1,
                                                                                       2048).total


def test_sharding_shrinks_the_static_memory_per_gpu() -> None:
    config = ModelConfig()
    static = {mode: plan_memory(config, mode, 8, 0, 2048) for mode in ("ddp", "fsdp2", "zero2", "zero3")}
    states = {mode: p.weights + p.gradients + p.optimizer for mode, p in static.items()}
    assert states["ddp"] > states["zero2"] > states["zero3"] and states["ddp"] > states["fsdp2"]


def test_plan_cli_prints_each_part_and_the_micro_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["configs/sizes/134m.yaml", "--plan", "--mode", "zero3", "--gpus", "8", "--gpu-mem", "80",
                 "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    for part in ("weights", "gradients", "optimizer", "activations", "logits", "largest micro batch"):
        assert part in out
    # the printed numbers are the planner's for this config, mode, GPU count, memory and seq_len (default bf16)
    config = load_config(["configs/sizes/134m.yaml"], ["train.max_steps=1"]).model
    gpu = 80 * 2**30
    plan = plan_memory(config, "zero3", 8, 8, 2048, "bf16")
    assert f"largest micro batch:   {largest_micro_batch(config, 'zero3', 8, gpu, 2048, 'bf16')} at seq_len 2048" in out
    assert f"  {'total:':<20} {plan.total / 2**30:8.2f} of {0.9 * gpu / 2**30:.1f} usable (fits)" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["configs/sizes/134m.yaml", "--plan", "--mode", "zero4"])
    assert exit_info.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # muon under a sharding mode: refused, as train.py refuses it
        main(["configs/sizes/134m.yaml", "train.optimizer=muon", "--plan", "--mode", "zero3"])
    assert exit_info.value.code == 2 and "train.optimizer: muon cannot train under zero3" in capsys.readouterr().err
