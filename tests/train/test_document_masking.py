"""``data.document_masking`` and ``train.activation_checkpointing`` through the trainer: training and validation score
packed documents apart, as each alone, and checkpointing changes no number of a run."""

from __future__ import annotations

import pytest
import torch
from tiny import metrics_rows, trajectory, write_docs

from llm.config import read_saved
from llm.data.packing import model_inputs
from llm.model import IsoLLMConfig, IsoLLMForCausalLM
from llm.train.evaluate import evaluate, lm_loss

EOS = 3


def fp64_model(**overrides) -> IsoLLMForCausalLM:
    torch.manual_seed(0)
    config = IsoLLMConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, iso_tanh_chunk_size=4, **overrides)
    return IsoLLMForCausalLM(config).double().eval()


@pytest.mark.parametrize("variant", [dict(ffn="swiglu"), dict(ffn="isogmlp", attn_scoring="iso_tanh")],
                         ids=["swiglu+softmax", "isogmlp+iso_tanh"])
def test_validation_loss_scores_each_packed_document_alone(variant) -> None:
    """A window ``first + [EOS] + second`` (fp64): the masked validation loss is the loss of ``first + [EOS]`` alone
    (its last output predicting ``second[0]``: it sees only the document it closes) plus that of ``second`` alone."""
    model = fp64_model(**variant)
    first = torch.tensor([[5, 9, 17, 4, 30, 8, 12]])
    second = torch.tensor([[21, 7, 7, 40, 2, 11, 19, 6, 50]])
    window = torch.cat([first, torch.tensor([[EOS]]), second], dim=1)  # 17 tokens: 16 inputs, 16 targets

    closed = torch.cat([first, torch.tensor([[EOS]])], dim=1)
    with torch.no_grad():
        first_loss = lm_loss(model(closed).logits, torch.cat([closed[:, 1:], second[:, :1]], 1), "sum")
        second_loss = lm_loss(model(second[:, :-1]).logits, second[:, 1:], "sum")
    alone = ((first_loss + second_loss) / 16).item()

    masked = evaluate(model, window, micro_batch_size=1, document_eos=EOS)["val_loss"]
    unmasked = evaluate(model, window, micro_batch_size=1)["val_loss"]
    assert masked == pytest.approx(alone, rel=1e-6)  # evaluate's cross-entropy runs in fp32, as training's
    assert abs(unmasked - alone) > 1e-3  # the second document saw the first


def test_model_inputs_restart_positions_after_eos() -> None:
    inputs = torch.tensor([[1, EOS, 4, 5, EOS, EOS, 6]])
    assert model_inputs(inputs, None).keys() == {"input_ids"}
    assert model_inputs(inputs, EOS)["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 0]]


def test_runs_saved_before_document_masking_read_back_unmasked(tiny_overrides) -> None:
    """A run saved before the option existed trained with documents visible to each other."""
    saved = {"data": {"seq_len": 32}, "train": {"max_steps": 3}}
    assert read_saved(saved).data.document_masking is False
    assert read_saved({**saved, "data": {"seq_len": 32, "document_masking": True}}).data.document_masking is True


def test_masked_and_unmasked_runs_differ_and_record_the_choice(tiny_config, tmp_path) -> None:
    """On documents cut to 100 characters (a few EOS in every 33-token window), masking changes every number; the
    sample's whole documents, thousands of tokens each, would rarely put one in a window."""
    from llm.train.trainer import fit

    short_docs = write_docs(tmp_path / "short", count=2000, num_files=1, chars=100)
    overrides = ("train.max_steps=4", "train.eval_every=4", f"data.source={short_docs}", "data.val_tokens=512",
                 f"data.cache_dir={tmp_path / 'cache'}")
    masked = fit(tiny_config(*overrides, "name=masked"))
    unmasked = fit(tiny_config(*overrides, "name=unmasked", "data.document_masking=false"))
    for run, flag in ((masked, True), (unmasked, False)):
        (meta,) = metrics_rows(run.run_dir, "meta")
        assert meta["config"]["data"]["document_masking"] is flag
    assert trajectory(masked.run_dir)[0][1] != trajectory(unmasked.run_dir)[0][1]
    logged = [metrics_rows(run.run_dir, "eval")[-1]["val_loss"] for run in (masked, unmasked)]
    assert logged[0] != logged[1]
    # eval.py reads the choice from the run's config and reproduces each logged validation loss
    from llm.eval.evaluate import evaluate_checkpoint

    assert [evaluate_checkpoint(str(run.last_checkpoint), samples=0).val_loss for run in (masked, unmasked)] == logged


def test_activation_checkpointing_changes_no_number_of_a_run(tiny_config) -> None:
    """Every layer recomputed in the backward pass: the same losses, norms and validation loss, bit for bit."""
    from llm.train.trainer import fit

    overrides = ("train.max_steps=4", "train.eval_every=4", "model.ffn=isogmlp")
    plain = fit(tiny_config(*overrides, "name=plain"))
    checkpointed = fit(tiny_config(*overrides, "name=checkpointed", "train.activation_checkpointing=1"))
    assert trajectory(checkpointed.run_dir) == trajectory(plain.run_dir)
    last_val = lambda run: metrics_rows(run.run_dir, "eval")[-1]["val_loss"]  # noqa: E731
    assert last_val(checkpointed) == last_val(plain)


@pytest.mark.parametrize(("scoring", "masking", "device", "expected"), [
    ("softmax", True, "cuda", "flex_attention"), ("softmax", False, "cuda", None), ("softmax", True, "cpu", None),
    ("iso_tanh", True, "cuda", None)])
def test_training_names_the_attention_that_runs(scoring, masking, device, expected) -> None:
    """Packed documents on CUDA are a block mask that only FlexAttention takes: training softmax there selects
    ``flex_attention`` (not ``sdpa`` running FlexAttention under its name); elsewhere the default stays. The model
    takes that choice and gives the same fp64 logits on packed documents (one FlexAttention method for both)."""
    from llm.config import DataConfig, RunConfig
    from llm.model.config import ModelConfig
    from llm.train.setup import train_attention

    config = RunConfig(model=ModelConfig(attn_scoring=scoring), data=DataConfig(document_masking=masking))
    assert train_attention(config, torch.device(device)) == expected
    if expected is not None:  # no grad: FlexAttention has no backward on CPU
        model = fp64_model(attn_scoring=scoring).requires_grad_(False)
        ids, positions = torch.randint(4, 64, (1, 8)), torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
        before = model(ids, position_ids=positions).logits
        model.set_attn_implementation(expected)
        assert model.config._attn_implementation == expected
        torch.testing.assert_close(model(ids, position_ids=positions).logits, before, rtol=1e-10, atol=1e-10)
