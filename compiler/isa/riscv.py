"""RISC-V's vector extension for the CPU kernels: RVV 1.0 at a fixed VLEN per CPU.

32 vector registers of VLEN bits; the kernels use fixed-width vectors of one register each (LMUL 1)
and LLVM sets ``vsetvli`` for them. VLEN comes from the target's ``zvl<N>b`` feature
(`compiler.cross.cpus`). The targets name the vector extension by its subset ``zve64d`` (fp32 and
fp64 vectors, which every RVV 1.0 CPU has) rather than ``v``: with ``+v`` TVM 0.27 rewrites every
vectorised loop into its scalable form, which its own legaliser then rejects (FP8ComputeLegalize:
"MatchType(value.ty())"); fixed-width code is what the kernels are scheduled as anyway.
"""

from __future__ import annotations

from tvmattn.compiler.isa.record import Isa

VECTOR_FEATURE = "zve64d"
RVV256 = Isa("rvv256", "generic", bits=256, registers=32, arch="riscv64", requires=(VECTOR_FEATURE, "zvl256b"))
RVV128 = Isa("rvv128", "generic", bits=128, registers=32, arch="riscv64", requires=(VECTOR_FEATURE, "zvl128b"))
