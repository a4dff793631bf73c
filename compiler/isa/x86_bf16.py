"""AVX512-BF16 dot products for the CPU micro-kernels: ``vdpbf16ps``, as a TVM tensor intrinsic
(`dots`: how it is described, packed and linked).

    vdpbf16ps acc, a, b      acc[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1]     i < 16, fp32 lanes

Two bf16 products per fp32 lane and instruction: twice the work of an fp32 FMA. After inlining, each
call of `DOT_FUNCTION` is one ``vdpbf16ps`` with the pair as an embedded broadcast; P's pairs are
rounded by `PAIRS_FUNCTION` (``vcvtne2ps2bf16`` and one shuffle).
"""

from __future__ import annotations

import dataclasses

from tvmattn.compiler.isa.dots import dot_record
from tvmattn.compiler.isa.record import Narrow
from tvmattn.compiler.isa.x86_avx import AVX512

LANES = 16  # fp32 lanes of a zmm register
DOT_16x2 = "tvmattn_dot_16x2_bf16"  # the block computes C + B·A (QKᵀ: the query panel, a key's pair)
DOT_16x2_PAIR_FIRST = f"{DOT_16x2}_pair_first"  # C + A·B (P·V: a pair of weights, the V panel)
DOT_FUNCTION = "tvmattn_dpbf16ps"
PAIRS_FUNCTION = "tvmattn_cvtne2ps2bf16_pairs"  # two fp32 rows → their bf16 pairs, rounded to nearest even
# vcvtne2ps2bf16 puts its second operand's 16 values below its first's; the panel wants them interleaved
_INTERLEAVE = ", ".join(f"i32 {i // 2 + (i % 2) * 16}" for i in range(32))
DOT_LLVM = f"""
define <16 x float> @{DOT_FUNCTION}(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) alwaysinline {{
  %x = bitcast <16 x i32> %a to <32 x bfloat>
  %y = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %x, <32 x bfloat> %y)
  ret <16 x float> %r
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)

define <16 x i32> @{PAIRS_FUNCTION}(<16 x float> %lo, <16 x float> %hi) alwaysinline {{
  %r = call <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float> %hi, <16 x float> %lo)
  %p = shufflevector <32 x bfloat> %r, <32 x bfloat> poison, <32 x i32> <{_INTERLEAVE}>
  %w = bitcast <32 x bfloat> %p to <16 x i32>
  ret <16 x i32> %w
}}
declare <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float>, <16 x float>)
"""

BF16_DOT = dot_record("vdpbf16ps", LANES, DOT_16x2, DOT_FUNCTION, PAIRS_FUNCTION, DOT_LLVM)

# a vector of fp32 rounded to bf16 bits, one instruction per 16 lanes (a 32-lane vector in two halves)
_HALVES = ", ".join(f"i32 {i}" for i in range(16)), ", ".join(f"i32 {i}" for i in range(16, 32))
NARROW_LLVM = f"""
define <16 x i16> @tvmattn_cvtneps2bf16_16(<16 x float> %x) alwaysinline {{
  %r = call <16 x bfloat> @llvm.x86.avx512bf16.cvtneps2bf16.512(<16 x float> %x)
  %w = bitcast <16 x bfloat> %r to <16 x i16>
  ret <16 x i16> %w
}}
declare <16 x bfloat> @llvm.x86.avx512bf16.cvtneps2bf16.512(<16 x float>)

define <32 x i16> @tvmattn_cvtneps2bf16_32(<32 x float> %x) alwaysinline {{
  %lo = shufflevector <32 x float> %x, <32 x float> poison, <16 x i32> <{_HALVES[0]}>
  %hi = shufflevector <32 x float> %x, <32 x float> poison, <16 x i32> <{_HALVES[1]}>
  %r = call <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float> %hi, <16 x float> %lo)
  %w = bitcast <32 x bfloat> %r to <32 x i16>
  ret <32 x i16> %w
}}
declare <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float>, <16 x float>)
"""
BF16_NARROW = Narrow(((16, "tvmattn_cvtneps2bf16_16"), (32, "tvmattn_cvtneps2bf16_32")), NARROW_LLVM)
# Zen 4, Sapphire Rapids and later
AVX512_BF16 = dataclasses.replace(AVX512, name="avx512-bf16", requires=(*AVX512.requires, "avx512bf16"), dot=BF16_DOT,
                                  narrow=BF16_NARROW)
