"""What runs accelerated, decided in one place: ``acceleration(device)``, the policy of the device's type.

Every kernel choice the package makes for speed reads this policy rather than testing the device itself: whether the
small kernels called outside a compiled region are compiled (the fused loss's chunk kernel and FP8 logits,
FlexAttention's document block mask, FlexAttention itself), whether packed documents are FlexAttention's block mask
(and so training's ``flex_attention`` for softmax), whether two half-precision GEMM operands stay half with fp32
accumulation, whether iso_tanh runs fla's kernel at length, and whether ``train.tf32`` switches TF32 on. A config
switch (``train.tf32``, ``train.document_masking``) turns on only what the device's policy allows, where it is read.

``CUDA`` is CUDA's policy, everything on; any other device type runs ``PORTABLE``, the eager forms the fp64 tests pin
down. A test runs CUDA's choices on CPU tensors by mapping "cpu" to ``CUDA`` in ``POLICIES`` (tests/model/
test_cuda_policy.py, with ``compiler="aot_eager"``, which traces as inductor does without generating code): every
choice but fla's kernel then takes CUDA's branch on a CPU. What cannot run there (inductor's Triton kernels, CUDA
graphs, capability checks, memory counters, FlexAttention's backward) is listed in docs/ARCHITECTURE.md, "The CUDA
path on a CPU".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Acceleration:
    compiler: str | None
    """``torch.compile``'s backend for the kernels called outside a compiled region (``compiled``); None: eager."""
    block_mask: bool
    """Packed documents as FlexAttention's block-sparse mask, rather than a dense ``[B, 1, T, T]`` mask for SDPA."""
    half_operands: bool
    """Two half-precision GEMM operands stay half, the GEMM accumulating and writing fp32 (``out_dtype``), rather
    than both cast to fp32 first: no fp32 copies. No CPU kernel takes ``out_dtype``."""
    fla: bool
    """iso_tanh through fla's kernel (where fla can run) from ``attention.FLA_MIN_LENGTH`` positions on."""
    tf32: bool
    """``train.tf32`` runs fp32 matmuls on TF32 tensor cores (elsewhere "high" may pick other reduced paths)."""


CUDA = Acceleration(compiler="inductor", block_mask=True, half_operands=True, fla=True, tf32=True)
PORTABLE = Acceleration(compiler=None, block_mask=False, half_operands=False, fla=False, tf32=False)

# Each device type's policy; a type not listed runs PORTABLE.
POLICIES: dict[str, Acceleration] = {"cuda": CUDA}


def acceleration(device: torch.device) -> Acceleration:
    """The policy of ``device``'s type."""
    return POLICIES.get(device.type, PORTABLE)


@functools.cache
def _compile(fn: Callable[..., Any], backend: str, options: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    return torch.compile(fn, backend=backend, **dict(options))


def compiled(fn: _F, device: torch.device, **options: Any) -> _F:
    """``fn`` compiled by ``device``'s compiler (once per function, backend and options, then reused), or ``fn``
    itself where the policy compiles nothing or inside a compiled caller, which inlines it."""
    backend = None if torch.compiler.is_compiling() else acceleration(device).compiler
    return fn if backend is None else _compile(fn, backend, tuple(sorted(options.items())))
