"""x86's vector instruction sets without 16-bit products: AVX2 (8 fp32 lanes, 16 registers) and
AVX-512 (16 lanes, 32 registers, and an exp2 of five instructions).

AVX-512 pays even where the core splits it into two 256-bit halves (Zen 4): twice the work per
instruction and 32 registers for the accumulators. CPUs whose AVX-512 FMAs are a full 512 bits wide,
two per core (`FULL_WIDTH_CPUS`), can feed the larger register tiles the 16-bit kernels take with
fp32 too; only those measured are listed (Zen 5; an Intel server core may belong there too).
AVX512-FP16 (Sapphire Rapids on) is fp16 arithmetic on the same registers (`Isa.half_math`): fp16 P·V
that the tiles do not take runs on ``vfmadd231ph``, 32 lanes.
"""

from __future__ import annotations

from typing import Callable

from tvm import tirx
from tvm.ir.expr import Expr as PrimExpr

from tvmattn.compiler.isa.record import Isa

ARCH = "x86_64"
FULL_WIDTH_CPUS = ("znver5",)
_REDUCE_FLOOR = 0b1001  # vreduceps imm8: no fraction bits kept, round down, precision exception suppressed
_CURRENT_ROUNDING = 4  # the intrinsics' rounding argument: MXCSR's, no embedded rounding
_ALL_LANES = -1  # the intrinsics' write mask, i16


def exp2_avx512(x: PrimExpr, polynomial: Callable[[PrimExpr], PrimExpr]) -> PrimExpr:
    """2^x for a float32x16 ``x`` as vscalefps(p(vreduceps(x)), x): ``vreduceps`` gives x − ⌊x⌋ and
    ``vscalefps`` multiplies by 2^⌊x⌋, both exact at the edges, so that -inf gives 0, +inf gives +inf
    and NaN stays NaN with no clamp or test of their own (`passes.vector_exp2`; ``polynomial``: p,
    2^r on [0, 1))."""
    dtype = str(x.ty.dtype)
    mask, rounding = tirx.const(_ALL_LANES, "int16"), tirx.const(_CURRENT_ROUNDING, "int32")
    r = tirx.call_llvm_pure_intrin(dtype, "llvm.x86.avx512.mask.reduce.ps.512", x,
                                   tirx.const(_REDUCE_FLOOR, "int32"), x, mask, rounding)  # x − ⌊x⌋ ∈ [0, 1)
    p = polynomial(r)
    return tirx.call_llvm_pure_intrin(dtype, "llvm.x86.avx512.mask.scalef.ps.512", p, x, p, mask, rounding)


# (AVX without AVX2 has the same 256-bit registers: its kernels are LLVM's to select)
AVX2 = Isa("avx2", "x86", bits=256, registers=16, arch=ARCH, requires=("avx",), converts_v=True)
AVX512 = Isa("avx512", "x86", bits=512, registers=32, arch=ARCH, requires=("avx512f",), full_width_cpus=FULL_WIDTH_CPUS,
             exp2=exp2_avx512, half_feature="avx512fp16")
