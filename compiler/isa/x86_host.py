"""What an x86-64 Linux host grants the kernels: /proc/cpuinfo's feature flags in LLVM's names (LLVM's
name for the CPU corrected by them), and Linux's permission to use AMX's tiles."""

from __future__ import annotations

import ctypes
import functools
import platform

from tvm.target import Target, codegen

from tvmattn.compiler.isa.x86_amx import AMX_FEATURES, ARCH_REQ_XCOMP_PERM, SYS_ARCH_PRCTL, XFEATURE_XTILEDATA

# The ISA extensions the kernels use, by /proc/cpuinfo's name → LLVM's. LLVM names the host CPU from
# its model number, and a VM may report one that LLVM maps to an older part: a KVM guest on Sapphire
# Rapids reads as model 167, "rocketlake", which has no AVX512-BF16, AVX512-FP16 or AMX, so its bf16
# kernels widened to fp32 FMAs. The flags are what the CPU (and the VM) actually grants.
CPUINFO_FEATURES = {
    "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx_vnni": "avxvnni",
    "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512cd": "avx512cd", "avx512bw": "avx512bw",
    "avx512vl": "avx512vl", "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi",
    "avx512_vbmi2": "avx512vbmi2", "avx512_vnni": "avx512vnni", "avx512_bitalg": "avx512bitalg",
    "avx512_vpopcntdq": "avx512vpopcntdq", "avx512_bf16": "avx512bf16", "avx512_fp16": "avx512fp16",
    "amx_tile": "amx-tile", "amx_bf16": "amx-bf16", "amx_int8": "amx-int8", "amx_fp16": "amx-fp16",
}


@functools.lru_cache(maxsize=None)
def _named_features(mcpu: str) -> frozenset[str]:
    return frozenset(codegen.llvm_get_cpu_features(Target({"kind": "llvm", "mcpu": mcpu})))


def mattr_for(mcpu: str, flags: frozenset[str] | set[str]) -> tuple[str, ...]:
    """``+f`` for each of `CPUINFO_FEATURES` in the CPU's ``flags`` (/proc/cpuinfo's) that LLVM's
    ``mcpu`` lacks, ``-f`` for each it has that the flags do not."""
    has = {llvm for name, llvm in CPUINFO_FEATURES.items() if name in flags}
    named = _named_features(mcpu) & set(CPUINFO_FEATURES.values())
    return tuple(sorted(f"+{f}" for f in has - named) + sorted(f"-{f}" for f in named - has))


@functools.lru_cache(maxsize=None)
def cpuinfo_flags() -> frozenset[str] | None:
    """The CPU's feature flags as Linux reports them; None off Linux x86-64 (LLVM's name stands)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if line is None else frozenset(line.split(":", 1)[1].split())


@functools.lru_cache(maxsize=None)
def _amx_permitted() -> bool:
    """Whether Linux lets this process use AMX's tiles (kernels from 5.16 ask first; without the
    permission the first tile instruction faults). The kernels ask again themselves, once each."""
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def host_mattr(mcpu: str) -> tuple[str, ...]:
    """The ``mattr`` that corrects LLVM's ``mcpu`` for this host (`mattr_for`): () off Linux x86-64;
    AMX's features off where Linux does not grant the tiles."""
    flags = cpuinfo_flags()
    amx = {name for name, llvm in CPUINFO_FEATURES.items() if llvm in AMX_FEATURES}
    if flags is not None and flags & amx and not _amx_permitted():
        flags -= amx
    return () if flags is None else mattr_for(mcpu, flags)
