"""GradNormTracker against float64 numpy references, skipped norms, warmup and exact resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from llm.metrics.gradnorm import GradNormTracker


def reference(norms: list[float], warmup: int, window: int) -> dict[str, float]:
    """Population variance / CV over the last ``window`` finite norms and the finite post-warmup ones."""
    finite = [(step, x) for step, x in enumerate(norms, start=1) if math.isfinite(x)]
    recent = np.array([x for _, x in finite][-window:])
    run = np.array([x for step, x in finite if step > warmup])
    out = {"grad_norm_var_rolling": recent.var(), "grad_norm_cv_rolling": recent.std() / recent.mean()}
    out["grad_norm_var_run"] = run.var() if run.size else math.nan
    out["grad_norm_cv_run"] = run.std() / run.mean() if run.size else math.nan
    return out


def feed(tracker: GradNormTracker, norms: list[float], first_step: int = 1) -> list[dict[str, float]]:
    return [tracker.update(step, x) for step, x in enumerate(norms, start=first_step)]


def test_matches_numpy_every_step() -> None:
    rng = np.random.default_rng(0)
    norms = list(rng.lognormal(0.0, 0.5, size=60))
    tracker = GradNormTracker(window=7, warmup_steps=5)
    for step, row in enumerate(feed(tracker, norms), start=1):
        expected = reference(norms[:step], warmup=5, window=7)
        assert row["grad_norm"] == norms[step - 1]
        for key, value in expected.items():
            if math.isnan(value):
                assert math.isnan(row[key]), (step, key)
            else:
                assert row[key] == pytest.approx(value, rel=1e-12, abs=1e-15), (step, key)


def test_warmup_steps_are_left_out_of_the_run_statistics() -> None:
    tracker = GradNormTracker(window=10, warmup_steps=3)
    rows = feed(tracker, [100.0, 50.0, 10.0, 2.0, 4.0])
    assert all(math.isnan(r["grad_norm_var_run"]) for r in rows[:3])
    assert rows[3]["grad_norm_var_run"] == 0.0 and rows[3]["grad_norm_cv_run"] == 0.0
    assert rows[4]["grad_norm_var_run"] == 1.0  # population variance of {2, 4}
    assert rows[4]["grad_norm_cv_run"] == pytest.approx(1.0 / 3.0, rel=1e-15)
    assert rows[4]["grad_norm_var_rolling"] == pytest.approx(np.var([100.0, 50.0, 10.0, 2.0, 4.0]), rel=1e-15)


def test_non_finite_norms_are_counted_not_added() -> None:
    clean = [1.0, 2.0, 3.0, 4.0, 5.0]
    with_bad = [1.0, 2.0, math.inf, 3.0, math.nan, 4.0, 5.0]
    a, b = GradNormTracker(window=3, warmup_steps=0), GradNormTracker(window=3, warmup_steps=0)
    last_clean = feed(a, clean)[-1]
    rows = feed(b, with_bad)
    assert math.isinf(rows[2]["grad_norm"]) and math.isnan(rows[4]["grad_norm"])
    assert rows[-1]["grad_norm_nonfinite"] == 2.0 and last_clean["grad_norm_nonfinite"] == 0.0
    for key in ("grad_norm_var_rolling", "grad_norm_cv_rolling", "grad_norm_var_run", "grad_norm_cv_run"):
        assert rows[-1][key] == pytest.approx(last_clean[key], rel=1e-15)


def test_run_variance_is_exact_around_a_large_mean() -> None:
    """Welford keeps the variance of norms near 1e8 (a naive E[x^2] - E[x]^2 would lose it all)."""
    rng = np.random.default_rng(1)
    norms = list(1e8 + rng.normal(0.0, 1e-2, size=5000))
    tracker = GradNormTracker(window=100, warmup_steps=0)
    row = feed(tracker, norms)[-1]
    assert row["grad_norm_var_run"] == pytest.approx(np.var(norms), rel=1e-6)
    assert row["grad_norm_var_rolling"] == pytest.approx(np.var(norms[-100:]), rel=1e-9)


def test_resume_through_json_continues_exactly() -> None:
    rng = np.random.default_rng(2)
    norms = list(rng.lognormal(0.0, 1.0, size=40))
    norms[7] = math.inf
    straight = feed(GradNormTracker(window=6, warmup_steps=4), norms)

    first = GradNormTracker(window=6, warmup_steps=4)
    feed(first, norms[:20])
    resumed = GradNormTracker(window=6, warmup_steps=4)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert feed(resumed, norms[20:], first_step=21) == straight[20:]


def test_resume_with_other_window_or_warmup() -> None:
    norms = [1.0, 2.0, 4.0, 8.0, 16.0]
    saved = GradNormTracker(window=5, warmup_steps=0)
    feed(saved, norms)
    narrower = GradNormTracker(window=2, warmup_steps=0)
    narrower.load_state_dict(saved.state_dict())
    assert narrower.stats()["grad_norm_var_rolling"] == np.var([8.0, 16.0])
    assert narrower.stats()["grad_norm_var_run"] == saved.stats()["grad_norm_var_run"]
    longer_warmup = GradNormTracker(window=5, warmup_steps=6)  # the run statistics restart; the window stays
    longer_warmup.load_state_dict(saved.state_dict())
    assert longer_warmup.stats()["grad_norm_var_rolling"] == saved.stats()["grad_norm_var_rolling"]
    assert math.isnan(longer_warmup.stats()["grad_norm_var_run"])
    feed(longer_warmup, [3.0, 5.0], first_step=6)  # step 6 is in warmup, step 7 is not
    assert longer_warmup.stats()["grad_norm_var_run"] == np.var([5.0])


@pytest.mark.parametrize(("window", "warmup"), [(0, 0), (5, -1)])
def test_bad_arguments(window: int, warmup: int) -> None:
    with pytest.raises(ValueError, match=r"^(window|warmup_steps):"):
        GradNormTracker(window=window, warmup_steps=warmup)


VARIANTS = [{"ffn": "swiglu"}, {"ffn": "isogmlp", "ffn_linear": "focus"},
            {"ffn": "iso_ln", "ffn_linear": "affine_like", "tie_word_embeddings": False}, {"ffn": "iso_mlp"}]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v["ffn"] for v in VARIANTS])
def test_group_norms_split_the_global_norm(variant: dict) -> None:
    """Every parameter is in one group, mixing parameters in ffn_mixing, and the group norms' squares add
    up to the global norm's square."""
    import torch

    from llm.metrics.gradnorm import GroupGradNorms, grad_norm_groups
    from llm.model.config import ModelConfig
    from llm.train.optim import multiplier_of
    from llm.train.setup import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, **variant))
    ids = torch.randint(0, 128, (2, 17))
    model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:]).loss.backward()
    groups = grad_norm_groups(model, multiplier_of(model).keys())
    assert sorted(id(p) for ps in groups.values() for p in ps) == sorted(id(p) for p in model.parameters())
    assert {id(p) for p in groups.get("ffn_mixing", [])} == set(multiplier_of(model))
    assert ("ffn_mixing" in groups) == (variant["ffn"] in ("isogmlp", "iso_ln") or "ffn_linear" in variant)
    tracker = GroupGradNorms(groups, window=3, warmup_steps=0)
    tracker.record(tracker.norms().tolist())
    row = tracker.update(1)
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert math.fsum(row[f"grad_norm_{g}"] ** 2 for g in groups) == pytest.approx(total**2, rel=1e-5)
    assert {"grad_norm_ffn_var_rolling", "grad_norm_attention_cv_run", "grad_norm_norm_nonfinite"} <= row.keys()
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(".self_attn." in names[id(p)] for p in groups["attention"])
    assert all("norm" in names[id(p)] for p in groups["norm"])
    assert all(".mlp." in names[id(p)] and "norm" not in names[id(p)] for p in groups["ffn"])
    untied = variant.get("tie_word_embeddings") is False
    assert {names[id(p)] for p in groups["embedding"]} == {"model.embed_tokens.weight",
                                                           *(["lm_head.weight"] if untied else [])}


def test_group_trackers_resume_exactly() -> None:
    import torch

    from llm.metrics.gradnorm import GroupGradNorms

    params = {"ffn": [torch.nn.Parameter(torch.zeros(3))], "norm": [torch.nn.Parameter(torch.zeros(2))]}
    rng = np.random.default_rng(1)
    grads = [(torch.tensor(rng.normal(size=3), dtype=torch.float32), torch.tensor(rng.normal(size=2),
                                                                                  dtype=torch.float32))
             for _ in range(12)]

    def run(tracker: GroupGradNorms, steps: range) -> list[dict[str, float]]:
        rows = []
        for step in steps:
            params["ffn"][0].grad, params["norm"][0].grad = grads[step - 1]
            tracker.record(tracker.norms().tolist())
            rows.append(tracker.update(step))
        return rows

    whole = run(GroupGradNorms(params, window=4, warmup_steps=2), range(1, 13))
    first = GroupGradNorms(params, window=4, warmup_steps=2)
    run(first, range(1, 7))
    resumed = GroupGradNorms(params, window=4, warmup_steps=2)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert run(resumed, range(7, 13)) == whole[6:]


def test_a_group_without_gradients_measures_nan() -> None:
    """A group none of whose parameters holds a gradient (DeepSpeed keeps them in its engine) is NaN beside the
    others' norms; with no gradient anywhere ``norms()`` is None and every group records NaN."""
    import torch

    from llm.metrics.gradnorm import GroupGradNorms

    params = {"ffn": [torch.nn.Parameter(torch.zeros(2))], "norm": [torch.nn.Parameter(torch.zeros(2))]}
    tracker = GroupGradNorms(params, window=3, warmup_steps=0)
    assert tracker.norms() is None
    tracker.record(None)
    row = tracker.update(1)
    assert math.isnan(row["grad_norm_ffn"]) and math.isnan(row["grad_norm_norm"])
    params["norm"][0].grad = torch.tensor([3.0, 4.0])
    norms = tracker.norms()
    assert norms.dtype == torch.float32 and math.isnan(norms[0]) and norms[1] == 5.0
    tracker.record(norms.tolist())
    row = tracker.update(2)
    assert math.isnan(row["grad_norm_ffn"]) and row["grad_norm_norm"] == 5.0
