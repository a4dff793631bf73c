"""aarch64's BF16 dot product for the CPU micro-kernels: NEON's ``bfdot`` (FEAT_BF16: Neoverse V1/V2,
Apple M2), as a TVM tensor intrinsic (`dots`: how it is described, packed and linked).

    bfdot acc.4s, a.8h, b.2h[i]     acc[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1]     i < 4, fp32 lanes

what ``vdpbf16ps`` is to AVX512-BF16, on 128 bits: two bf16 products per fp32 lane and instruction,
twice an fp32 FMA's work. The broadcast pair is taken by element, as NEON's FMA takes a query's score,
from a 32-bit load: written as the intrinsic's vector form, LLVM loaded it by ``ld1r``, whose replicate
takes a vector pipe on Neoverse V2 (a fifth of the loop's issue), so the instruction is inline assembly
(no memory, no side effects: the accumulators stay in registers).
P's pairs are rounded by LLVM's ``fptrunc`` to bfloat (``bfcvtn``) and interleaved by one shuffle.
(``bfmmla``, a 2×4 by 4×2 block product, would need the panels in 2×4 blocks instead of pairs.)

SVE's ``bfdot z.s, z.h, z.h`` (Neoverse V1) is the same product on SVE-256's 8 lanes: the record's
vectors are fixed-width (`arm`), so its function moves them into scalable registers and back
(``llvm.vector.insert``/``extract``, no instructions where the length is known to be 256 bits) around
LLVM's SVE intrinsic. A 4-lane NEON bfdot in SVE-256's 8-lane tiles would not tensorize (the dot
must cover the tile's vector), and NEON's tiles on V1 would halve the fp32 tiles' width for bf16.
The broadcast pair is a whole register (SVE's indexed form picks within each 128-bit segment, a
broadcast needs no index).
"""

from __future__ import annotations

import dataclasses

from tvmattn.compiler.isa.arm import NEON, SVE256
from tvmattn.compiler.isa.dots import dot_record

LANES = 4  # fp32 lanes of a NEON register
DOT_4x2 = "tvmattn_bfdot_4x2_bf16"
DOT_FUNCTION = "tvmattn_bfdot"
PAIRS_FUNCTION = "tvmattn_bfcvt_pairs"  # two fp32 rows → their bf16 pairs, rounded to nearest even
_INTERLEAVE = ", ".join(f"i32 {i // 2 + (i % 2) * LANES}" for i in range(2 * LANES))
DOT_LLVM = f"""
define <4 x float> @{DOT_FUNCTION}(<4 x float> %acc, <4 x i32> %a, <4 x i32> %b) alwaysinline {{
  %pair = extractelement <4 x i32> %b, i64 0
  %y = bitcast i32 %pair to <2 x i16>
  %r = call <4 x float> asm "bfdot $0.4s, $1.8h, $2.2h[0]", "=w,w,w,0"(<4 x i32> %a, <2 x i16> %y, <4 x float> %acc) #0
  ret <4 x float> %r
}}
attributes #0 = {{ nounwind willreturn nosync memory(none) }}

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

SVE_LANES = 8  # fp32 lanes of SVE-256
SVE_DOT_8x2 = "tvmattn_sve_bfdot_8x2_bf16"
SVE_DOT_FUNCTION = "tvmattn_sve_bfdot"
SVE_PAIRS_FUNCTION = "tvmattn_sve_bfcvt_pairs"
SVE_DOT_LLVM = f"""
define <8 x float> @{SVE_DOT_FUNCTION}(<8 x float> %acc, <8 x i32> %a, <8 x i32> %b) alwaysinline {{
  %sacc = call <vscale x 4 x float> @llvm.vector.insert.nxv4f32.v8f32(
      <vscale x 4 x float> poison, <8 x float> %acc, i64 0)
  %ia = call <vscale x 4 x i32> @llvm.vector.insert.nxv4i32.v8i32(<vscale x 4 x i32> poison, <8 x i32> %a, i64 0)
  %ib = call <vscale x 4 x i32> @llvm.vector.insert.nxv4i32.v8i32(<vscale x 4 x i32> poison, <8 x i32> %b, i64 0)
  %sx = bitcast <vscale x 4 x i32> %ia to <vscale x 8 x bfloat>
  %sy = bitcast <vscale x 4 x i32> %ib to <vscale x 8 x bfloat>
  %r = call <vscale x 4 x float> @llvm.aarch64.sve.bfdot(
      <vscale x 4 x float> %sacc, <vscale x 8 x bfloat> %sx, <vscale x 8 x bfloat> %sy)
  %f = call <8 x float> @llvm.vector.extract.v8f32.nxv4f32(<vscale x 4 x float> %r, i64 0)
  ret <8 x float> %f
}}
declare <vscale x 4 x float> @llvm.vector.insert.nxv4f32.v8f32(<vscale x 4 x float>, <8 x float>, i64)
declare <vscale x 4 x i32> @llvm.vector.insert.nxv4i32.v8i32(<vscale x 4 x i32>, <8 x i32>, i64)
declare <8 x float> @llvm.vector.extract.v8f32.nxv4f32(<vscale x 4 x float>, i64)
declare <vscale x 4 x float> @llvm.aarch64.sve.bfdot(<vscale x 4 x float>, <vscale x 8 x bfloat>, <vscale x 8 x bfloat>)

define <8 x i32> @{SVE_PAIRS_FUNCTION}(<8 x float> %lo, <8 x float> %hi) alwaysinline {{
  %a = fptrunc <8 x float> %lo to <8 x bfloat>
  %b = fptrunc <8 x float> %hi to <8 x bfloat>
  %ia = bitcast <8 x bfloat> %a to <8 x i16>
  %ib = bitcast <8 x bfloat> %b to <8 x i16>
  %za = zext <8 x i16> %ia to <8 x i32>
  %zb = zext <8 x i16> %ib to <8 x i32>
  %sb = shl <8 x i32> %zb, splat (i32 16)
  %w = or <8 x i32> %za, %sb
  ret <8 x i32> %w
}}
"""

SVE_BFDOT = dot_record("bfdot", SVE_LANES, SVE_DOT_8x2, SVE_DOT_FUNCTION, SVE_PAIRS_FUNCTION, SVE_DOT_LLVM)
SVE256_BF16 = dataclasses.replace(SVE256, name="sve256-bf16", requires=(*SVE256.requires, "bf16"), dot=SVE_BFDOT)
