"""layer_report on a tiny IsoLLMForCausalLM, and flatten_for_tracker."""

from __future__ import annotations

import math

import pytest
import torch

from llm.metrics.isotropy import isotropy_metrics
from llm.metrics.layers import block_outputs, flatten_for_tracker, layer_report
from llm.model.configuration_isollm import IsoLLMConfig
from llm.model.modeling_isollm import IsoLLMForCausalLM

ISO_KEYS = {"layer", "isoscore", "mean_cos", "eff_rank", "basis_alignment"}


def tiny_model(ffn: str, **fields: object) -> IsoLLMForCausalLM:
    torch.manual_seed(0)
    config = IsoLLMConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, ffn=ffn, **fields)
    return IsoLLMForCausalLM(config)


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("ffn", "ffn_keys"), [
    ("swiglu", set()),
    ("iso_mlp", set()),
    ("isogmlp", {"alpha", "beta", "pathway_ratio"}),
    ("iso_ln", {"alpha", "beta", "pathway_ratio"}),
])
def test_rows_are_the_isotropy_of_each_hidden_state(ffn: str, ffn_keys: set[str]) -> None:
    model, ids = tiny_model(ffn), batch()
    rows = layer_report(model, ids, samples=30, seed=7)
    assert [row["layer"] for row in rows] == [0, 1, 2]
    assert set(rows[0]) == ISO_KEYS
    assert all(set(row) == ISO_KEYS | ffn_keys for row in rows[1:])

    with torch.no_grad(), block_outputs(model) as hidden:
        out = model(ids, output_hidden_states=True)
    # the rows read x_L before the final norm, which makes it the model's last hidden state
    assert len(hidden) == len(out.hidden_states) == 3
    for got, want in zip(hidden[:-1], out.hidden_states[:-1], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(hidden[-1]), out.hidden_states[-1], rtol=0, atol=0)
    chosen = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(7))[:30]
    for row, states in zip(rows, hidden, strict=True):
        expected = isotropy_metrics(states.reshape(-1, 32)[chosen])
        assert {key: row[key] for key in expected} == expected
    assert all(math.isfinite(value) for row in rows for value in row.values())


def test_ffn_diagnostics_land_on_their_own_block() -> None:
    """Block i's alpha/beta (set to distinct values) appear on row i + 1, and pathway_ratio equals the
    block's diagnostics on its real input, rebuilt here from the previous hidden state."""
    model, ids = tiny_model("iso_ln"), batch()
    with torch.no_grad():
        for i, block in enumerate(model.model.layers):
            block.mlp.alpha_raw.fill_(0.3 + i)
            block.mlp.beta_raw.fill_(-0.2 * (i + 1))
    rows = layer_report(model, ids, samples=48, seed=0)
    for i in range(2):
        assert rows[i + 1]["alpha"] == pytest.approx(0.5 + 1.5 * torch.sigmoid(torch.tensor(0.3 + i)).item())
        assert rows[i + 1]["beta"] == pytest.approx(0.1 * math.tanh(-0.2 * (i + 1)))

    captured = []
    handle = model.model.layers[1].mlp.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    with torch.no_grad():
        model(ids)
    handle.remove()
    assert rows[2]["pathway_ratio"] == model.model.layers[1].mlp.diagnostics(captured[0])["pathway_ratio"]


def test_restores_training_mode_removes_hooks_and_is_deterministic() -> None:
    model, ids = tiny_model("isogmlp", isogmlp_gate="causal_mean"), batch(1)
    model.train()
    first = layer_report(model, ids, samples=16, seed=3)
    assert model.training
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in model.modules())
    assert all(p.grad is None for p in model.parameters())
    assert layer_report(model, ids, samples=16, seed=3) == first
    assert layer_report(model, ids, samples=16, seed=4) != first


def test_compiled_model_runs_eagerly() -> None:
    model, ids = tiny_model("isogmlp"), batch()
    compiled = torch.compile(model)  # lazy: nothing is compiled unless the wrapper is called
    assert layer_report(compiled, ids, samples=16, seed=0) == layer_report(model, ids, samples=16, seed=0)


def test_more_samples_than_tokens_uses_every_token() -> None:
    model, ids = tiny_model("swiglu"), batch()
    rows = layer_report(model, ids, samples=10_000, seed=0)
    with torch.no_grad():
        embedded = model(ids, output_hidden_states=True).hidden_states[0].reshape(-1, 32)
    # the metrics are order invariant, so all positions in any order give the same numbers
    assert rows[0]["isoscore"] == pytest.approx(isotropy_metrics(embedded)["isoscore"], abs=1e-12)
    with pytest.raises(ValueError, match="samples"):
        layer_report(model, ids, samples=0, seed=0)


def test_flatten_for_tracker() -> None:
    row = {
        "kind": "eval", "step": 200, "tokens": 4096, "val_loss": 3.5, "val_ppl": math.exp(3.5),
        "layers": [
            {"layer": 0, "isoscore": 0.5, "mean_cos": 0.1, "eff_rank": 9.0, "basis_alignment": 1.2},
            {"layer": 12, "isoscore": 0.25, "mean_cos": 0.2, "eff_rank": 4.0, "basis_alignment": 2.0,
             "alpha": 0.6, "beta": -0.01, "pathway_ratio": 1.5},
        ],
    }
    assert flatten_for_tracker(row) == {
        "tokens": 4096.0, "val_loss": 3.5, "val_ppl": math.exp(3.5),
        "iso/layer00/isoscore": 0.5, "iso/layer00/mean_cos": 0.1, "iso/layer00/eff_rank": 9.0,
        "iso/layer00/basis_alignment": 1.2,
        "iso/layer12/isoscore": 0.25, "iso/layer12/mean_cos": 0.2, "iso/layer12/eff_rank": 4.0,
        "iso/layer12/basis_alignment": 2.0,
        "ffn/layer12/alpha": 0.6, "ffn/layer12/beta": -0.01, "ffn/layer12/pathway_ratio": 1.5,
    }
