"""AVX512-BF16 dot products for the CPU micro-kernels: ``vdpbf16ps``, as a TVM tensor intrinsic.

    vdpbf16ps acc, a, b      acc[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1]     i < 16, fp32 lanes

Two bf16 products per fp32 lane and instruction: twice the work of an fp32 FMA, with fp32
accumulation (each product of two bf16 is exact in fp32). The operands are pair-interleaved along the
reduction: a register tile of 16 output columns reads a (16, 2) panel ``B`` (column i's two reduction
steps side by side), and the other operand is one pair ``A`` broadcast to every lane:

    C[i] += A[k]·B[i, k]    i < 16, k < 2         (`DOT_16x2`, C fp32, A and B bf16)

How it reaches LLVM. TVM lowers every bf16 value to fp32 arithmetic on uint16 storage before code
generation (BF16ComputeLegalize, BF16StorageLegalize), so a ``call_llvm_pure_intrin`` with ``<32 x
bfloat>`` operands cannot be written in TIR. The implementation calls `DOT_FUNCTION` instead, an
external function on ``<16 x i32>`` (the same bits), and the kernel links its definition (`DOT.llvm`), LLVM IR
that bitcasts to bfloat and calls the intrinsic, into the kernel's module (``pragma_import_llvm``). It is
``alwaysinline``: after inlining, each call is one ``vdpbf16ps`` with the pair as an embedded broadcast.
P's pairs are rounded the same way, by `PAIRS_FUNCTION` (``vcvtne2ps2bf16`` and one shuffle).
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import tirx
from tvm.ir.expr import Expr as PrimExpr
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

from tvmattn.compiler.isa.panels import PAIR, pair_words
from tvmattn.compiler.isa.record import Dot
from tvmattn.compiler.isa.x86_avx import AVX512
from tvmattn.compiler.te_attention import bf16_parts, bf16_truncated

LANES = 16  # fp32 lanes of a zmm register
BF16_BYTES = 2  # the operands' alignment: the kernels' arguments are aligned to their elements only
DOT_16x2 = "tvmattn_dot_16x2_bf16"  # the block computes C + B·A (QKᵀ: the query panel, a key's pair)
DOT_16x2_PAIR_FIRST = "tvmattn_dot_16x2_bf16_pair_first"  # C + A·B (P·V: a pair of weights, the V panel)
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


def _dot(pair_first: bool) -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    """`DOT_16x2`'s description and implementation; ``pair_first``: the block multiplies A·B, else
    B·A (tensorize matches the expression as written, and the blocks' reads in its order)."""

    @T.prim_func(s_tir=True)
    def desc(A: T.Buffer((PAIR,), "bfloat16", offset_factor=1, align=BF16_BYTES),
             B: T.Buffer((LANES, PAIR), "bfloat16", offset_factor=1, align=BF16_BYTES),
             C: T.Buffer((LANES,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            if pair_first:  # the reads in the order the expression reads them
                T.reads(C[0:LANES], A[0:PAIR], B[0:LANES, 0:PAIR])
            else:
                T.reads(C[0:LANES], B[0:LANES, 0:PAIR], A[0:PAIR])
            T.writes(C[0:LANES])
            for i, k in T.grid(LANES, PAIR):
                with T.sblock("update"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    if pair_first:
                        C[vi] = C[vi] + T.cast(A[vk], "float32") * T.cast(B[vi, vk], "float32")
                    else:
                        C[vi] = C[vi] + T.cast(B[vi, vk], "float32") * T.cast(A[vk], "float32")

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((PAIR,), "bfloat16", offset_factor=1, align=BF16_BYTES),
             B: T.Buffer((LANES, PAIR), "bfloat16", offset_factor=1, align=BF16_BYTES),
             C: T.Buffer((LANES,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0:LANES], A[0:PAIR], B[0:LANES, 0:PAIR])
            T.writes(C[0:LANES])
            pair = T.meta_var(T.reinterpret(A.vload([0], "bfloat16x2"), dtype="int32"))
            C[T.ramp(T.int32(0), 1, LANES)] = T.call_pure_extern(
                "float32x16", DOT_FUNCTION, C.vload([0], "float32x16"),
                T.reinterpret(B.vload([0, 0], "bfloat16x32"), dtype="int32x16"), T.broadcast(pair, LANES))

    return desc, impl


TensorIntrin.register(DOT_16x2, *_dot(pair_first=False))
TensorIntrin.register(DOT_16x2_PAIR_FIRST, *_dot(pair_first=True))


def pairs_intrinsic(source: str, width: int, heads_between: bool = False, part: int | None = None) -> str:
    """The name of the tensor intrinsic (registered on first use) that packs rows t and t+1 of
    ``width`` columns (a multiple of 16; ``source`` dtype, any row stride) into the (width, 2) bf16
    panel `DOT_16x2` reads, column i's two values side by side: P (fp32, rounded to nearest even) and
    V (bf16). ``heads_between``: the rows are of a (t, head, column) tensor (BSHD), one head of it.
    ``part`` (fp32 or fp16): the values' hi (0) or lo (1) part instead (`te_attention.bf16_parts`):
    P's, or an fp16 W's."""
    name = (f"tvmattn_pairs_{width}x2_{source}{'_bshd' if heads_between else ''}"
            f"{'' if part is None else f'_part{part}'}")
    if name not in _REGISTERED:
        TensorIntrin.register(name, *(_pairs(source, width, heads_between, x, part) for x in (False, True)))
        _REGISTERED.add(name)
    return name


_REGISTERED: set[str] = set()


def _pairs(source: str, width: int, heads_between: bool, implementation: bool, part: int | None) -> tirx.PrimFunc:
    """`pairs_intrinsic`'s description (a copy, element by element) or its implementation."""
    shape = (PAIR, 1, width) if heads_between else (PAIR, width)
    row = (lambda t, c: [t, 0, c]) if heads_between else (lambda t, c: [t, c])  # noqa: E731

    @T.prim_func(s_tir=True)
    def func(a: T.handle, b: T.handle) -> None:
        row_stride, head_stride = T.int32(), T.int32()
        src = T.match_buffer(a, shape, source, offset_factor=1, align=tvm.DataType(source).bits // 8,
                             strides=[row_stride, head_stride, 1] if heads_between else [row_stride, 1])
        dst = T.match_buffer(b, (width, PAIR), "bfloat16", offset_factor=1)
        with T.sblock("root"):
            if heads_between:
                T.reads(src[0:PAIR, 0:1, 0:width])
            else:
                T.reads(src[0:PAIR, 0:width])
            T.writes(dst[0:width, 0:PAIR])
            if not implementation:
                for i, k in T.grid(width, PAIR):
                    with T.sblock("pack"):  # the block's iterators as a copy's: row, column
                        vk, vi = T.axis.remap("SS", [k, i])
                        if heads_between:
                            dst[vi, vk] = src[vk, 0, vi]
                        elif source == "bfloat16":
                            dst[vi, vk] = src[vk, vi]
                        elif part is not None:
                            dst[vi, vk] = bf16_parts(src[vk, vi])[part]
                        else:
                            dst[vi, vk] = T.cast(src[vk, vi], "bfloat16")
            else:
                # (meta_var: expressions, not bindings: a let in the block would leave the scope without
                # a stage pipeline for later schedule primitives)
                for c in T.unroll(width // LANES):
                    if source == "bfloat16":  # the words (low: row t, high: row t+1), through fp32: V may
                        # be a buffer of the kernel's own that the legaliser widens (`passes.keep_operands_16bit`)
                        lo = T.meta_var(T.cast(src.vload(row(0, c * LANES), "bfloat16x16"), "float32x16"))
                        hi = T.meta_var(T.cast(src.vload(row(1, c * LANES), "bfloat16x16"), "float32x16"))
                        words = T.meta_var(pair_words(lo, hi))
                        dst.vstore([c * LANES, 0], T.reinterpret(words, dtype="bfloat16x32"))
                    elif part == 0:  # the hi part: each value's top 16 bits (`pair_words` keeps just those)
                        rows = T.meta_var([_wide(src.vload(row(t, c * LANES), f"{source}x{LANES}"))
                                           for t in range(PAIR)])
                        dst.vstore([c * LANES, 0], T.reinterpret(pair_words(*rows), dtype="bfloat16x32"))
                    else:  # fp32 (fp16 widened; the lo part: what hi leaves out) → bf16 rounded to nearest
                        # even, on vcvtne2ps2bf16
                        rows = T.meta_var([_left_out(_wide(src.vload(row(t, c * LANES), f"{source}x{LANES}")),
                                                     part == 1) for t in range(PAIR)])
                        dst.vstore([c * LANES, 0], T.reinterpret(T.call_pure_extern(
                            "int32x16", PAIRS_FUNCTION, *rows), dtype="bfloat16x32"))

    return func


def _wide(x: PrimExpr) -> PrimExpr:
    """A vector of fp16 or fp32 values in fp32."""
    return x if x.ty.dtype.bits == 32 else tirx.Cast(f"float32x{x.ty.dtype.lanes}", x)


def _left_out(x: PrimExpr, residual: bool) -> PrimExpr:
    """x, or with ``residual`` what its hi part leaves out (x − hi, in fp32: `te_attention.bf16_parts`)."""
    return x - bf16_truncated(x) if residual else x


BF16_DOT = Dot("vdpbf16ps", LANES, PAIR, DOT_16x2, DOT_16x2_PAIR_FIRST, pairs_intrinsic, DOT_FUNCTION, DOT_LLVM)
# Zen 4, Sapphire Rapids and later
AVX512_BF16 = dataclasses.replace(AVX512, name="avx512-bf16", requires=(*AVX512.requires, "avx512bf16"), dot=BF16_DOT)
