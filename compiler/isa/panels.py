"""The CPU kernels' query panel as a transposition in registers: a tensor intrinsic (any LLVM CPU:
shuffles of whole vectors).

QKᵀ's register tiles load whole vectors of queries (`schedules.cpu`), so each task copies its queries,
one per row in memory, into a panel with d_k major:

    fp32 FMAs (fp16 and bf16 widened)    panel[e, s]         = q[s, e]          (d_k, q_tile) fp32
    bf16 dot products (`record.Dot`)     panel[e/2, s, e%2]  = q[s, e]          (d_k/2, q_tile, 2) bf16

Both are transpositions of 32-bit words: a value, or a query's pair of d_k. Copied element by
element, LLVM makes the first a scatter per vector and the second a 16-bit extract per element. Here
a block of lanes × lanes words is transposed in registers instead: log2(lanes) rounds in which rows i
and i + b swap their off-diagonal b × b blocks, one two-source shuffle per row and round.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.ir.expr import Expr as PrimExpr
from tvm.s_tir import SBlock, SBlockRealize
from tvm.script import tirx as T

from tvmattn.compiler.isa.intrinsics import registered

PAIR = 2  # 16-bit values per 32-bit word: the products a dot-product lane sums (`record.Dot.pair`)


def query_panel_intrinsic(source: str, lanes: int, pairs: bool, argument: bool, heads_between: bool) -> str:
    """The name of the tensor intrinsic (registered on first use) that copies ``lanes`` queries ×
    lanes words of d_k (``source`` dtype, any row stride) into a block of the query panel: fp32
    values, or with ``pairs`` bf16 pairs. ``argument``: the queries are a kernel argument, whose
    memory holds bf16 pairs as the words they are; a buffer of the kernel's own is widened to fp32
    by TVM's legaliser and read through its values. ``heads_between``: rows of a (s, head, d_k)
    tensor (BSHD), one head of it."""
    argument = argument or not pairs  # (fp32 panels read values either way)
    name = (f"tvmattn_query_panel_{lanes}x{lanes}_{source}{'_pairs' if pairs else ''}"
            f"{'' if argument else '_own'}{'_bshd' if heads_between else ''}")
    return registered(name, lambda: _query_panel(source, lanes, pairs, argument, heads_between))


def _query_panel(source: str, lanes: int, pairs: bool, argument: bool,
                 heads_between: bool) -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    """`query_panel_intrinsic`'s description (a copy, element by element) and implementation: the
    description's signature with a body of ``lanes`` vector stores, which TVMScript cannot spell as a
    loop (each store's shuffles differ)."""
    width = lanes * (PAIR if pairs else 1)  # of d_k
    shape = (lanes, 1, width) if heads_between else (lanes, width)
    panel = (lanes, lanes, PAIR) if pairs else (lanes, lanes)
    dtype = "bfloat16" if pairs else "float32"

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle) -> None:
        row_stride, head_stride, pair_stride = T.int32(), T.int32(), T.int32()
        src = T.match_buffer(a, shape, source, offset_factor=1, align=tvm.DataType(source).bits // 8,
                             strides=[row_stride, head_stride, 1] if heads_between else [row_stride, 1])
        dst = T.match_buffer(b, panel, dtype, offset_factor=1,
                             strides=[pair_stride, PAIR, 1] if pairs else [pair_stride, 1])
        with T.sblock("root"):
            if heads_between:
                T.reads(src[0:lanes, 0:1, 0:width])
            else:
                T.reads(src[0:lanes, 0:width])
            if pairs:
                T.writes(dst[0:lanes, 0:lanes, 0:PAIR])
            else:
                T.writes(dst[0:lanes, 0:lanes])
            for s, e in T.grid(lanes, width):
                with T.sblock("pack"):
                    vs, ve = T.axis.remap("SS", [s, e])
                    x = T.meta_var(src[vs, 0, ve] if heads_between else src[vs, ve])
                    if pairs:
                        dst[ve // PAIR, vs, ve % PAIR] = x
                    elif source == "float32":
                        dst[ve, vs] = x
                    else:
                        dst[ve, vs] = T.cast(x, "float32")

    src, dst = desc.params
    at = (lambda s: [s, 0, 0]) if heads_between else (lambda s: [s, 0])  # noqa: E731
    if pairs:
        rows = [_pair_words(src, at(s), lanes, argument) for s in range(lanes)]
    else:
        rows = [src.vload(at(s), f"{source}x{lanes}") for s in range(lanes)]
    start = (lambda p: [p, 0, 0]) if pairs else (lambda p: [p, 0])  # noqa: E731
    stores = tirx.SeqStmt([dst.vstore(start(p), _as_panel(column, source, pairs))
                           for p, column in enumerate(transposed(rows))])  # row p of the panel: word p of each query
    root = desc.body.block
    return desc, desc.with_body(SBlockRealize([], True, SBlock([], root.reads, root.writes, "root", stores)))


def _as_panel(column: PrimExpr, source: str, pairs: bool) -> PrimExpr:
    """A transposed column as the panel stores it: bf16 pairs, or fp32 (16-bit values widened after
    the transposition, which moves half the bits; `passes.exact_widenings` reads the Cast)."""
    lanes = column.ty.dtype.lanes
    if pairs:
        return tirx.reinterpret(f"bfloat16x{PAIR * lanes}", column)
    return column if source == "float32" else tirx.Cast(f"float32x{lanes}", column)


def _pair_words(src, at: list, lanes: int, argument: bool) -> PrimExpr:
    """A query's ``lanes`` pairs of d_k from ``at`` on, as 32-bit words (low half: e = 2p, high:
    2p + 1): an argument's memory as it is; a buffer of the kernel's own through its fp32 values (as
    the dot product's pair packing reads V)."""
    if argument:
        return tirx.reinterpret(f"uint32x{lanes}", src.vload(at, f"bfloat16x{PAIR * lanes}"))
    halves = [tirx.Cast(f"float32x{lanes}", src.vload([*at[:-1], h * lanes], f"bfloat16x{lanes}"))
              for h in range(PAIR)]
    return pair_words(*(shuffle(halves, [PAIR * i + k for i in range(lanes)]) for k in range(PAIR)))  # even, odd e


def pair_words(lo: PrimExpr, hi: PrimExpr) -> PrimExpr:
    """Two vectors of bf16 values held as fp32 (exactly: their low 16 bits are zero) as 32-bit words
    of pairs, ``lo``'s value in the low half: the layout a dot product of pairs reads (`record.Dot`)."""
    lanes = lo.ty.dtype.lanes
    lo_bits, hi_bits = (tirx.reinterpret(f"uint32x{lanes}", v) for v in (lo, hi))
    return (hi_bits & tirx.const(0xFFFF0000, "uint32")) | (lo_bits >> tirx.const(16, "uint32"))


def transposed(rows: list[PrimExpr]) -> list[PrimExpr]:
    """The columns of a square matrix of words given by its rows (a power of two of them): for b = 1,
    2, 4, …, rows i and i + b (i without bit b) swap their off-diagonal b × b blocks."""
    n = len(rows)
    rows = list(rows)
    b = 1
    while b < n:
        for i in (i for i in range(n) if not i & b):
            pair = [rows[i], rows[i + b]]  # shuffle lanes 0 … n-1: row i, n … 2n-1: row i + b
            upper = [n + c - b if c & b else c for c in range(n)]  # row i keeps its lanes without bit b
            lower = [n + c if c & b else c + b for c in range(n)]  # row i + b keeps its lanes with bit b
            rows[i], rows[i + b] = (shuffle(pair, lanes) for lanes in (upper, lower))
        b *= 2
    return rows


def shuffle(vectors: list[PrimExpr], lanes: list[int]) -> PrimExpr:
    """The ``lanes`` of ``vectors`` laid end to end (LLVM's shufflevector)."""
    return tirx.Shuffle(vectors, [tirx.const(c, "int32") for c in lanes])
