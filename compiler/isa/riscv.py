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
# fp32 on the larger register tiles (32 queries × 4 vectors of d_v): llvm-mca's in-order SiFive vector
# models (X280, P670; none for X60) put the 16-accumulator tiles at 65-70 % / 99 % of the FMA peak where
# the 8-accumulator ones reach 59-66 %: more independent FMAs between the loads a key's broadcast waits on
RVV256 = Isa("rvv256", "generic", bits=256, registers=32, arch="riscv64", requires=(VECTOR_FEATURE, "zvl256b"),
             full_width=True)
RVV128 = Isa("rvv128", "generic", bits=128, registers=32, arch="riscv64", requires=(VECTOR_FEATURE, "zvl128b"))
