"""RISC-V's vector extension for the CPU kernels: RVV 1.0 at a fixed VLEN per CPU.

32 vector registers of VLEN bits; the kernels use fixed-width vectors of one register each (LMUL 1), or
at VLEN 256 of a group of two (LMUL 2: the record's 512-bit vectors, 16 of them), and LLVM sets
``vsetvli`` for them. VLEN comes from the target's ``zvl<N>b`` feature
(`compiler.cross.cpus`). The targets name the vector extension by its subset ``zve64d`` (fp32 and
fp64 vectors, which every RVV 1.0 CPU has) rather than ``v``: with ``+v`` TVM 0.27 rewrites every
vectorised loop into its scalable form, which its own legaliser then rejects (FP8ComputeLegalize:
"MatchType(value.ty())"); fixed-width code is what the kernels are scheduled as anyway.
"""

from __future__ import annotations

from tvmattn.compiler.isa.record import Isa

VECTOR_FEATURE = "zve64d"
# VLEN 256 on register groups of two (LMUL 2): 16 vectors of 512 bits, half the instructions for the same
# work. llvm-mca's in-order SiFive vector models (X280, P670; none for X60) put the loops of single
# registers at 65-70 % / 99 % of the FMA peak (their 16-accumulator tiles; 8 gave 59-66 %); on groups,
# with 12 accumulators (48 queries × 4 keys, 6 queries × 2 vectors of d_v), at 82 % and 79 % of X280's
# m2 FMA peak (2.63, 2.53 products a cycle, from 1.68, 1.83) and 100 % of P670's; P·V's loop over keys
# two a step: 85 % (its loop instructions, one a key, were what kept it under 80)
RVV256 = Isa("rvv256", "generic", bits=512, registers=16, arch="riscv64", requires=(VECTOR_FEATURE, "zvl256b"),
             tile_knobs=(("q_tile", 48), ("qk_keys", 4), ("pv_rows", 6), ("pv_vecs", 2)), key_step=2)
RVV128 = Isa("rvv128", "generic", bits=128, registers=32, arch="riscv64", requires=(VECTOR_FEATURE, "zvl128b"))
