"""aarch64's BF16 dot product for the CPU micro-kernels: NEON's ``bfdot`` (FEAT_BF16: Neoverse V1/V2,
Apple M2), as a TVM tensor intrinsic (`dots`: how it is described, packed and linked).

    bfdot acc.4s, a.8h, b.2h[i]     acc[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1]     i < 4, fp32 lanes

what ``vdpbf16ps`` is to AVX512-BF16, on 128 bits: two bf16 products per fp32 lane and instruction,
twice an fp32 FMA's work. The broadcast pair is taken by element, as NEON's FMA takes a query's score.
P's pairs are rounded by LLVM's ``fptrunc`` to bfloat (``bfcvtn``) and interleaved by one shuffle.
(``bfmmla``, a 2×4 by 4×2 block product, would need the panels in 2×4 blocks instead of pairs.)
"""

from __future__ import annotations

import dataclasses

from tvmattn.compiler.isa.arm import NEON
from tvmattn.compiler.isa.dots import dot_record

LANES = 4  # fp32 lanes of a NEON register
DOT_4x2 = "tvmattn_bfdot_4x2_bf16"
DOT_FUNCTION = "tvmattn_bfdot"
PAIRS_FUNCTION = "tvmattn_bfcvt_pairs"  # two fp32 rows → their bf16 pairs, rounded to nearest even
_INTERLEAVE = ", ".join(f"i32 {i // 2 + (i % 2) * LANES}" for i in range(2 * LANES))
DOT_LLVM = f"""
define <4 x float> @{DOT_FUNCTION}(<4 x float> %acc, <4 x i32> %a, <4 x i32> %b) alwaysinline {{
  %x = bitcast <4 x i32> %a to <8 x bfloat>
  %y = bitcast <4 x i32> %b to <8 x bfloat>
  %r = call <4 x float> @llvm.aarch64.neon.bfdot.v4f32.v8bf16(<4 x float> %acc, <8 x bfloat> %x, <8 x bfloat> %y)
  ret <4 x float> %r
}}
declare <4 x float> @llvm.aarch64.neon.bfdot.v4f32.v8bf16(<4 x float>, <8 x bfloat>, <8 x bfloat>)

define <4 x i32> @{PAIRS_FUNCTION}(<4 x float> %lo, <4 x float> %hi) alwaysinline {{
  %a = fptrunc <4 x float> %lo to <4 x bfloat>
  %b = fptrunc <4 x float> %hi to <4 x bfloat>
  %p = shufflevector <4 x bfloat> %a, <4 x bfloat> %b, <8 x i32> <{_INTERLEAVE}>
  %w = bitcast <8 x bfloat> %p to <4 x i32>
  ret <4 x i32> %w
}}
"""

BFDOT = dot_record("bfdot", LANES, DOT_4x2, DOT_FUNCTION, PAIRS_FUNCTION, DOT_LLVM)
NEON_BF16 = dataclasses.replace(NEON, name="neon-bf16", requires=(*NEON.requires, "bf16"), dot=BFDOT)
