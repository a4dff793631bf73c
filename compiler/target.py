"""Targets by name: ``cpu``/``llvm`` (this machine's CPU, its features detected) and ``cuda`` (an arch).

TVM 0.27 builds targets from dicts; a dict or a ``tvm.target.Target`` passes straight through.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import platform
from typing import Any

from tvm.target import Target, codegen

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.isa import RECORDS
from tvmattn.compiler.isa.record import Isa
from tvmattn.compiler.isa.x86_amx import AMX_FEATURES, ARCH_REQ_XCOMP_PERM, SYS_ARCH_PRCTL, XFEATURE_XTILEDATA

DEFAULT_CUDA_ARCH = "sm_90"
CPU_NAMES = ("cpu", "llvm")
CUDA_NAMES = ("cuda", "gpu")


def cpu_cores() -> int:
    """Cores this process may run on (what TVM's thread pool should use)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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


def host_target() -> Target:
    """The CPU we run on: LLVM's name for it, corrected by the features the CPU reports (`mattr_for`),
    so AVX2/AVX-512/AMX are used where present and never where absent, and its cores."""
    attrs = {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": cpu_cores()}
    flags = _cpuinfo_flags()
    amx = {name for name, llvm in CPUINFO_FEATURES.items() if llvm in AMX_FEATURES}
    if flags is not None and flags & amx and not _amx_permitted():
        flags -= amx
    mattr = () if flags is None else mattr_for(attrs["mcpu"], flags)
    return Target(attrs | ({"mattr": list(mattr)} if mattr else {}))


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
def _cpuinfo_flags() -> frozenset[str] | None:
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
    """A short readable name for a target, used to file tuning records: llvm-znver4, cuda-sm_90, and
    the features that correct the CPU's name: llvm-rocketlake+amx-bf16+…+avx512fp16."""
    if target.kind.name == "cuda":
        return f"cuda-{target.attrs.get('arch', DEFAULT_CUDA_ARCH)}"
    mcpu = target.attrs.get("mcpu")
    name = f"{target.kind.name}-{mcpu}" if mcpu else target.kind.name
    return name + "".join(str(f) for f in target.attrs.get("mattr", ()))


def is_cpu(target: Target) -> bool:
    return target.kind.name == "llvm"


_ISAS: dict[str, Isa] = {}  # target (as text) → its record


def isa_of(target: Target) -> Isa | None:
    """The instruction set a CPU target's kernels use (`tvmattn.compiler.isa`): the first record whose
    features LLVM says the target's CPU (``mcpu``, ``mattr``) has, chosen once per target; None for a GPU."""
    if not is_cpu(target):
        return None
    key = str(target)
    if key not in _ISAS:
        isa = next(r for r in RECORDS if all(has_feature(target, f) for f in r.requires))
        if str(target.attrs.get("mcpu", "")) in isa.full_width_cpus:
            isa = dataclasses.replace(isa, full_width=True)
        _ISAS[key] = isa
    return _ISAS[key]


def vector_lanes(target: Target, dtype: str = "float32") -> int:
    """Lanes of ``dtype`` in one vector register of ``target``'s CPU (`isa_of`); 1 for a GPU."""
    isa = isa_of(target)
    return 1 if isa is None else isa.vector_lanes(dtype)


def has_feature(target: Target, feature: str) -> bool:
    """Whether LLVM says ``target``'s CPU (``mcpu``, ``mattr``) has ``feature`` (e.g. "avx512bf16")."""
    try:
        return bool(codegen.llvm_cpu_has_features(feature, target))
    except Exception:  # an LLVM without that query: assume the baseline
        return False
