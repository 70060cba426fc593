"""bench/paired.py's paired ratios and intervals against hand computations and their coverage by simulation,
bench_train_step.py's rows, references and CSV, and a row that recompiles failing loudly (bench/step_rows.py)."""

from __future__ import annotations

import csv
import random
import statistics
import subprocess
import sys

import harness
import paired
import pytest
import step_rows
import torch
from tiny import REPO

from llm.model import ModelConfig


def test_ratios_pair_rounds_so_that_load_between_rounds_cancels() -> None:
    """The baseline's round 2 ran under twice the load, and so did the row's: per round the row is 1.25x as fast.
    The paired median says exactly that, with no spread; best-of figures of the two rows would not pair rounds."""
    baseline = [1.0, 2.0, 1.0, 1.5, 1.2, 0.9]
    row = [b / 1.25 for b in baseline]
    assert paired.round_ratios([2.0, 4.0], [3.0, 2.0]) == [1.5, 0.5]  # baseline s / row s, round by round
    ratio = paired.paired_ratio(row, baseline)
    assert ratio == paired.PairedRatio(pytest.approx(1.25), pytest.approx(1.25), pytest.approx(1.25), 6)
    with pytest.raises(ValueError, match="paired rounds differ in number: 2 against 3"):
        paired.round_ratios([1.0, 1.0], [1.0, 1.0, 1.0])


def test_the_interval_of_the_median_is_the_binomial_order_statistic_one() -> None:
    """With n rounds the interval is [k-th smallest, k-th largest] for the largest k with P(Binomial(n, 1/2) < k)
    <= 2.5%: k = 1 for n = 6 to 8 (2/2^6 = 3.1% at most outside), k = 2 at n = 10 (P(B <= 1) = 11/1024). Below 6
    rounds no interval holds 95% (the extremes of 5 miss the median with probability 2/32 = 6.25%): none is given,
    and the ratio says so. The order of the rounds does not matter."""
    import numpy as np
    from scipy.stats import binom, quantile_test

    for n in range(1, 41):  # scipy's interval of the median, the same values
        values = list(np.random.default_rng(n).lognormal(size=n))
        ours, scipys = paired.median_interval(values), quantile_test(values, q=1.0).confidence_interval(0.95)
        assert (ours.low, ours.high) == ((None, None) if np.isnan(scipys.low) else (scipys.low, scipys.high))
    ten = [0.95 + 0.01 * i for i in (3, 1, 4, 0, 5, 9, 2, 6, 8, 7)]
    assert paired.median_interval(ten) == paired.PairedRatio(pytest.approx(0.995), 0.96, pytest.approx(1.03), 10)
    assert binom.cdf(1, 10, 0.5) <= 0.025 < binom.cdf(2, 10, 0.5)
    six = [1.0, 0.9, 1.2, 1.1, 0.8, 1.05]
    assert paired.median_interval(six) == paired.PairedRatio(pytest.approx(1.025), 0.8, 1.2, 6)
    assert paired.MIN_ROUNDS == 6
    few = paired.median_interval(six[:5])
    assert (few.median, few.low, few.high) == (1.0, None, None)
    assert str(few) == "1.000x (too few rounds: 5 < 6)" and paired.verdict(few, 0.5) == "too few rounds"


def test_the_interval_holds_the_median_95_percent_of_the_time_at_every_round_count() -> None:
    """Simulated (seeded): rounds drawn from a skewed distribution whose median is 1, 4,000 trials per count. From 6
    rounds the interval holds the true median at least 95% of the time (less Monte Carlo error, 3 standard errors);
    below 6 there is no interval to miss. The percentile bootstrap it replaces missed it 50% of the time at 2 rounds,
    25% at 3 (its interval is then the extremes of the 3: 1 - 2/8 = 75%), 12% at 7 (3,000 simulated trials)."""
    import numpy as np

    rng = np.random.default_rng(0)
    trials = 4000
    for n in range(2, 13):
        draws = rng.lognormal(0.0, 0.3, size=(trials, n))  # median exp(0) = 1
        intervals = [paired.median_interval(list(row)) for row in draws]
        if n < paired.MIN_ROUNDS:
            assert all(i.low is None for i in intervals)
            continue
        covered = np.mean([i.low <= 1.0 <= i.high for i in intervals])
        assert covered >= 0.95 - 3 * (0.95 * 0.05 / trials) ** 0.5, (n, covered)


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
    assert paired.verdict(paired.PairedRatio(0.97, 0.95, 0.99, 10), 0.95) == "met"
    assert paired.verdict(paired.PairedRatio(0.97, 0.92, 0.99, 10), 0.95) == "not resolved"  # median above
    assert paired.verdict(paired.PairedRatio(0.90, 0.88, 0.94, 10), 0.95) == "NOT met"
    assert paired.verdict(paired.PairedRatio(0.96, 0.94, 0.99, 10), 0.95, low_floor=0.93) == "met"
    assert paired.verdict(paired.PairedRatio(0.94, 0.94, 0.99, 10), 0.95, low_floor=0.93) == "not resolved"
    grouped = paired.grouped_interval([[1.0, 1.1], [0.9, 1.2, 1.0]])  # 5 values pooled: as median_interval
    assert grouped.low is None and paired.verdict(grouped, 1.0) == "too few rounds"


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/bench_train_step.py", "--preset", "tiny", "--seq", "16", "--batch",
                           "2", "--threads", "1", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)


def test_the_bench_writes_one_csv_line_per_row_with_its_reference_and_paired_ratio(tmp_path) -> None:
    out = tmp_path / "step.csv"
    done = run_bench("--rounds", "6", "--variants", "swiglu+softmax", "isogmlp+softmax", "--qwen3", "loss-inside",
                     "liger", "--extra-row", "swiglu+softmax batch 4", "swiglu+softmax", "batch=4", "--extra-row",
                     "packed", "swiglu+softmax", "packed_docs=5", "--extra-row", "packed fp32", "packed", "tf32=false",
                     "--csv", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "# skipped transformers Qwen3 + Liger FLCE:" in done.stdout  # absent or not on CUDA: said, not silent
    with open(out, newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == list(paired.CSV_COLUMNS.values()) == [
        "variant", "reference", "tokens_per_s_median_of_rounds", "ratio_to_reference_median_of_paired_rounds",
        "ratio_ci_low", "ratio_ci_high", "rounds", "mfu"]
    rows = {line[0]: line for line in lines[1:]}
    assert {name: line[1] for name, line in rows.items()} == {
        "swiglu+softmax": "swiglu+softmax", "isogmlp+softmax": "swiglu+softmax",
        "swiglu+softmax batch 4": "swiglu+softmax", "packed": "swiglu+softmax", "packed fp32": "packed",
        "transformers Qwen3 (loss compiled)": "swiglu+softmax"}
    assert float(rows["swiglu+softmax batch 4"][2]) > 0  # its own tokens/s (a speed order would be a timed test)
    assert rows["swiglu+softmax"][3:7] == ["1.0", "1.0", "1.0", "6"]  # the baseline over itself, every round
    low, ratio, high = (float(rows["transformers Qwen3 (loss compiled)"][i]) for i in (4, 3, 5))
    assert 0 < low <= ratio <= high and rows["swiglu+softmax"][7] == ""  # no datasheet MFU on CPU


def test_too_few_rounds_give_no_interval_and_no_rounds_are_refused_before_building(
        tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "step.csv"
    done = run_bench("--rounds", "3", "--variants", "swiglu+softmax", "--qwen3", "--extra-row", "copy",
                     "swiglu+softmax", "tie_word_embeddings=true", "--csv", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(too few rounds: 3 < 6)" in done.stdout
    with open(out, newline="") as f:
        copy = {line[0]: line for line in csv.reader(f)}["copy"]
    assert copy[4:7] == ["", "", "3"]
    import bench_train_step  # in this process: a refusal needs no process of its own

    for rounds in ("0", "-1", "x"):
        monkeypatch.setattr(sys, "argv", ["bench_train_step.py", "--preset", "tiny", "--rounds", rounds,
                                          "--variants", "swiglu+softmax"])
        with pytest.raises(SystemExit) as refused:
            bench_train_step.main()
        stdout, stderr = capsys.readouterr()
        assert refused.value.code == 2 and "--rounds" in stderr and "whole number" in stderr
        assert "training step" not in stdout


def test_bench_trees_refuses_this_tree_as_its_baseline(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Both sides of every pair would be the same worker process: an exact 1.000x [1.000, 1.000], which reads as a
    noise floor of zero. It is refused before any worker starts."""
    import bench_trees

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["bench_trees.py", "--baseline-tree", ".", "--preset", "tiny"])
    with pytest.raises(SystemExit) as refused:
        bench_trees.main()
    stdout, stderr = capsys.readouterr()
    assert refused.value.code == 2 and "--baseline-tree: . is this tree" in stderr
    assert "training step" not in stdout


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
    loss = lambda: Recorder.apply(weight.weight).sum()  # noqa: E731
    before = torch.get_float32_matmul_precision()
    harness.make_step(weight.parameters(), loss, torch.device("cuda"), torch.float32)()
    assert seen == {"forward": "high", "backward": "high"}
    assert torch.get_float32_matmul_precision() == before
    seen.clear()
    harness.make_step(weight.parameters(), loss, torch.device("cuda"), torch.float32, tf32=False)()
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
    """``--extra-row LABEL REFERENCE KEY=VALUE...`` values are YAML-typed and validated: "false" is False (a string
    "false" would be truthy); row keys change the row, the rest the model; the reference is the row named."""
    import argparse

    import bench_train_step

    base = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)
    rows = bench_train_step.extra_rows(argparse.ArgumentParser(), [
        ["untied", "swiglu+softmax", "tie_word_embeddings=false", "iso_tanh_chunk_size=32", "lm_head_precision=fp8"],
        ["untied packed", "untied", "packed_docs=7", "tf32=false", "batch=3"]],
        {"swiglu+softmax": bench_train_step.Spec(base, None)})
    untied, packed = rows["untied"], rows["untied packed"]
    assert untied.reference == "swiglu+softmax" and packed.reference == "untied"
    assert untied.config.tie_word_embeddings is False and untied.config.iso_tanh_chunk_size == 32
    assert untied.config.lm_head_precision == "fp8" and packed.config == untied.config
    assert (packed.packed_docs, packed.tf32, packed.batch) == (7, False, 3) and untied.tf32 is True
    for bad in (["x", "swiglu+softmax", "no_such_field=1"], ["x", "no-such-row", "batch=2"], ["x"]):
        with pytest.raises(SystemExit):
            bench_train_step.extra_rows(argparse.ArgumentParser(), [bad], {"swiglu+softmax": rows["untied"]})


def test_packed_positions_restart_at_documents_of_the_mean_length() -> None:
    positions = harness.packed_positions(3, 4000, 20.0, torch.device("cpu"))
    starts = positions == 0
    assert positions.shape == (3, 4000) and bool(starts[:, 0].all())
    assert bool((positions[:, 1:] == positions[:, :-1] + 1)[~starts[:, 1:]].all())  # counts up inside a document
    assert 4000 * 3 / int(starts.sum()) == pytest.approx(20.5, rel=0.1)  # exponential + 1, cut at the window


def test_a_worker_killed_by_a_signal_is_named_with_it() -> None:
    """A worker the kernel kills (SIGKILL, as the out-of-memory killer does) after its set-up: the next timed call
    says which worker died and by which signal, not a BrokenPipeError, and the rounds close the others cleanly."""
    dies = "import json, os, signal; print(json.dumps({}), flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    serves = "import json, sys; print(json.dumps({}), flush=True); [print(0.5, flush=True) for _ in sys.stdin]"
    worker = harness.Worker([sys.executable, "-c", dies, "--worker", "isogmlp"])
    worker.proc.wait()
    with pytest.raises(RuntimeError, match=r"the worker .* --worker isogmlp was killed by SIGKILL"):
        worker()
    worker.close()
    starts = {"ok": lambda: harness.Worker([sys.executable, "-c", serves]),
              "dead": lambda: harness.Worker([sys.executable, "-c", dies])}
    with pytest.raises(RuntimeError, match="killed by SIGKILL"):
        harness.worker_rounds(starts, rounds=2)
