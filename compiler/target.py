"""Targets by name: ``cpu``/``llvm`` (this machine's CPU, its features detected), ``cuda`` (an arch), and
``aarch64``/``riscv64`` (a named CPU of `cross.cpus`).

TVM 0.27 builds targets from dicts; a dict or a ``tvm.target.Target`` passes straight through.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

from tvm.target import Target, codegen

from tvmattn.compiler.cross import cpus
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.isa import RECORDS
from tvmattn.compiler.isa.record import Isa, has_feature  # noqa: F401 (re-exported)
from tvmattn.compiler.isa.x86_host import AMX_FEATURES, CPUINFO_FEATURES, host_mattr, mattr_for  # noqa: F401 (the host's)

DEFAULT_CUDA_ARCH = "sm_90"
CPU_NAMES = ("cpu", "llvm")
CUDA_NAMES = ("cuda", "gpu")


def cpu_cores() -> int:
    """Cores this process may run on (what TVM's thread pool should use)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cores_of(target: Target) -> int:
    """The cores a CPU target's kernels split their work over (its ``num-cores``; 1 where unset)."""
    return int(target.attrs.get("num-cores", 1))


def host_target() -> Target:
    """The CPU we run on: LLVM's name for it, corrected by the features the CPU reports (on x86-64
    Linux: `x86_host.host_mattr`), so the instruction sets are used where present and never where
    absent, and its cores."""
    attrs = {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": cpu_cores()}
    mattr = host_mattr(attrs["mcpu"])
    return Target(attrs | ({"mattr": list(mattr)} if mattr else {}))


def resolve_target(target: Any = "cpu", arch: str | None = None, mcpu: str | None = None) -> Target:
    """``"cpu"``, ``"llvm"``, ``"cuda"`` (with ``arch``, default sm_90), ``"aarch64"`` or ``"riscv64"``
    (with ``mcpu``, a CPU of `cross.cpus`), a target dict or a Target."""
    name = str(target).strip().lower() if isinstance(target, str) else None
    if mcpu is not None and name not in cpus.ARCHES:
        raise TvmAttnError(f"--mcpu {mcpu} names a CPU of aarch64 or riscv64: use it with --target aarch64 "
                           "or --target riscv64")
    if name in cpus.ARCHES:
        return cpus.cpu(name, mcpu).target()
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
    raise TvmAttnError(f"unknown target {target!r}: use cpu (or llvm), cuda, aarch64, riscv64, or a TVM target dict")


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


def target_arch(target: Target) -> str:
    """The LLVM architecture a CPU target builds for: its ``mtriple``'s, else this machine's."""
    triple = str(target.attrs.get("mtriple", "")) or platform.machine()
    arch = triple.split("-")[0]
    return {"arm64": "aarch64", "amd64": "x86_64"}.get(arch, arch)


HOST_ARCH = {"arm64": "aarch64", "amd64": "x86_64"}.get(platform.machine(), platform.machine())


def is_foreign(target: Target) -> bool:
    """Whether a CPU target's code cannot run on this machine (another architecture)."""
    return is_cpu(target) and "mtriple" in target.attrs and target_arch(target) != HOST_ARCH


_ISAS: dict[str, Isa] = {}  # target (as text) → its record


def isa_of(target: Target) -> Isa | None:
    """The instruction set a CPU target's kernels use (`tvmattn.compiler.isa`): the first record whose
    features LLVM says the target's CPU (``mcpu``, ``mattr``) has, chosen once per target; None for a GPU."""
    if not is_cpu(target):
        return None
    key = str(target)
    if key not in _ISAS:
        arch = target_arch(target)
        isa = next(r for r in RECORDS if r.fits(target, arch))
        if str(target.attrs.get("mcpu", "")) in isa.full_width_cpus:
            isa = dataclasses.replace(isa, full_width=True)
        if isa.half_feature and has_feature(target, isa.half_feature):
            isa = dataclasses.replace(isa, half_math=True)
        _ISAS[key] = isa
    return _ISAS[key]


def vector_lanes(target: Target, dtype: str = "float32") -> int:
    """Lanes of ``dtype`` in one vector register of ``target``'s CPU (`isa_of`); 1 for a GPU."""
    isa = isa_of(target)
    return 1 if isa is None else isa.vector_lanes(dtype)
