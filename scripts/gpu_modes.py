"""What differs between the GPU check (scripts/gpu_check.py) and its CPU dry run: sizes, precision, kernels,
time boxes, and which stages each device call runs."""

from __future__ import annotations

from dataclasses import dataclass, field

COMPARED = ("ddp", "fsdp2", "deepspeed_zero3")
"""Launch configs whose losses must agree; they run first, the other single-GPU configs after the resume."""


@dataclass
class Mode:
    """What differs between the GPU check and its CPU dry run: sizes, precision, kernels and time boxes."""

    name: str
    budget_s: float
    boxes: dict[str, float]
    """Seconds each stage may take at most (also bounded by what is left of ``budget_s``)."""
    step_args: list[str]
    train_steps: int
    """Optimizer steps of each train.py run; a checkpoint half-way is where the resume starts."""
    train_overrides: list[str]
    train_configs: tuple[str, ...]
    attention_args: list[str]
    generate_args: list[str]
    step_more_args: tuple[list[str], ...]
    """bench_train_step runs beside the headline step: the experiments' micro batch, the largest size."""
    fp8_args: list[str]
    """bench_train_step with an FP8-head copy of swiglu+softmax (``--extra-row``, ``FP8_HEAD``) beside it."""
    long_args: tuple[list[str], ...]
    """bench_train_step at long context: iso_tanh against softmax, step time and the step's peak memory."""
    batch_args: tuple[list[str], ...]
    """bench_train_step for the micro batch (48 and 64 beside 32, one process) and the Qwen3 rows at 8."""
    loss_tolerance: tuple[float, float]
    """(|loss difference| allowed at step 1, relative difference of the mean loss over the last 10 steps)."""
    resume_tolerance: float
    env: dict[str, str] = field(default_factory=dict)


PARTS = {1: ("env", "step", "fp8", "long"), 2: ("env", "train"), 3: ("env", "compile", "attention", "fp8_loss"),
         4: ("env", "step_more", "generate"), 5: ("env", "pytest", "batch")}
"""The GPU check's stages by device call (``--part``); the dry run takes every stage in one. Part 1 is the short
GPU part (6 minutes at most with the machine's start-up): the headline rows, the FP8 head, long context."""

FP8_HEAD = ("lm_head_precision", "fp8")
"""FP8 head rows: the ModelConfig field and value of the FP8 LM head (lm_head.py), set on a copy of
swiglu+softmax by ``--extra-row "swiglu+softmax fp8-head:FIELD=VALUE"`` (``ModelConfig.lm_head_precision``; the
fp8 and fp8_loss stages are skipped, and say so, for a ModelConfig without it)."""

FP8_LOSS_TOLERANCE = (0.05, 0.005)
"""The FP8 head's loss against bf16's (fp8_loss stage): |difference| at step 1, and the relative difference of
the mean loss over the last 10 of 200 steps (the target: within 0.5%)."""


def fp8_row() -> str:
    return f"swiglu+softmax fp8-head:{FP8_HEAD[0]}={FP8_HEAD[1]}"


def _bench(*args: str, device: tuple[str, ...]) -> list[str]:
    return [*device, *args]


CUDA = ("--device", "cuda", "--dtype", "bf16", "--compile", "--rounds", "10")
CPU = ("--device", "cpu", "--dtype", "fp32", "--preset", "tiny", "--rounds", "3", "--threads", "1")


def _train_overrides(*model: str, steps: int, seq: int, micro: int, val_tokens: int) -> list[str]:
    return [*model, f"data.seq_len={seq}", f"train.micro_batch_size={micro}",
            f"train.global_batch_tokens={seq * micro}", f"train.max_steps={steps}",
            f"train.checkpoint_every={steps // 2}", "train.keep_checkpoints=2", f"train.warmup_steps={steps // 10}",
            "train.lr=1e-3", "train.log_every=1", f"train.eval_every={steps}",
            "train.isotropy_samples=128", "data.val_bucket=50", f"data.val_tokens={val_tokens}", "trackers=[]"]


GPU = Mode(
    name="gpu",
    budget_s=555,
    boxes={"env": 25, "step": 170, "fp8": 55, "long": 90, "pytest": 150, "train": 470, "compile": 200,
           "attention": 200, "fp8_loss": 120, "step_more": 320, "generate": 200, "batch": 300},
    step_args=_bench("--preset", "134m", "--seq", "2048", "--batch", "32", "--packed-docs", "700", "--qwen3", "liger",
                     device=CUDA),
    train_steps=100,
    train_overrides=_train_overrides("--config", "configs/sizes/134m.yaml", steps=100, seq=1024, micro=8,
                                     val_tokens=16384),
    train_configs=(*COMPARED, "single_gpu", "deepspeed_zero2"),
    attention_args=["--device", "cuda", "--dtype", "bf16", "--impls", "sdpa,chunked_compiled,fla_compiled",
                    "--batch", "4", "--heads", "8", "--head-dim", "64", "--lengths", "2048,4096,8192,16384,32768"],
    generate_args=["--device", "cuda", "--dtype", "bf16", "--preset", "134m", "--contexts", "4096", "8192", "16384",
                   "32768", "--new-tokens", "32"],
    step_more_args=tuple(
        _bench("--seq", "2048", "--qwen3", *args, device=CUDA)
        for args in (["--preset", "250m", "--batch", "8", "--variants", "swiglu+softmax"],
                     ["--preset", "134m", "--batch", "8", "--variants", "isogmlp+softmax", "swiglu+iso_tanh",
                      "--no-tf32", "swiglu+iso_tanh", "--profile", "isogmlp+softmax", "swiglu+iso_tanh"])),
    fp8_args=_bench("--preset", "134m", "--seq", "2048", "--batch", "32", "--qwen3", "--variants", "swiglu+softmax",
                    "--extra-row", fp8_row(), device=CUDA),
    long_args=tuple(_bench("--preset", "134m", "--seq", str(t), "--batch", "1", "--qwen3", "--variants",
                           "swiglu+softmax", "swiglu+iso_tanh", "--set", f"model.max_position_embeddings={t}",
                           device=CUDA) for t in (16384, 32768)),
    batch_args=(_bench("--preset", "134m", "--seq", "2048", "--batch", "32", "--qwen3", "--variants",
                       "swiglu+softmax", "--also-batch", "48", "64", device=CUDA),
                _bench("--preset", "134m", "--seq", "2048", "--batch", "8", "--variants", "swiglu+softmax",
                       device=CUDA)),
    loss_tolerance=(0.02, 0.02),
    resume_tolerance=0.05,
    # fla autotunes each kernel on first use (~50 s on the first check); bench_attention runs each length in
    # its own process, which then reuses the tuned configs from triton's on-disk cache
    env={"TRITON_CACHE_AUTOTUNING": "1"},
)
DRY = Mode(
    name="dry-run",
    budget_s=480,
    boxes={"env": 30, "step": 90, "fp8": 30, "long": 40, "pytest": 90, "train": 200, "compile": 150, "attention": 60,
           "fp8_loss": 120, "step_more": 60, "generate": 40, "batch": 60},
    step_args=_bench("--seq", "32", "--batch", "2", "--packed-docs", "8", "--qwen3", "loss-inside", "liger",
                     "--profile", device=CPU),
    train_steps=20,
    train_overrides=_train_overrides(
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
        "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.max_position_embeddings=64",
        "train.precision=fp32", steps=20, seq=32, micro=2, val_tokens=1024),
    train_configs=COMPARED,
    attention_args=["--device", "cpu", "--dtype", "fp32", "--impls", "sdpa,chunked", "--lengths", "128",
                    "--repeats", "1", "--threads", "1"],
    generate_args=["--preset", "tiny", "--contexts", "64", "128", "--new-tokens", "4", "--threads", "1"],
    step_more_args=(_bench("--seq", "32", "--batch", "4", "--variants", "swiglu+iso_tanh", "--no-tf32",
                           "swiglu+iso_tanh", "--profile", "swiglu+iso_tanh no-tf32", "--qwen3", device=CPU),),
    fp8_args=_bench("--seq", "32", "--batch", "2", "--qwen3", "--variants", "swiglu+softmax", "--extra-row", fp8_row(),
                    device=CPU),
    long_args=(_bench("--seq", "128", "--batch", "1", "--qwen3", "--variants", "swiglu+softmax", "swiglu+iso_tanh",
                      "--set", "model.max_position_embeddings=128", device=CPU),),
    batch_args=(_bench("--seq", "32", "--batch", "2", "--qwen3", "loss-outside", "--variants", "swiglu+softmax",
                       "--also-batch", "3", "4", device=CPU),),
    loss_tolerance=(1e-5, 1e-5),
    resume_tolerance=1e-5,
    env={"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"},
)
