"""``train_step`` (gradient accumulation, non-finite skip) and ``evaluate`` against fp64 references."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from llm.config import load_config
from llm.metrics.gradnorm import GroupGradNorms, grad_norm_groups
from llm.model.lm_head import IGNORE_INDEX
from llm.train.evaluate import evaluate
from llm.train.optim import multiplier_of
from llm.train.setup import build_model
from llm.train.step import StepResult, _parameters_finite, train_step


@pytest.fixture
def tiny(tiny_overrides: list[str]):
    config = load_config(None, tiny_overrides)
    torch.manual_seed(0)
    return config, build_model(config.model)


def _sgd_step(model: nn.Module, batches: list[torch.Tensor]) -> tuple[nn.Module, StepResult]:
    """One train_step with SGD(lr=1), so the parameter change is exactly minus the gradient."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    accelerator.gradient_accumulation_steps = len(batches)
    model = copy.deepcopy(model)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    return model, train_step(model, batches, optimizer, accelerator, grad_clip=0.0)


def _one_sgd_step(model: nn.Module, batches: list[torch.Tensor]) -> tuple[nn.Module, float, float]:
    model, result = _sgd_step(model, batches)
    assert not result.skipped
    return model, result.loss, result.grad_norm


def test_a_micro_batch_without_targets_adds_no_gradient_and_is_counted(tiny) -> None:
    """Its loss is NaN (as F.cross_entropy's): before, its NaN gradients skipped the step (or, in a loop without the
    skip, poisoned every weight); now it adds nothing, the step applies the other micro-batch's half gradient."""
    config, model = tiny
    batch = torch.randint(0, config.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    no_targets = torch.tensor([[3, IGNORE_INDEX], [5, IGNORE_INDEX]])
    alone, alone_result = _sgd_step(model, [batch])
    both, result = _sgd_step(model, [batch, no_targets])
    assert not result.skipped and result.no_target_batches == 1 and alone_result.no_target_batches == 0
    assert result.loss == pytest.approx(alone_result.loss, rel=1e-6)
    for p0, p_alone, p_both in zip(model.parameters(), alone.parameters(), both.parameters(), strict=True):
        assert torch.isfinite(p_both).all()
        torch.testing.assert_close(p_both - p0, (p_alone - p0) / 2, rtol=1e-5, atol=1e-7)


def test_accumulation_matches_one_big_batch(tiny) -> None:
    config, model = tiny
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, config.model.vocab_size, (4, 17), generator=generator)
    big, loss_big, norm_big = _one_sgd_step(model, [batch])
    acc, loss_acc, norm_acc = _one_sgd_step(model, [batch[:2], batch[2:]])
    assert loss_acc == pytest.approx(loss_big, rel=1e-6)
    assert norm_acc == pytest.approx(norm_big, rel=1e-5)
    for (name, p_big), p_acc in zip(big.named_parameters(), acc.parameters(), strict=True):
        torch.testing.assert_close(p_acc, p_big, rtol=0, atol=2e-6, msg=name)
    # and the step really moved the weights by the gradient of the mean loss
    ref = copy.deepcopy(model)
    loss = F.cross_entropy(ref(input_ids=batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    for p_ref, p_big in zip(ref.parameters(), big.parameters(), strict=True):
        torch.testing.assert_close(p_ref - p_ref.grad, p_big, rtol=0, atol=2e-6)
    assert loss_big == pytest.approx(loss.item(), rel=1e-6)


def test_grad_norm_is_pre_clip(tiny) -> None:
    config, model = tiny
    accelerator = Accelerator(cpu=True)
    model = copy.deepcopy(model)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    batch = torch.randint(0, config.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    loss = F.cross_entropy(model(input_ids=batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    norms = torch.stack([p.grad.double().norm() for p in model.parameters()])
    expected = torch.linalg.vector_norm(norms).item()
    groups = GroupGradNorms(grad_norm_groups(model, multiplier_of(model).keys()), window=3, warmup_steps=0)
    expected_groups = {f"grad_norm_{name}": torch.linalg.vector_norm(torch.stack([p.grad.double().norm()
                                                                                  for p in params])).item()
                       for name, params in groups.groups.items()}
    optimizer.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    result = train_step(model, [batch], optimizer, accelerator, grad_clip=1e-3, grad_groups=groups)
    assert result.grad_norm == pytest.approx(expected, rel=1e-5)
    row = groups.update(1)
    assert len(expected_groups) > 1  # each group's own norm, in its own field, measured before clipping too
    assert {key: row[key] for key in expected_groups} == pytest.approx(expected_groups, rel=1e-5)
    assert result.grad_norm > 1e-3  # it was clipped, and the norm logged is the one before clipping
    step = torch.linalg.vector_norm(torch.stack([(p.detach() - b).double().norm()
                                                 for p, b in zip(model.parameters(), before, strict=True)]))
    assert step.item() == pytest.approx(1e-3, rel=1e-3)  # SGD with lr 1 moved by the clipped gradient


def test_evaluate_matches_fp64_reference(tiny) -> None:
    config, model = tiny
    windows = torch.randint(0, config.model.vocab_size, (7, 13), generator=torch.Generator().manual_seed(3))
    ref_model = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = ref_model(input_ids=windows[:, :-1]).logits
        nll = -torch.log_softmax(logits, dim=-1).gather(-1, windows[:, 1:, None]).squeeze(-1)
    expected = nll.mean().item()

    result = evaluate(model, windows, micro_batch_size=3)  # 7 windows: batches of 3, 3, 1
    assert result["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert result["val_ppl"] == pytest.approx(math.exp(expected), rel=1e-6)
    assert result["val_tokens"] == 7 * 12
    again = evaluate(model, windows, micro_batch_size=3)
    assert again["val_loss"] == result["val_loss"]  # deterministic, bit for bit
    assert evaluate(model, windows, micro_batch_size=7)["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert model.training  # mode restored


def test_evaluate_rejects_bad_shape(tiny) -> None:
    _, model = tiny
    with pytest.raises(ValueError, match="val_windows"):
        evaluate(model, torch.zeros(5, dtype=torch.long), micro_batch_size=2)


@pytest.mark.parametrize("entry", [3e38, math.nan, math.inf, -math.inf])
def test_the_parameter_check_finds_any_non_finite_entry(entry: float) -> None:
    """Every tensor's largest |x| (``get_total_norm`` with ord=inf): any NaN or inf entry is found, in any dtype, and
    an entry near fp32's largest is no overflow (a 2-norm of it would be); an empty tensor (a ZeRO-3 placeholder)
    counts as finite."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2).to(torch.bfloat16), nn.ParameterList([torch.empty(0)]))
    with torch.no_grad():
        model[1].weight[1, 2] = entry
    assert _parameters_finite(model) == math.isfinite(entry)
    with torch.no_grad():
        model[1].weight[1, 2] = 0.0
        model[0].bias[3] = entry
    assert _parameters_finite(model) == math.isfinite(entry)
