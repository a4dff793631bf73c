"""Targets by name: ``cpu``/``llvm`` (this machine's CPU, its features detected) and ``cuda`` (an arch).

TVM 0.27 builds targets from dicts; a dict or a ``tvm.target.Target`` passes straight through.
"""

from __future__ import annotations

import os
from typing import Any

import tvm
from tvm.target import Target, codegen

from tvmattn.compiler.errors import TvmAttnError

DEFAULT_CUDA_ARCH = "sm_90"
CPU_NAMES = ("cpu", "llvm")
CUDA_NAMES = ("cuda", "gpu")


def cpu_cores() -> int:
    """Cores this process may run on (what TVM's thread pool should use)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def host_target() -> Target:
    """The CPU we run on: LLVM's name for it (so AVX2/AVX-512 are used when present) and its cores."""
    return Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": cpu_cores()})


def resolve_target(target: Any = "cpu", arch: str | None = None) -> Target:
    """``"cpu"``, ``"llvm"``, ``"cuda"`` (with ``arch``, default sm_90), a target dict or a Target."""
    if isinstance(target, Target):
        return target
    if isinstance(target, dict):
        try:
            return Target(target)
        except Exception as err:  # TVM raises its own error types with long messages
            raise TvmAttnError(f"invalid target {target!r}: {str(err).splitlines()[0]}") from None
    name = str(target).strip().lower()
    if name in CPU_NAMES:
        if arch:
            raise TvmAttnError(f"--arch {arch} is for cuda; the cpu target detects this machine's CPU")
        return host_target()
    if name in CUDA_NAMES:
        arch = arch or DEFAULT_CUDA_ARCH
        if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
            raise TvmAttnError(f"unknown CUDA arch {arch!r}: use sm_XY, e.g. sm_80, sm_89 or sm_90")
        return Target({"kind": "cuda", "arch": arch}, host=host_target())
    raise TvmAttnError(f"unknown target {target!r}: use cpu (or llvm), cuda, or a TVM target dict")


def target_key(target: Target) -> str:
    """A short readable name for a target, used to file tuning records: llvm-znver4, cuda-sm_90."""
    if target.kind.name == "cuda":
        return f"cuda-{target.attrs.get('arch', DEFAULT_CUDA_ARCH)}"
    mcpu = target.attrs.get("mcpu")
    return f"{target.kind.name}-{mcpu}" if mcpu else target.kind.name


def is_cpu(target: Target) -> bool:
    return target.kind.name == "llvm"


def vector_lanes(target: Target, dtype: str = "float32") -> int:
    """fp32 lanes of one SIMD register the schedule should fill: AVX-512 16, AVX2 8, else 4.

    AVX-512 pays even where the core splits it into two 256-bit halves (Zen 4): twice the work per
    instruction and 32 registers for the accumulators (measured +13–20% on the attention core).
    """
    if not is_cpu(target):
        return 1
    if has_feature(target, "avx512f"):
        bits = 512
    elif has_feature(target, "avx2") or has_feature(target, "avx"):
        bits = 256
    else:
        bits = 128
    return bits // tvm.DataType(dtype).bits


def has_feature(target: Target, feature: str) -> bool:
    """Whether LLVM says ``target``'s CPU (``mcpu``, ``mattr``) has ``feature`` (e.g. "avx512bf16")."""
    try:
        return bool(codegen.llvm_cpu_has_features(feature, target))
    except Exception:  # an LLVM without that query: assume the baseline
        return False
