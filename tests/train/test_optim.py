"""AdamW parameter groups, the warmup + cosine schedule and the gradient-accumulation arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from llm.config import load_config
from llm.model.config import ConfigError
from llm.train.optim import build_optimizer, lr_multiplier, param_groups, schedule_warnings, set_schedule
from llm.train.setup import build_model, resolve_max_steps
from llm.train.step import gradient_accumulation_steps


@pytest.fixture
def config_of(tiny_overrides: list[str]):
    return lambda *overrides: load_config(None, [*tiny_overrides, *overrides])


@pytest.mark.parametrize(("ffn", "linear"),
                         [("isogmlp", "focus"), ("iso_ln", "affine_like"), ("swiglu", "linear")])
def test_param_groups_decay_only_matrices(config_of, ffn: str, linear: str) -> None:
    focus_options = ["model.focus_mu_lr_mult=0.01", "model.focus_sigma_lr_mult=0.5"] if linear == "focus" else []
    config = config_of(f"model.ffn={ffn}", f"model.ffn_linear={linear}", *focus_options)
    model = build_model(config.model)
    groups = {g["name"]: g for g in param_groups(model, config)}
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = {key: {names[id(p)] for p in g["params"]} for key, g in groups.items()}

    decay = by_group["decay"]
    mixing = ("focus_mu", "focus_sigma", "mlp.gamma", "mlp.beta", "alpha_raw", "beta_raw", "alpha_gate.proj.weight",
              "alpha_gate.proj.bias")
    assert decay == {n for n, p in model.named_parameters()
                     if p.ndim >= 2 and "embed_tokens" not in n and not n.endswith(mixing)}
    assert "model.embed_tokens.weight" in by_group["no_decay"]  # also the tied lm_head: one tensor
    assert not any("lm_head" in n for group in by_group.values() for n in group)
    no_decay_kinds = ("norm.weight", "layernorm.weight", "in_proj.bias", "iso_norm.bias")
    for name, p in model.named_parameters():
        if name.endswith(no_decay_kinds):
            assert name in by_group["no_decay"], name
            assert p.ndim <= 1
    assert by_group.get("mixing", set()) == {n for n in names.values() if n.endswith(mixing[2:])}
    if ffn != "swiglu":
        assert groups["mixing"]["lr"] == pytest.approx(config.train.lr * config.model.mixing_lr_mult)
    assert groups["decay"]["weight_decay"] == config.train.weight_decay == 0.1
    assert all(g["weight_decay"] == 0.0 for key, g in groups.items() if key != "decay")
    # Every parameter is in exactly one group.
    assert sum(len(g["params"]) for g in groups.values()) == len(list(model.parameters()))

    if linear == "focus":
        assert by_group["focus_mu"] == {n for n in names.values() if n.endswith("focus_mu")}
        optimizer = build_optimizer(model, config)
        lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
        assert lrs["focus_mu"] == pytest.approx(config.train.lr * 0.01)
        assert lrs["focus_sigma"] == pytest.approx(config.train.lr * 0.5)
        assert lrs["decay"] == lrs["no_decay"] == config.train.lr
    else:
        assert "focus_mu" not in groups and "focus_sigma" not in groups


def test_schedule_warmup_cosine_values() -> None:
    def f(step: int) -> float:
        return lr_multiplier(step, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)

    assert f(0) == pytest.approx(0.1)  # step 0 trains at lr / warmup, not at 0
    assert f(4) == pytest.approx(0.5)
    assert f(9) == 1.0  # end of warmup
    assert f(10) == 1.0  # cosine starts at the peak
    assert f(60) == pytest.approx(0.55)  # half way: min + (1 - min) / 2
    assert f(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert f(110) == pytest.approx(0.1)  # end: lr * min_lr_ratio
    assert f(500) == pytest.approx(0.1)  # and it stays there


def test_the_schedule_sets_every_group_from_the_step_and_the_config_in_force(config_of) -> None:
    """Each group's lr is its peak (with its multiplier) times the step's multiplier, and its weight decay the
    config's, whatever the optimizer held before: a loaded optimizer state of another config changes nothing."""
    config = config_of("model.ffn_linear=focus", "model.focus_mu_lr_mult=0.01", "train.warmup_steps=4",
                       "train.lr=1e-3", "train.weight_decay=0.05")
    optimizer = build_optimizer(build_model(config.model), config)
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = 7.0, 7.0  # as a checkpoint of another lr and decay would leave them
    assert set_schedule(optimizer, config, max_steps=20, step=3) == 1e-3  # warmup end: the peak
    groups = {g["name"]: (g["lr"], g["weight_decay"]) for g in optimizer.param_groups}
    assert groups["decay"] == (1e-3, 0.05) and groups["no_decay"] == (1e-3, 0.0)
    assert groups["focus_mu"] == (1e-3 * 0.01, 0.0)
    set_schedule(optimizer, config, max_steps=20, step=1)
    assert optimizer.param_groups[0]["lr"] == 1e-3 * 0.5


def test_gradient_accumulation_arithmetic(config_of) -> None:
    config = config_of("train.global_batch_tokens=1024", "train.micro_batch_size=4", "data.seq_len=32")
    assert gradient_accumulation_steps(config, world_size=1) == 8
    assert gradient_accumulation_steps(config, world_size=2) == 4
    assert gradient_accumulation_steps(config, world_size=8) == 1
    with pytest.raises(ConfigError, match=r"^train\.global_batch_tokens: .*4 \* 32 \* 16 = 2048"):
        gradient_accumulation_steps(config, world_size=16)
    bad = config_of("train.global_batch_tokens=1000")
    with pytest.raises(ConfigError, match=r"^train\.global_batch_tokens"):
        gradient_accumulation_steps(bad, world_size=1)


def test_max_steps_from_token_budget(config_of) -> None:
    assert resolve_max_steps(config_of("train.max_steps=0", "train.max_tokens=2560")) == 10
    assert resolve_max_steps(config_of("train.max_steps=0", "train.max_tokens=2561")) == 11
    assert resolve_max_steps(config_of("train.max_steps=7", "train.max_tokens=2561")) == 7


def test_param_groups_are_deterministic(config_of) -> None:
    """The optimizer state of a checkpoint is matched to groups by position: same order every time."""
    config = config_of("model.ffn=isogmlp", "model.ffn_linear=focus")

    def layout() -> list[tuple[str, list[str]]]:  # each group's name and its parameters, in order
        model = build_model(config.model)
        name_of = {id(p): n for n, p in model.named_parameters()}
        return [(g["name"], [name_of[id(p)] for p in g["params"]]) for g in param_groups(model, config)]

    a, b = layout(), layout()
    assert a == b
    assert [name for name, _ in a] == ["decay", "no_decay", "mixing", "focus_mu", "focus_sigma"]
    assert sorted(p for _, params in a for p in params) == sorted(n for n, _ in build_model(config.model)
                                                                  .named_parameters())


def _constant_sign_alpha_run(lr_mult: float, steps: int = 4000, warmup: int = 400) -> list[float]:
    """iso_ln's alpha = 0.5 + 1.5 sigmoid(a) trained alone under a gradient that always says "larger",
    with AdamW, betas and eps of the 83m experiment and its warmup + cosine schedule; alpha after each step."""
    config = load_config(["configs/experiments/fineweb-83m.yaml"])
    t = config.train
    assert (resolve_max_steps(config), t.warmup_steps, t.lr) == (steps, warmup, 3e-4)
    alpha_raw = torch.zeros((), requires_grad=True)
    optimizer = torch.optim.AdamW([alpha_raw], lr=t.lr * lr_mult, betas=(t.beta1, t.beta2), eps=t.eps,
                                  weight_decay=0.0)
    alphas = []
    for step in range(steps):
        optimizer.param_groups[0]["lr"] = t.lr * lr_mult * lr_multiplier(step, warmup, steps, t.min_lr_ratio)
        optimizer.zero_grad()
        alpha = 0.5 + 1.5 * torch.sigmoid(alpha_raw)
        (-alpha).backward()
        optimizer.step()
        alphas.append(0.5 + 1.5 * torch.sigmoid(alpha_raw).item())
    return alphas


def test_iso_ln_alpha_reaches_the_papers_value_on_the_83m_schedule() -> None:
    """iso_ln reports a learned alpha of 1.81: at the default mixing multiplier a constant-sign gradient gets
    there within the 83m run; at 1x Adam's ~lr-per-step travel stops it at 1.49 (llm/train/optim.py)."""
    from llm.model.config import ModelConfig

    assert max(_constant_sign_alpha_run(1.0)) < 1.49
    alphas = _constant_sign_alpha_run(ModelConfig().mixing_lr_mult)
    assert alphas[-1] >= 1.81
    assert next(i for i, a in enumerate(alphas) if a >= 1.81) < 3000  # with a quarter of the run to spare


def test_focus_parameters_are_clipped_after_every_optimizer_step(config_of) -> None:
    config = config_of("model.ffn_linear=focus", "train.lr=10.0")
    model = build_model(config.model)
    optimizer = build_optimizer(model, config)
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # a step of ~lr = 10 pushes every mu and sigma far below its range
    optimizer.step()
    for name, p in model.named_parameters():
        if name.endswith("focus_sigma"):
            assert (p == 0.01).all(), name
        if name.endswith("focus_mu"):
            assert (p == 0.0).all(), name


def test_a_warmup_longer_than_the_run_is_clamped_and_said(config_of) -> None:
    """warmup_steps > max_steps would end the run before the lr reached train.lr: clamped, with a warning."""
    config = config_of("train.warmup_steps=10", "train.max_steps=4", "train.eval_every=3", "train.lr=1.0")
    optimizer = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "name": "decay"}])
    lrs = [set_schedule(optimizer, config, 4, step) for step in range(4)]
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0])  # warmup over the 4 steps: train.lr at the last
    assert schedule_warnings(config, 4) == [
        "train.warmup_steps=10 is longer than the run (4 steps): warming up over all 4 instead, so the lr reaches "
        "train.lr at the last step, with no decay"]
    assert schedule_warnings(config_of("train.warmup_steps=2", "train.max_steps=4", "train.eval_every=5"), 4) == [
        "train.eval_every=5 is longer than the run (4 steps): the validation loss is computed at the last step only"]
