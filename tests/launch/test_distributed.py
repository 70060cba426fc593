"""Multi-process CPU (gloo) runs: DDP through `accelerate launch` + train.py with our config, and DDP /
FSDP2 / DeepSpeed ZeRO-2 and ZeRO-3 (tests/launch/dist_worker.py under torchrun) against one process that
accumulates the same global batch. Each 2-process run costs 10-20 s on an idle 2-core machine."""

from __future__ import annotations

import shutil
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


@pytest.fixture(scope="module")
def ddp_run(corpus: Path, tokenizer_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    run(torchrun(2, *worker("ddp", out, corpus, tokenizer_file)))
    return out


@pytest.fixture(scope="module")
def reference(ddp_run: Path, corpus: Path, tokenizer_file: Path,
              tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process, gradient accumulation over the 2-process run's micro-batches (the same global batch)."""
    out = tmp_path_factory.mktemp("reference")
    run([PYTHON, *worker("ddp", out, corpus, tokenizer_file, "--reference", str(ddp_run))])
    result = torch.load(out / "result.pt")
    assert (result["world_size"], result["accum"]) == (1, 2)
    return result


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
def test_ddp_matches_one_process_with_accumulation(ddp_run: Path, reference: dict) -> None:
    # The worker itself asserted, on every rank, that no window went to both ranks and that the full
    # parameters were bit-identical across ranks after every step.
    assert_matches_reference(torch.load(ddp_run / "result.pt"), reference)


@pytest.mark.slow
def test_fsdp2_matches_one_process(ddp_run: Path, reference: dict, corpus: Path, tokenizer_file: Path,
                                   tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run(torchrun(2, *worker("fsdp2", tmp_path, corpus, tokenizer_file)))
    for r in range(2):  # the same loader gives the same batches whatever the engine
        name = f"batches_rank{r}.pt"
        assert torch.equal(torch.load(tmp_path / name), torch.load(ddp_run / name))
    result = torch.load(tmp_path / "result.pt")
    assert_matches_reference(result, reference)
    # The sharded (DCP) checkpoint consolidates offline into one file that loads in one CPU process.
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "consolidated.pt")
    consolidated = torch.load(tmp_path / "consolidated.pt")["model"]
    for name, value in result["params"].items():
        assert torch.equal(consolidated[name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_deepspeed_zero_matches_one_process(mode: str, ddp_run: Path, reference: dict, corpus: Path,
                                            tokenizer_file: Path, tmp_path: Path) -> None:
    """ZeRO-3 partitions every weight (the worker sets the persistence threshold to 0), so each forward
    gathers them, the tied LM head's inside the fused loss included."""
    run(torchrun(2, *worker(mode, tmp_path, corpus, tokenizer_file)))
    assert_matches_reference(torch.load(tmp_path / "result.pt"), reference)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_deepspeed_focus_clipping_matches_one_process(mode: str, ddp_run: Path, corpus: Path, tokenizer_file: Path,
                                                      tmp_path: Path) -> None:
    """Focusing-neuron inputs under ZeRO: DeepSpeed updates its own fp32 copies of the weights, so Algorithm 3's
    clip after each step has to reach them (llm/train/deepspeed_step.py). The apertures start at the top of
    their range and step above it at once: only the clip decides where they end, so a lost clip would leave
    them at 1 + lr, beyond the tolerance."""
    reference_dir = tmp_path / "reference"
    run([PYTHON, *worker("ddp", reference_dir, corpus, tokenizer_file, "--focus", "--reference", str(ddp_run))])
    reference = torch.load(reference_dir / "result.pt")
    sigmas = torch.cat([v for name, v in reference["params"].items() if name.endswith("focus_sigma")])
    assert (sigmas == 1.0).sum() > sigmas.numel() // 4, "the clip did not bite: the test would prove nothing"
    run(torchrun(2, *worker(mode, tmp_path / mode, corpus, tokenizer_file, "--focus")))
    assert_matches_reference(torch.load(tmp_path / mode / "result.pt"), reference)


@pytest.mark.slow
def test_ddp_with_muon_matches_one_process(corpus: Path, tokenizer_file: Path, tmp_path: Path) -> None:
    """``train.optimizer=muon`` under DDP: every rank orthogonalises the same all-reduced momentum, so the ranks stay
    bit-identical (the worker checks) and the run follows one process accumulating the same global batch; the
    sharding engines refuse muon before their first step (tests/train/test_muon.py)."""
    run(torchrun(2, *worker("ddp", tmp_path / "ddp", corpus, tokenizer_file, "--optimizer", "muon")))
    run([PYTHON, *worker("ddp", tmp_path / "one", corpus, tokenizer_file, "--optimizer", "muon", "--reference",
                         str(tmp_path / "ddp"))])
    result, reference = (torch.load(tmp_path / run_dir / "result.pt") for run_dir in ("ddp", "one"))
    assert_matches_reference(result, reference)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "zero2", "zero3"])
def test_activation_checkpointing_matches_one_process(mode: str, reference: dict, corpus: Path,
                                                      tokenizer_file: Path, tmp_path: Path) -> None:
    """``train.activation_checkpointing = 1`` under each engine: every layer recomputed in the backward pass (inside
    FSDP2's and ZeRO-3's gather of its weights) gives the losses and parameters of the plain one-process run."""
    run(torchrun(2, *worker(mode, tmp_path, corpus, tokenizer_file, "--activation-checkpointing", "1")))
    assert_matches_reference(torch.load(tmp_path / "result.pt"), reference)


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
@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "zero2", "zero3"])
def test_bf16_follows_fp32(mode: str, reference: dict, corpus: Path, tokenizer_file: Path, tmp_path: Path) -> None:
    """bf16 as each engine runs it on a GPU: DDP under Accelerate's bf16 autocast; FSDP2 gathering bf16
    weights and reducing fp32 gradients; ZeRO-2 and ZeRO-3 in DeepSpeed's bf16 mode. Three steps on 2 CPU processes
    follow the fp32 reference to bf16 precision (the worker checked that the ranks stay identical)."""
    run(torchrun(2, *worker(mode, tmp_path, corpus, tokenizer_file, "--bf16")))
    result = torch.load(tmp_path / "result.pt")
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-3, atol=0)
    # Adam moves a weight by at most ~lr a step, and a rounding difference can flip a tiny gradient's
    # sign: two runs part by at most 2 lr per step, plus bf16's rounding of the weights ZeRO holds in bf16
    for name, value in result["params"].items():
        expected = reference["params"][name]
        bound = 2 * LR * STEPS + 2**-8 * expected.abs().max().item()
        assert (value.float() - expected).abs().max().item() <= bound, name
