"""The instruction sets the CPU kernels use, one record each (`record.Isa`), most capable first:
`tvmattn.compiler.target.isa_of` gives a target the first of its architecture whose features it has.

    x86_amx    AMX            16-bit tile products (tdpbf16ps), beside AVX512-BF16 and AVX-512
    x86_bf16   AVX512-BF16    16-bit dot products (vdpbf16ps), beside AVX-512
    x86_avx    AVX-512, AVX2  fp32 FMAs on 16 or 8 lanes (AVX-512's exp2 in five instructions)
    arm        SVE-256, NEON  aarch64: fp32 FMAs on 8 lanes (SVE at a fixed 256 bits) or 4 (NEON), 32 registers
    arm_bf16   SVE-256-BF16,  16-bit dot products (bfdot on z- or v-registers), beside SVE-256 or NEON
               NEON-BF16
    riscv      RVV-256, -128  RISC-V's vector extension at a fixed VLEN: fp32 FMAs on 8 or 4 lanes
    record     generic        any other LLVM CPU: 128-bit vectors, fp32 FMAs

A record whose CPU has fp16 vector arithmetic (`Isa.half_feature`: AVX512-FP16, FEAT_FP16) runs fp16
P·V on fp16 FMAs (`Isa.half_math`). `dots` makes a dot-product record's tensor intrinsics (any lane
count); `panels` and `lane_sums` are tensor intrinsics made of shuffles, which every LLVM CPU has: a
block of words transposed in registers (the query panel), a vector's lanes summed as a tree (decode).
"""

from tvmattn.compiler.isa.arm import NEON, SVE256
from tvmattn.compiler.isa.arm_bf16 import NEON_BF16, SVE256_BF16
from tvmattn.compiler.isa.record import GENERIC, Isa
from tvmattn.compiler.isa.riscv import RVV128, RVV256
from tvmattn.compiler.isa.x86_amx import AMX
from tvmattn.compiler.isa.x86_avx import AVX2, AVX512
from tvmattn.compiler.isa.x86_bf16 import AVX512_BF16

RECORDS: tuple[Isa, ...] = (AMX, AVX512_BF16, AVX512, AVX2, SVE256_BF16, SVE256, NEON_BF16, NEON, RVV256, RVV128,
                            GENERIC)
