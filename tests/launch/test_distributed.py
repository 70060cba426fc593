"""Multi-process CPU (gloo) runs: DDP through `accelerate launch` + train.py with our config, and DDP /
FSDP2 / DeepSpeed ZeRO-2 and ZeRO-3 (tests/launch/dist_worker.py under torchrun) against one process that
accumulates the same global batch. Each 2-process launch costs 10-20 s on an idle 2-core machine, so dist_worker.py
makes all of an engine's runs in one (``LAUNCHES``)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from dist_worker import LR, STEPS
from tiny import PYTHON, REPO, TINY_MODEL, assert_same_weights, ddp_launch, metrics_rows, run, torchrun, trajectory

WORKER = str(REPO / "tests" / "launch" / "dist_worker.py")
TINY_RUN = [
    *TINY_MODEL, "data.val_bucket=50", "data.val_tokens=1024", "train.warmup_steps=1", "train.max_steps=4",
    "train.micro_batch_size=4", "train.global_batch_tokens=256",
    "train.log_every=1", "train.eval_every=4", "train.checkpoint_every=4", "train.isotropy_samples=64",
]


def worker(mode: str, out: Path, corpus: Path, tokenizer_file: Path, *extra: str) -> list[str]:
    return [WORKER, "--mode", mode, "--out", str(out), "--data", str(corpus),
            "--tokenizer", str(tokenizer_file), *extra]


def train_py_args(corpus: Path, tokenizer_file: Path, tmp_path: Path, out_dir: Path, *extra: str) -> list[str]:
    """``train.py`` and the overrides of a tiny run named ``ddp`` on the test corpus, writing under ``out_dir``."""
    return ["train.py", *TINY_RUN, f"data.source={corpus}", f"data.tokenizer={tokenizer_file}",
            f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={out_dir}", "name=ddp", *extra]


LAUNCHES = [
    ("ddp", ("plain", "activation_checkpointing", "muon")),
    ("ddp", ("bf16",)),  # Accelerate fixes the precision per process: DDP's bf16 run launches on its own
    ("fsdp2", ("plain", "activation_checkpointing", "bf16")),
    ("zero2", ("plain", "activation_checkpointing", "bf16", "focus")),
    ("zero3", ("plain", "activation_checkpointing", "bf16", "focus")),
]
"""Each torchrun launch of dist_worker.py and the runs it makes in turn (its ``RUNS``): one 2-process start-up per
engine, not per run."""
ONE_WORKER = pytest.mark.xdist_group("torchrun-engines")
"""The tests that read the launches: on one pytest-xdist worker, so that each launch is made once."""


@pytest.fixture(scope="module")
def launched(corpus: Path, tokenizer_file: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[[str, str], Path]:
    """(engine, run) -> that run's folder, from the launch of ``LAUNCHES`` that makes it, made when first asked."""
    folders: dict[int, Path] = {}

    def folder(mode: str, name: str) -> Path:
        launch = next(i for i, (engine, runs) in enumerate(LAUNCHES) if engine == mode and name in runs)
        if launch not in folders:
            out = tmp_path_factory.mktemp(f"{mode}-{launch}")
            run(torchrun(2, *worker(mode, out, corpus, tokenizer_file, "--runs", *LAUNCHES[launch][1])))
            folders[launch] = out
        return folders[launch] / name
    return folder


@pytest.fixture(scope="module")
def references(launched: Callable[[str, str], Path], corpus: Path, tokenizer_file: Path,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Run -> its one-process result: gradient accumulation over the 2-process DDP run's micro-batches (the same
    global batch; every run of ``LAUNCHES`` draws the same ones), for the plain, focus and muon runs."""
    out = tmp_path_factory.mktemp("reference")
    runs = ("plain", "focus", "muon")
    run([PYTHON, *worker("ddp", out, corpus, tokenizer_file, "--runs", *runs, "--reference",
                         str(launched("ddp", "plain")))])
    results = {name: torch.load(out / name / "result.pt") for name in runs}
    assert {(r["world_size"], r["accum"]) for r in results.values()} == {(1, 2)}
    return results


def result_of(folder: Path) -> dict:
    return torch.load(folder / "result.pt")


def assert_matches_reference(result: dict, reference: dict) -> None:
    assert (result["world_size"], result["accum"]) == (2, 1)
    # fp32 round-off only: the two runs sum the same per-token losses in a different order.
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]),
                               rtol=1e-5, atol=0)
    # each parameter group's pre-clip gradient norm, every step, measured where each engine keeps its gradients
    assert [norms.keys() for norms in result["group_norms"]] == [norms.keys() for norms in reference["group_norms"]]
    torch.testing.assert_close(torch.tensor([list(n.values()) for n in result["group_norms"]]),
                               torch.tensor([list(n.values()) for n in reference["group_norms"]]), rtol=1e-4, atol=0)
    assert result["params"].keys() == reference["params"].keys()
    for name, value in result["params"].items():
        torch.testing.assert_close(value, reference["params"][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@ONE_WORKER
def test_ddp_matches_one_process_with_accumulation(launched: Callable[[str, str], Path], references: dict) -> None:
    # The worker itself asserted, on every rank, that no window went to both ranks and that the full
    # parameters were bit-identical across ranks after every step.
    assert_matches_reference(result_of(launched("ddp", "plain")), references["plain"])


@pytest.mark.slow
@ONE_WORKER
def test_fsdp2_matches_one_process(launched: Callable[[str, str], Path], references: dict, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    fsdp2 = launched("fsdp2", "plain")
    for r in range(2):  # the same loader gives the same batches whatever the engine
        name = f"batches_rank{r}.pt"
        assert torch.equal(torch.load(fsdp2 / name), torch.load(launched("ddp", "plain") / name))
    fsdp2_result = result_of(fsdp2)
    assert_matches_reference(fsdp2_result, references["plain"])
    # The sharded (DCP) checkpoint consolidates offline into one file that loads in one CPU process.
    dcp_to_torch_save(fsdp2 / "dcp", tmp_path / "consolidated.pt")
    consolidated = torch.load(tmp_path / "consolidated.pt")["model"]
    for name, value in fsdp2_result["params"].items():
        assert torch.equal(consolidated[name], value), name


@pytest.mark.slow
@ONE_WORKER
@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_deepspeed_zero_matches_one_process(mode: str, launched: Callable[[str, str], Path], references: dict
                                            ) -> None:
    """ZeRO-3 partitions every weight (the worker sets the persistence threshold to 0), so each forward
    gathers them, the tied LM head's inside the fused loss included."""
    assert_matches_reference(result_of(launched(mode, "plain")), references["plain"])


@pytest.mark.slow
@ONE_WORKER
@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_deepspeed_focus_clipping_matches_one_process(mode: str, launched: Callable[[str, str], Path],
                                                      references: dict) -> None:
    """Focusing-neuron inputs under ZeRO: DeepSpeed updates its own fp32 copies of the weights, so Algorithm 3's
    clip after each step has to reach them (llm/train/deepspeed_step.py). The apertures start at the top of
    their range and step above it at once: only the clip decides where they end, so a lost clip would leave
    them at 1 + lr, beyond the tolerance."""
    reference = references["focus"]
    sigmas = torch.cat([v for name, v in reference["params"].items() if name.endswith("focus_sigma")])
    assert (sigmas == 1.0).sum() > sigmas.numel() // 4, "the clip did not bite: the test would prove nothing"
    assert_matches_reference(result_of(launched(mode, "focus")), reference)


@pytest.mark.slow
@ONE_WORKER
def test_ddp_with_muon_matches_one_process(launched: Callable[[str, str], Path], references: dict) -> None:
    """``train.optimizer=muon`` under DDP: every rank orthogonalises the same all-reduced momentum, so the ranks stay
    bit-identical (the worker checks) and the run follows one process accumulating the same global batch; the
    sharding engines refuse muon before their first step (tests/train/test_muon.py)."""
    assert_matches_reference(result_of(launched("ddp", "muon")), references["muon"])


@pytest.mark.slow
@ONE_WORKER
@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "zero2", "zero3"])
def test_activation_checkpointing_matches_one_process(mode: str, launched: Callable[[str, str], Path],
                                                      references: dict) -> None:
    """``train.activation_checkpointing = 1`` under each engine: every layer recomputed in the backward pass (inside
    FSDP2's and ZeRO-3's gather of its weights) gives the losses and parameters of the plain one-process run."""
    assert_matches_reference(result_of(launched(mode, "activation_checkpointing")), references["plain"])


@pytest.mark.slow
def test_train_py_ddp_via_accelerate_launch(corpus: Path, tokenizer_file: Path, tmp_path: Path) -> None:
    """train.py unchanged, launch/accelerate/ddp.yaml, 2 CPU processes; its checkpoint loads in one
    process, and resuming it with another number of processes stops with a clear error."""
    from transformers import AutoModelForCausalLM

    import llm  # noqa: F401  (registers the Auto classes)

    args = train_py_args(corpus, tokenizer_file, tmp_path, tmp_path / "runs")
    run(ddp_launch(args), env={"ACCELERATE_USE_CPU": "1"})

    run_dir = tmp_path / "runs" / "ddp"
    (meta,) = metrics_rows(run_dir, "meta")
    assert (meta["world_size"], meta["grad_accum"]) == (2, 1)  # 256 tokens = 4 seqs x 32 x 2 ranks
    assert (meta["engine"], meta["engine_requested"]) == ("ddp", None)
    losses = [r["loss"] for r in metrics_rows(run_dir, "train")]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))

    ckpt = run_dir / "checkpoints" / "step_00000004"
    data_states = sorted(p.name for p in (ckpt / "state").glob("data_rank*.pt"))
    assert data_states == ["data_rank0.pt", "data_rank1.pt"]
    model = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    assert not list((ckpt / "state").glob("*.safetensors"))  # the weights are saved once, in model/
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids).logits).all()

    # One process cannot continue two ranks' data streams (the loader state is per rank): it must stop
    # and say so rather than silently change the data order.
    proc = run([PYTHON, *args, "resume=true", "train.max_steps=6"], expect=2)
    assert "written by 2 processes, resuming with 1" in proc.stderr.strip().splitlines()[-1], proc.stderr


@pytest.mark.slow
def test_train_py_ddp_resume_equals_uninterrupted_run(corpus: Path, tokenizer_file: Path, tmp_path: Path) -> None:
    """2 processes through accelerate launch: a copy of a 6-step run cut back to its step-4 checkpoint,
    resumed, reproduces the uninterrupted run bitwise (weights back from model/, optimizer, scheduler and
    RNG from state/, each rank's data position from its own file)."""
    def train(out_dir: Path, *extra: str) -> None:
        args = train_py_args(corpus, tokenizer_file, tmp_path, out_dir, "train.max_steps=6", "train.eval_every=3")
        run(ddp_launch([*args, *extra]), env={"ACCELERATE_USE_CPU": "1"})

    train(tmp_path / "whole")
    whole = tmp_path / "whole" / "ddp"
    cut = tmp_path / "cut" / "ddp"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    (cut / "checkpoints" / "latest").write_text("step_00000004\n")
    train(tmp_path / "cut", "resume=true")
    assert trajectory(cut) == trajectory(whole)
    assert [r["val_loss"] for r in metrics_rows(cut, "eval")] == [r["val_loss"] for r in metrics_rows(whole, "eval")]
    assert_same_weights(whole / "checkpoints" / "step_00000006", cut / "checkpoints" / "step_00000006")


@pytest.mark.slow
@ONE_WORKER
@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "zero2", "zero3"])
def test_bf16_follows_fp32(mode: str, launched: Callable[[str, str], Path], references: dict) -> None:
    """bf16 as each engine runs it on a GPU: DDP under Accelerate's bf16 autocast; FSDP2 gathering bf16
    weights and reducing fp32 gradients; ZeRO-2 and ZeRO-3 in DeepSpeed's bf16 mode. Three steps on 2 CPU processes
    follow the fp32 reference to bf16 precision (the worker checked that the ranks stay identical)."""
    bf16, reference = result_of(launched(mode, "bf16")), references["plain"]
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(reference["losses"]), rtol=1e-3, atol=0)
    # Adam moves a weight by at most ~lr a step, and a rounding difference can flip a tiny gradient's
    # sign: two runs part by at most 2 lr per step, plus bf16's rounding of the weights ZeRO holds in bf16
    for name, value in bf16["params"].items():
        expected = reference["params"][name]
        bound = 2 * LR * STEPS + 2**-8 * expected.abs().max().item()
        assert (value.float() - expected).abs().max().item() <= bound, name
