"""Foreign CPUs by name: what LLVM is told about each (triple, CPU, features, options), its SVE or RVV
vector length, how qemu-user emulates it, and which cross toolchain links for it.

    --target aarch64 --mcpu neoverse-v1    --target riscv64 --mcpu spacemit-x60

A CPU's record (`compiler.isa`) follows from what LLVM is told: SVE at a fixed length where the CPU's
registers are longer than NEON's (`isa.arm`), RVV's VLEN as ``zvl<N>b`` (`isa.riscv`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.isa.arm import SVE_BITS_OPTION
from tvmattn.compiler.isa.riscv import VECTOR_FEATURE

ARCHES = ("aarch64", "riscv64")


@dataclass(frozen=True)
class Cpu:
    """One CPU as the kernels are built for it and emulated."""

    name: str  # tvmattn's name (--mcpu)
    arch: str  # aarch64 or riscv64
    llvm_cpu: str  # LLVM's -mcpu (also llvm-mca's)
    cores: int  # the target's num-cores: the plan's parallel tasks
    what: str  # its vector units, in words
    mattr: tuple[str, ...] = ()
    vector_bits: int = 128  # SVE's or RVV's register length (NEON: 128)
    sve: bool = False  # SVE at ``vector_bits`` (> 128): the kernels' vectors on SVE's registers
    bf16: bool = False  # BFDOT/BFMMLA (aarch64's FEAT_BF16)

    @property
    def triple(self) -> str:
        return f"{self.arch}-linux-gnu"

    def target(self) -> Target:
        attrs: dict = {"kind": "llvm", "mtriple": self.triple, "mcpu": self.llvm_cpu, "num-cores": self.cores}
        if self.mattr:
            attrs["mattr"] = list(self.mattr)
        if self.sve:
            attrs["cl-opt"] = [f"{SVE_BITS_OPTION}:int={self.vector_bits}"]
        if self.arch == "riscv64":
            attrs["mabi"] = "lp64d"
        return Target(attrs)

    def qemu_cpu(self) -> str:
        """qemu-user's ``-cpu``: a CPU with every feature, its vector length this CPU's."""
        if self.arch == "aarch64":  # (max: SVE, BF16, fp16; SVE's length the CPU's, 128 where none is used)
            return f"max,sve{self.vector_bits}=on"
        return f"rv64,v=true,vlen={self.vector_bits},elen=64,vext_spec=v1.0,Zfh=true,Zfhmin=true"


# RISC-V: RVA22's scalar base with fp16 conversions (Zfhmin: without it LLVM's soft-float fp16 calls gave
# NaN under emulation), the vector extension as zve64d (`isa.riscv` says why), its VLEN as zvl<N>b
_RV = ("+64bit", "+m", "+a", "+f", "+d", "+c", "+zfhmin", "-v", f"+{VECTOR_FEATURE}")

CPUS: dict[str, Cpu] = {c.name: c for c in (
    Cpu("aarch64", "aarch64", "generic", 4, "NEON", mattr=("+neon",)),
    Cpu("cortex-a76", "aarch64", "cortex-a76", 4, "NEON, fp16 (Raspberry Pi 5)"),
    Cpu("neoverse-n1", "aarch64", "neoverse-n1", 64, "NEON, fp16 (Graviton2, Ampere Altra)"),
    Cpu("neoverse-v1", "aarch64", "neoverse-v1", 64, "SVE 256-bit, BF16 (Graviton3)", vector_bits=256,
        sve=True, bf16=True),
    # SVE2 at 128 bits is NEON's width: NEON's record, SVE's registers add nothing to fixed-width code
    Cpu("neoverse-v2", "aarch64", "neoverse-v2", 72, "SVE2 128-bit, BF16, I8MM (Graviton4, Grace)", bf16=True),
    Cpu("apple-m2", "aarch64", "apple-m2", 8, "NEON, fp16, BF16", bf16=True),
    Cpu("riscv64", "riscv64", "generic-rv64", 4, "RVV 1.0, VLEN 128", mattr=(*_RV, "+zvl128b")),
    # (without Zicond's czero, which qemu 7.2 cannot run: one select of a scalar bound is all it saves)
    Cpu("spacemit-x60", "riscv64", "spacemit-x60", 8, "RVV 1.0, VLEN 256 (Banana Pi F3)", vector_bits=256,
        mattr=(*_RV, "+zvl256b", "-zicond")),
)}
DEFAULT_CPU = {"aarch64": "aarch64", "riscv64": "riscv64"}


def cpu(arch: str, name: str | None = None) -> Cpu:
    """The CPU ``name`` of ``arch`` (default: the generic one)."""
    name = (name or DEFAULT_CPU[arch]).strip().lower()
    found = CPUS.get(name)
    if found is None or found.arch != arch:
        known = ", ".join(c.name for c in CPUS.values() if c.arch == arch)
        raise TvmAttnError(f"unknown {arch} CPU {name!r}: use one of {known}")
    return found


def cpu_of(target: Target) -> Cpu | None:
    """The named CPU a foreign target was made from; None for this machine's or a hand-made one."""
    triple, mcpu = str(target.attrs.get("mtriple", "")), str(target.attrs.get("mcpu", ""))
    mattr = tuple(str(f) for f in target.attrs.get("mattr", ()))
    return next((c for c in CPUS.values() if c.triple == triple and c.llvm_cpu == mcpu and c.mattr == mattr
                 and ("cl-opt" in target.attrs) == c.sve), None)
