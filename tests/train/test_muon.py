"""``train.optimizer: muon``: torch's Muon on the hidden matrices (each fused part apart), AdamW on the rest, the lr
rule, the engines it refuses, and exact resume (llm/train/optim.py ``MuonWithAdamW``)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import assert_same_weights, trajectory

from llm.config import load_config
from llm.model.config import ConfigError
from llm.train.optim import build_optimizer, check_engine, lr_multiplier, param_groups, set_schedule
from llm.train.setup import build_model
from llm.train.trainer import fit

HIDDEN = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.in_proj.weight", "mlp.down_proj.weight")


@pytest.fixture
def config_of(tiny_overrides: list[str]):
    return lambda *overrides: load_config(None, [*tiny_overrides, *overrides])


def names_by_group(model: torch.nn.Module, groups: list[dict]) -> dict[str, set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: {names[id(p)] for p in g["params"]} for g in groups}


def random_grads(model: torch.nn.Module, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) for p in model.parameters()]


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grads: list[list[torch.Tensor]],
                config, first: int = 0, total: int | None = None) -> None:
    """Updates ``first``, ``first + 1``, ... of a run of ``total`` (default: ``len(grads)``) with these gradients."""
    for step, step_grads in enumerate(grads, start=first):
        for p, g in zip(model.parameters(), step_grads, strict=True):
            p.grad = g.clone()
        set_schedule(optimizer, config, total or len(grads), step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize(("ffn", "linear"), [("isogmlp", "focus"), ("iso_ln", "linear"), ("swiglu", "linear")])
def test_muon_takes_the_hidden_matrices_and_adamw_keeps_every_other_group(config_of, ffn: str, linear: str) -> None:
    config = config_of(f"model.ffn={ffn}", f"model.ffn_linear={linear}", "model.tie_word_embeddings=false",
                       "train.optimizer=muon")
    model = build_model(config.model)
    groups = param_groups(model, config)
    by_group = names_by_group(model, groups)
    assert by_group["muon"] == {n for n, _ in model.named_parameters() if n.endswith(HIDDEN)}
    assert by_group["decay"] == {"lm_head.weight"}  # an untied head stays on AdamW, as the embedding does
    # every other group is the AdamW run's, with its lr and weight decay
    adamw_config = config_of(f"model.ffn={ffn}", f"model.ffn_linear={linear}", "model.tie_word_embeddings=false")
    adamw = {g["name"]: g for g in param_groups(model, adamw_config)}
    for group in (g for g in groups if g["name"] not in ("muon", "decay")):
        twin = adamw[group["name"]]
        assert by_group[group["name"]] == names_by_group(model, [twin])[group["name"]]
        assert (group["lr"], group["weight_decay"]) == (twin["lr"], twin["weight_decay"])
    muon = next(g for g in build_optimizer(model, config).param_groups if g["name"] == "muon")
    # AdamW's lr and decoupled weight decay, with the update scaled to AdamW's RMS (Moonshot's rule)
    assert (muon["lr"], muon["weight_decay"], muon["adjust_lr_fn"]) == (config.train.lr, 0.1, "match_rms_adamw")


def test_under_mup_the_muon_lr_follows_the_spectral_rule_and_adamw_keeps_mup(config_of) -> None:
    overrides = ("model.parametrization=mup", "model.mup_base_hidden_size=8")  # hidden 32: width multiplier 4
    config = config_of(*overrides, "train.optimizer=muon")
    model = build_model(config.model)
    groups = {g["name"]: g for g in param_groups(model, config)}
    assert config.model.width_multiplier == 4
    assert groups["muon_mup"]["lr"] == pytest.approx(config.train.lr / 2)  # lr / sqrt(width multiplier)
    assert "mup_hidden" not in groups
    adamw = {g["name"]: g["lr"] for g in param_groups(model, config_of(*overrides))}
    assert adamw["mup_hidden"] == pytest.approx(config.train.lr / 4)
    assert all(groups[name]["lr"] == lr for name, lr in adamw.items() if name != "mup_hidden")


def test_fused_projections_are_orthogonalised_per_part_as_torch_muon_does_separate_matrices(config_of) -> None:
    """q/k/v and iso_ln's gate/up/iso rows each take exactly torch.optim.Muon's update of a matrix of their own
    (also a check that torch's functional ``muon``, a private module's, still computes it); the whole fused
    matrix orthogonalised at once would not give it."""
    config = config_of("model.ffn=iso_ln", "train.optimizer=muon", "train.warmup_steps=1")
    model = build_model(config.model)
    before = copy.deepcopy(model)
    grads = [random_grads(model, seed) for seed in range(3)]
    train_steps(model, build_optimizer(model, config), grads, config)
    layer, old = model.model.layers[0], before.model.layers[0]
    head_dim = layer.self_attn.head_dim
    h = layer.mlp.intermediate_size
    index = {n: i for i, (n, _) in enumerate(before.named_parameters())}
    for name, rows in (("model.layers.0.self_attn.qkv_proj.weight", [2 * head_dim, head_dim, head_dim]),
                       ("model.layers.0.mlp.in_proj.weight", [h, h, h])):
        parts = [torch.nn.Parameter(part.clone()) for part in before.get_parameter(name).detach().split(rows)]
        reference = torch.optim.Muon(parts, lr=config.train.lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        for step, step_grads in enumerate(grads):
            for part, g in zip(parts, step_grads[index[name]].split(rows), strict=True):
                part.grad = g.clone()
            for group in reference.param_groups:  # the schedule's lr of this step, as set_schedule gives it
                group["lr"] = config.train.lr * lr_multiplier(step, 1, len(grads), config.train.min_lr_ratio)
            reference.step()
        assert torch.equal(model.get_parameter(name).detach(), torch.cat([p.detach() for p in parts])), name
        whole = torch.nn.Parameter(before.get_parameter(name).detach().clone())
        fused = torch.optim.Muon([whole], lr=config.train.lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        whole.grad = grads[0][index[name]].clone()
        fused.step()
        assert not torch.allclose(whole, torch.cat([p.detach() for p in parts]), atol=1e-4), "per part is moot"
    assert not torch.equal(old.self_attn.o_proj.weight, layer.self_attn.o_proj.weight)


def test_the_adamw_half_of_a_muon_run_steps_exactly_as_an_adamw_run(config_of) -> None:
    config, adamw_config = config_of("model.ffn=isogmlp", "train.optimizer=muon"), config_of("model.ffn=isogmlp")
    model = build_model(config.model)
    twin = copy.deepcopy(model)
    grads = [random_grads(model, seed) for seed in range(3)]
    train_steps(model, build_optimizer(model, config), grads, config)
    train_steps(twin, build_optimizer(twin, adamw_config), grads, adamw_config)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q) != name.endswith(HIDDEN), name


def test_a_loaded_state_reaches_both_halves_once_and_resumes_exactly(config_of) -> None:
    """``load_state_dict`` (a resume, Accelerate's ``prepare``) hands AdamW the loaded group dicts and state at once
    (the groups are no longer rebuilt at every step), and 2 steps, a state-dict round trip and a third step give
    the weights of 3 steps bitwise."""
    config = config_of("model.ffn=isogmlp", "train.optimizer=muon")
    model = build_model(config.model)
    twin = copy.deepcopy(model)
    grads = [random_grads(model, seed) for seed in range(3)]
    train_steps(model, build_optimizer(model, config), grads, config)
    first = build_optimizer(twin, config)
    train_steps(twin, first, grads[:2], config, total=3)
    resumed = build_optimizer(twin, config)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    assert resumed.adamw.state is resumed.state
    assert [id(g) for g in resumed.adamw.param_groups + resumed.muon_groups] == [id(g) for g in resumed.param_groups]
    train_steps(twin, resumed, grads[2:], config, first=2, total=3)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("engine", ["fsdp2-full_shard", "fsdp2-shard_grad_op", "fsdp1-full_shard", "deepspeed-zero2",
                                    "deepspeed-zero3"])
def test_a_muon_run_on_a_sharding_engine_is_refused_in_one_line_naming_it(config_of, engine: str) -> None:
    with pytest.raises(ConfigError, match=rf"^train.optimizer: muon cannot train under {engine}: [^\n]*$"):
        check_engine(config_of("train.optimizer=muon"), engine)
    check_engine(config_of(), engine)  # AdamW trains on every engine
    for whole in ("single", "ddp"):
        check_engine(config_of("train.optimizer=muon"), whole)


def test_muon_stop_and_resume_equals_uninterrupted_run(tiny_config, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_fit import _stop_after

    overrides = ("train.max_steps=10", "train.checkpoint_every=100", "train.eval_every=100", "train.optimizer=muon")
    whole = fit(tiny_config(*overrides, "name=whole"))
    _stop_after(monkeypatch, 4)
    stopped = fit(tiny_config(*overrides, "name=split"))
    assert stopped.step == 4
    monkeypatch.undo()
    saved = torch.load(stopped.last_checkpoint / "state" / "optimizer.bin", weights_only=True)
    muon_params = sum(len(g["params"]) for g in saved["param_groups"] if g["name"] == "muon")
    assert muon_params == 2 * len(HIDDEN)
    assert sum("momentum_buffer" in s for s in saved["state"].values()) == muon_params
    resumed = fit(tiny_config(*overrides, "name=split", "resume=true"))
    assert trajectory(resumed.run_dir) == trajectory(whole.run_dir)  # bitwise: every step's loss, norm and lr
    assert_same_weights(whole.last_checkpoint, resumed.last_checkpoint)


def test_resuming_with_the_other_optimizer_is_refused_in_one_line(tiny_config) -> None:
    first = fit(tiny_config("train.max_steps=2", "train.optimizer=muon"))
    checkpoints = sorted(p.name for p in (first.run_dir / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match=r"^train.optimizer: checkpoint \S+ was trained with other run settings: "
                                          r"train.optimizer \(checkpoint 'muon', config 'adamw'\); [^\n]*$"):
        fit(tiny_config("train.max_steps=4", "resume=true"))
    assert sorted(p.name for p in (first.run_dir / "checkpoints").iterdir()) == checkpoints


def test_fit_refuses_muon_on_a_sharding_engine_before_its_first_step(tiny_config, monkeypatch) -> None:
    """On CPU Accelerate drops the FSDP and DeepSpeed plugins, so the engine the prepared model shows is faked."""
    import llm.train.setup as setup

    monkeypatch.setattr(setup, "engine_in_use", lambda model, accelerator: "deepspeed-zero2")
    config = tiny_config("train.max_steps=2", "train.optimizer=muon")
    with pytest.raises(ConfigError, match=r"^train.optimizer: muon cannot train under deepspeed-zero2: [^\n]*$"):
        fit(config)
    assert not (config.run_dir / "metrics.jsonl").exists() and not (config.run_dir / "checkpoints").exists()
