"""16-bit dot products into fp32 lanes as TVM tensor intrinsics, for any instruction of the form

    acc[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1]     i < lanes, fp32 lanes

(AVX512-BF16's ``vdpbf16ps``, 16 lanes: `x86_bf16`; aarch64's ``bfdot``, 4 lanes: `arm_bf16`). Each
product of two bf16 is exact in fp32. The operands are pair-interleaved along the reduction: a register
tile of ``lanes`` output columns reads a (lanes, 2) panel ``B`` (column i's two reduction steps side by
side), and the other operand is one pair ``A`` broadcast to every lane:

    C[i] += A[k]·B[i, k]    i < lanes, k < 2         (C fp32, A and B bf16)

How it reaches LLVM. TVM lowers every bf16 value to fp32 arithmetic on uint16 storage before code
generation (BF16ComputeLegalize, BF16StorageLegalize), so a ``call_llvm_pure_intrin`` with bfloat
vector operands cannot be written in TIR. The implementation calls an external function on
``<lanes x i32>`` (the same bits) instead, whose definition, LLVM IR that bitcasts to bfloat and calls
the instruction's intrinsic, the kernel links into its module (``pragma_import_llvm``). It is
``alwaysinline``: after inlining, each call is the one instruction. P's pairs are rounded to nearest
even the same way, by a second function (two fp32 rows → their pairs).
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import tirx
from tvm.ir.expr import Expr as PrimExpr
from tvm.script import tirx as T

from tvmattn.compiler.isa.intrinsics import deferred, registered
from tvmattn.compiler.isa.panels import PAIR, pair_words
from tvmattn.compiler.isa.record import Dot
from tvmattn.compiler.te_attention import bf16_parts, bf16_truncated

BF16_BYTES = 2  # the operands' alignment: the kernels' arguments are aligned to their elements only


def dot_record(instruction: str, lanes: int, name: str, dot_function: str, pairs_function: str, llvm: str) -> Dot:
    """The `Dot` of an instruction on ``lanes`` fp32 lanes: its two tensor intrinsics registered as
    ``name`` and ``name``_pair_first; ``dot_function`` (acc, a, b as i32 words) and ``pairs_function``
    (two fp32 rows → pair words) defined in ``llvm``."""
    deferred(name, lambda: _dot(lanes, dot_function, pair_first=False))
    deferred(f"{name}_pair_first", lambda: _dot(lanes, dot_function, pair_first=True))
    prefix = "tvmattn_pairs" if lanes == 16 else f"tvmattn_pairs{lanes}"  # (AVX512-BF16's names as tuned)

    def pairs(source: str, width: int, heads_between: bool = False, part: int | None = None) -> str:
        return pairs_intrinsic(prefix, lanes, pairs_function, source, width, heads_between, part)

    return Dot(instruction, lanes, PAIR, name, f"{name}_pair_first", pairs, dot_function, llvm)


def _dot(lanes: int, function: str, pair_first: bool) -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    """The dot product's description and implementation; ``pair_first``: the block multiplies A·B,
    else B·A (tensorize matches the expression as written, and the blocks' reads in its order)."""

    @T.prim_func(s_tir=True)
    def desc(A: T.Buffer((PAIR,), "bfloat16", offset_factor=1, align=BF16_BYTES),
             B: T.Buffer((lanes, PAIR), "bfloat16", offset_factor=1, align=BF16_BYTES),
             C: T.Buffer((lanes,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            if pair_first:  # the reads in the order the expression reads them
                T.reads(C[0:lanes], A[0:PAIR], B[0:lanes, 0:PAIR])
            else:
                T.reads(C[0:lanes], B[0:lanes, 0:PAIR], A[0:PAIR])
            T.writes(C[0:lanes])
            for i, k in T.grid(lanes, PAIR):
                with T.sblock("update"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    if pair_first:
                        C[vi] = C[vi] + T.cast(A[vk], "float32") * T.cast(B[vi, vk], "float32")
                    else:
                        C[vi] = C[vi] + T.cast(B[vi, vk], "float32") * T.cast(A[vk], "float32")

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((PAIR,), "bfloat16", offset_factor=1, align=BF16_BYTES),
             B: T.Buffer((lanes, PAIR), "bfloat16", offset_factor=1, align=BF16_BYTES),
             C: T.Buffer((lanes,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:PAIR], B[0:lanes, 0:PAIR])
            T.writes(C[0:lanes])
            pair = T.meta_var(T.reinterpret(A.vload([0], "bfloat16x2"), dtype="int32"))
            C[T.ramp(T.int32(0), 1, lanes)] = T.call_pure_extern(
                f"float32x{lanes}", function, C.vload([0], f"float32x{lanes}"),
                T.reinterpret(B.vload([0, 0], f"bfloat16x{PAIR * lanes}"), dtype=f"int32x{lanes}"),
                T.broadcast(pair, lanes))

    return desc, impl


def pairs_intrinsic(prefix: str, lanes: int, function: str, source: str, width: int, heads_between: bool = False,
                    part: int | None = None) -> str:
    """The name of the tensor intrinsic (registered on first use) that packs rows t and t+1 of
    ``width`` columns (a multiple of ``lanes``; ``source`` dtype, any row stride) into the (width, 2)
    bf16 panel the dot product reads, column i's two values side by side: P (fp32, rounded to nearest
    even by ``function``) and V (bf16). ``heads_between``: the rows are of a (t, head, column) tensor
    (BSHD), one head of it. ``part`` (fp32 or fp16): the values' hi (0) or lo (1) part instead
    (`te_attention.bf16_parts`): P's, or an fp16 W's."""
    name = (f"{prefix}_{width}x2_{source}{'_bshd' if heads_between else ''}"
            f"{'' if part is None else f'_part{part}'}")
    return registered(name, lambda: tuple(_pairs(lanes, function, source, width, heads_between, x, part)
                                          for x in (False, True)))


def _pairs(lanes: int, function: str, source: str, width: int, heads_between: bool, implementation: bool,
           part: int | None) -> tirx.PrimFunc:
    """`pairs_intrinsic`'s description (a copy, element by element) or its implementation."""
    shape = (PAIR, 1, width) if heads_between else (PAIR, width)
    row: Callable = (lambda t, c: [t, 0, c]) if heads_between else (lambda t, c: [t, c])  # noqa: E731
    words = f"bfloat16x{PAIR * lanes}"

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
                for c in T.unroll(width // lanes):
                    if source == "bfloat16":  # the words (low: row t, high: row t+1), through fp32: V may
                        # be a buffer of the kernel's own that the legaliser widens (`passes.keep_operands_16bit`)
                        lo = T.meta_var(T.cast(src.vload(row(0, c * lanes), f"bfloat16x{lanes}"), f"float32x{lanes}"))
                        hi = T.meta_var(T.cast(src.vload(row(1, c * lanes), f"bfloat16x{lanes}"), f"float32x{lanes}"))
                        dst.vstore([c * lanes, 0], T.reinterpret(pair_words(lo, hi), dtype=words))
                    elif part == 0:  # the hi part: each value's top 16 bits (`pair_words` keeps just those)
                        rows = T.meta_var([_wide(src.vload(row(t, c * lanes), f"{source}x{lanes}"))
                                           for t in range(PAIR)])
                        dst.vstore([c * lanes, 0], T.reinterpret(pair_words(*rows), dtype=words))
                    else:  # fp32 (fp16 widened; the lo part: what hi leaves out) → bf16 rounded to nearest even
                        rows = T.meta_var([_left_out(_wide(src.vload(row(t, c * lanes), f"{source}x{lanes}")),
                                                     part == 1) for t in range(PAIR)])
                        dst.vstore([c * lanes, 0], T.reinterpret(T.call_pure_extern(
                            f"int32x{lanes}", function, *rows), dtype=words))

    return func


def _wide(x: PrimExpr) -> PrimExpr:
    """A vector of fp16 or fp32 values in fp32."""
    return x if x.ty.dtype.bits == 32 else tirx.Cast(f"float32x{x.ty.dtype.lanes}", x)


def _left_out(x: PrimExpr, residual: bool) -> PrimExpr:
    """x, or with ``residual`` what its hi part leaves out (x − hi, in fp32: `te_attention.bf16_parts`)."""
    return x - bf16_truncated(x) if residual else x
