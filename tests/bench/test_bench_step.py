"""bench/paired.py's paired ratios and intervals against hand computations, bench_train_step.py's CSV, and a
row that recompiles failing loudly (bench/step_rows.py)."""

from __future__ import annotations

import csv
import random
import statistics
import subprocess
import sys
from fractions import Fraction

import paired
import pytest
import step_rows
import torch
from tiny import REPO

from llm.model import ModelConfig


def test_ratios_pair_rounds_so_that_load_between_rounds_cancels() -> None:
    """The baseline's round 2 ran under twice the load, and so did the row's: per round the row is 1.25x as fast.
    The paired median says exactly that, with no spread; best-of figures of the two rows would not pair rounds."""
    baseline = [1.0, 2.0, 1.0, 1.5, 1.2]
    row = [b / 1.25 for b in baseline]
    assert paired.round_ratios([2.0, 4.0], [3.0, 2.0]) == [1.5, 0.5]  # baseline s / row s, round by round
    ratio = paired.paired_ratio(row, baseline)
    assert ratio == paired.PairedRatio(pytest.approx(1.25), pytest.approx(1.25), pytest.approx(1.25), 5)
    with pytest.raises(ValueError, match="paired rounds differ in number: 2 against 3"):
        paired.round_ratios([1.0, 1.0], [1.0, 1.0, 1.0])


def test_the_bootstrap_of_the_median_follows_its_exact_distribution() -> None:
    """Resampling 3 rounds [0.9, 1.0, 1.2]: the median is 0.9 when at least two of the three draws are 0.9,
    3 (1/3)^2 (2/3) + (1/3)^3 = 7/27, likewise 1.2, and 1.0 otherwise, 13/27. So the 2.5% and 97.5% points are
    0.9 and 1.2, and with a fixed seed the same rounds always give the same interval."""
    values = [1.0, 0.9, 1.2]
    medians = paired.bootstrap_medians(values, resamples=20_000)
    exact = {0.9: Fraction(7, 27), 1.0: Fraction(13, 27), 1.2: Fraction(7, 27)}
    for value, p in exact.items():
        assert medians.count(value) / len(medians) == pytest.approx(float(p), abs=0.01)
    assert paired.median_interval(values) == paired.PairedRatio(1.0, 0.9, 1.2, 3)
    ten = [0.95 + 0.01 * i for i in range(10)]
    assert paired.median_interval(ten) == paired.median_interval(list(reversed(ten)))  # seeded, order-free


def test_the_grouped_interval_holds_an_offset_that_stays_with_one_process() -> None:
    """Two process pairs whose rounds differ by a fixed 2% offset: resampling the pooled rounds calls the middle
    sure, and the interval misses both processes' medians; drawing the processes first holds both."""
    rng = random.Random(0)
    groups = [[offset + rng.gauss(0, 0.005) for _ in range(60)] for offset in (1.00, 1.02)]
    own = [statistics.median(group) for group in groups]
    pooled = paired.median_interval(groups[0] + groups[1])
    grouped = paired.grouped_interval(groups)
    assert grouped.median == pooled.median and grouped.rounds == 120
    assert not pooled.low <= own[0] and not own[1] <= pooled.high
    assert grouped.low <= own[0] < own[1] <= grouped.high
    one = paired.grouped_interval([groups[0]])  # one process pair: the rounds' bootstrap, in other draws
    assert one.median == paired.median_interval(groups[0]).median and one.low < one.median < one.high
    with pytest.raises(ValueError, match="empty group"):
        paired.grouped_interval([groups[0], []])


def test_a_target_is_met_only_when_the_interval_clears_it() -> None:
    assert paired.verdict(paired.PairedRatio(0.97, 0.95, 0.99, 10), 0.95) is True
    assert paired.verdict(paired.PairedRatio(0.97, 0.92, 0.99, 10), 0.95) is None  # median above, not resolved
    assert paired.verdict(paired.PairedRatio(0.90, 0.88, 0.94, 10), 0.95) is False
    assert paired.VERDICTS[None] == "not resolved"


def test_the_bench_writes_one_csv_line_per_row_with_its_paired_ratio(tmp_path) -> None:
    out = tmp_path / "step.csv"
    done = subprocess.run(
        [sys.executable, "bench/bench_train_step.py", "--preset", "tiny", "--seq", "16", "--batch", "2",
         "--rounds", "3", "--threads", "1", "--variants", "swiglu+softmax", "--qwen3", "loss-inside", "liger",
         "--also-batch", "4", "--csv", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "# skipped transformers Qwen3 + Liger FLCE:" in done.stdout  # absent or not on CUDA: said, not silent
    with open(out, newline="") as f:
        lines = list(csv.reader(f))
    assert tuple(lines[0]) == paired.CSV_COLUMNS == (
        "variant", "tokens_per_s", "ratio", "ratio_ci_low", "ratio_ci_high", "rounds", "mfu")
    rows = {line[0]: line for line in lines[1:]}
    assert list(rows) == ["swiglu+softmax", "swiglu+softmax batch 4", "transformers Qwen3 (loss compiled)"]
    assert float(rows["swiglu+softmax batch 4"][1]) > 0  # its own tokens/s (a speed order would be a timed test)
    assert rows["swiglu+softmax"][2:6] == ["1.0", "1.0", "1.0", "3"]  # the baseline over itself, every round
    low, ratio, high = (float(rows["transformers Qwen3 (loss compiled)"][i]) for i in (3, 2, 4))
    assert 0 < low <= ratio <= high and rows["swiglu+softmax"][6] == ""  # no datasheet MFU on CPU


def test_dynamo_options_the_bench_relies_on_exist() -> None:
    """strict_compilation patches two torch._dynamo.config options (no public equivalent): renamed, this fails."""
    import torch._dynamo.config as dynamo

    assert isinstance(dynamo.recompile_limit, int) and isinstance(dynamo.fail_on_recompile_limit_hit, bool)
    assert isinstance(dynamo.automatic_dynamic_shapes, bool)


def test_a_row_that_recompiles_fails_loudly_instead_of_running_eagerly() -> None:
    """A row whose compiled code is specialised on a string that changes every step recompiles on each call: the
    check after its warm-up names it; past the cache limit dynamo raises instead of falling back to eager."""
    torch._dynamo.reset()
    tag = ["a"]  # a string: dynamo guards on its value, and never makes it a dynamic input
    compiled = torch.compile(lambda x: x * len(tag[0]), backend="eager")
    x = torch.ones(2)

    def step() -> None:
        tag[0] += "a"
        compiled(x)

    with step_rows.strict_compilation(rows=1):
        step()
        with pytest.raises(RuntimeError, match="row 'drifting' recompiles after its warm-up step"):
            step_rows.check_compiled(step, "drifting")
        with pytest.raises(Exception, match="recompile_limit"):
            for _ in range(12):
                step()
    torch._dynamo.reset()


def test_the_step_runs_forward_and_backward_in_the_trainers_tf32_scope() -> None:
    """As llm.train.step.train_step: the backward pass too runs its fp32 matmuls at TF32 (the
    bench once wrapped only the forward). The scope acts on CUDA only, so the step is told its device is CUDA while
    its tensors stay on the CPU (fp32: no autocast), and the backward records the precision it ran under."""
    seen: dict[str, str] = {}

    class Recorder(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            seen["forward"] = torch.get_float32_matmul_precision()
            return x.clone()

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            seen["backward"] = torch.get_float32_matmul_precision()
            return grad

    weight = torch.nn.Linear(2, 1)
    row = step_rows.Row("recorder", weight, lambda: Recorder.apply(weight.weight).sum(), None, tokens=1)
    before = torch.get_float32_matmul_precision()
    step_rows.make_step(row, torch.device("cuda"), torch.float32)()
    assert seen == {"forward": "high", "backward": "high"}
    assert torch.get_float32_matmul_precision() == before
    seen.clear()
    step_rows.make_step(step_rows.Row("full fp32", weight, row.loss, None, 1, tf32=False), torch.device("cuda"),
                        torch.float32)()
    assert seen == {"forward": before, "backward": before}


def test_the_qwen3_rows_compute_the_same_loss_as_ours_would() -> None:
    """The fair Qwen3 row (labels passed, the loss inside its graph) and today's row (fp32 cross-entropy over its
    logits) compute the same next-token loss of the same batch from the same weights."""
    from llm.config import load_config

    config = load_config(str(REPO / "configs/sizes/tiny.yaml"), ["train.max_steps=1"]).model
    batch = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    losses = {}
    for kind in ("loss-outside", "loss-inside"):
        torch.manual_seed(0)
        row = step_rows.qwen3(kind, config, batch, compile_=False)
        losses[kind] = row.loss().item()
        assert row.tokens == 16
    assert losses["loss-inside"] == pytest.approx(losses["loss-outside"], rel=1e-6)


def test_an_extra_row_types_its_values_as_a_config_override_does() -> None:
    """``--extra-row`` values are YAML-typed and validated: "false" is False (a string "false" would be truthy)."""
    import argparse

    import bench_train_step

    base = {"swiglu+softmax": ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1)}
    rows = bench_train_step.extra_rows(argparse.ArgumentParser(), [
        "swiglu+softmax untied:tie_word_embeddings=false,iso_tanh_chunk_size=32,lm_head_precision=fp8"], base)
    variant, config = rows["swiglu+softmax untied"]
    assert variant == "swiglu+softmax"
    assert config.tie_word_embeddings is False and config.iso_tanh_chunk_size == 32
    assert config.lm_head_precision == "fp8"
    with pytest.raises(SystemExit):
        bench_train_step.extra_rows(argparse.ArgumentParser(), ["swiglu+softmax x:no_such_field=1"], base)
