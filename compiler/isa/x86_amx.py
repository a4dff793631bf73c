"""AMX-BF16 tile products for the CPU micro-kernels (Sapphire Rapids and later), as TVM tensor intrinsics.

AMX holds eight tile registers of up to 16 rows × 64 bytes. ``tdpbf16ps c, a, b`` multiplies a
16 × 32 bf16 tile by a pair-interleaved 16 × (16 × 2) one into 16 × 16 fp32 accumulators:

    C[m, n] += Σ_k A[m, k] · B[k / 2, n, k % 2]        m, n < 16, k < 32        (fp32 accumulation)

16 × 16 × 32 products per instruction, 16× an fp32 FMA's 16. The B operand is the pair panel the
AVX512-BF16 kernels already read (`x86_bf16`: two steps of the reduction side by side per fp32
lane); A is a plain row-major matrix, so QKᵀ reads the keys in place. Every kernel here keeps a
32 × 32 block of accumulators in four tiles (C: tmm0–3), two tiles of A rows (tmm4, 5) and two of B
columns (tmm6, 7) per step, the largest block eight tiles hold:

    tmm(2i + j) += tmm(4 + i) · tmm(6 + j)                 i, j < 2

The block's accumulator is a buffer (`cache_write`'s, scope local) whose three stages are the three
intrinsics here: `ZERO` (tilezero), `DOT` (two tile loads of each operand, four products) and
`STORE` (tilestored to the block's place in memory). The buffer is never touched in memory: between
ZERO and STORE its values live in tmm0–3, and no other instruction of the kernel uses the tiles.

Each task of a kernel configures the tiles before its first tile instruction (`BEGIN`: every tile
16 rows × 64 bytes; and, once per process, Linux's permission to use AMX's state, which the first
tile instruction would otherwise fault on) and releases them after its last (`END`), so a task never
depends on what another library left in the tile configuration of its thread (torch's OpenMP workers
run oneDNN's AMX kernels too). `tile_configuration` (a pass) places both around each loop marked
`TILES`.
"""

from __future__ import annotations

import dataclasses
import functools

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import SBlock, SBlockRealize, Schedule
from tvm.script import tirx as T

from tvmattn.compiler.annotations import AMX_TILES
from tvmattn.compiler.isa.intrinsics import deferred, registered
from tvmattn.compiler.isa.panels import PAIR, pair_words, transposed
from tvmattn.compiler.isa.record import Tiles
from tvmattn.compiler.isa.x86_bf16 import AVX512_BF16, DOT_LLVM

ROWS = 16  # rows of a tile: of A and C, and B's pairs of the reduction
STEP = 32  # bf16 of the reduction per tile row (64 bytes)
BLOCK = 2 * ROWS  # the accumulator block: 2 × 2 tiles of 16 × 16 fp32
ZERO = "tvmattn_amx_zero_32x32"  # (`zero_intrinsic`)
DOT = "tvmattn_amx_dot_32x32x32"
STORE = "tvmattn_amx_store_32x32"
BEGIN = "tvmattn_amx_begin"
END = "tvmattn_amx_end"
TILES = AMX_TILES
BF16_BYTES, F32_BYTES = 2, 4
AMX_FEATURES = ("amx-tile", "amx-bf16", "amx-int8", "amx-fp16")  # LLVM's names
ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 0x1023, 18  # Linux's arch_prctl: the AMX tile data state
SYS_ARCH_PRCTL = 158  # x86-64

# ldtilecfg's 64-byte operand: palette 1, then per tile its bytes per row (u16, from byte 16) and its
# rows (u8, from byte 48); every tile 16 × 64 bytes
_PALETTE = bytes([1] + [0] * 15 + [64, 0] * 8 + [0] * 16 + [ROWS] * 8 + [0] * 8)
_CONFIG = "".join(f"\\{b:02X}" for b in _PALETTE)
# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): this process may use the tiles' state
_SYSCALL = f"i64 {SYS_ARCH_PRCTL}, i64 {ARCH_REQ_XCOMP_PERM}, i64 {XFEATURE_XTILEDATA}"
AMX_LLVM = f"""
@tvmattn_amx_palette = private unnamed_addr constant [64 x i8] c"{_CONFIG}", align 64
@tvmattn_amx_asked = internal global i32 0, align 4

define i32 @{BEGIN}() {{
  %asked = load atomic i32, ptr @tvmattn_amx_asked monotonic, align 4
  %done = icmp ne i32 %asked, 0
  br i1 %done, label %configure, label %ask
ask:
  %r = call i64 asm sideeffect "syscall", "={{rax}},{{rax}},{{rdi}},{{rsi}},~{{rcx}},~{{r11}},~{{memory}}"(
    {_SYSCALL})
  store atomic i32 1, ptr @tvmattn_amx_asked monotonic, align 4
  br label %configure
configure:
  call void @llvm.x86.ldtilecfg(ptr @tvmattn_amx_palette)
  ret i32 0
}}

define i32 @{END}() {{
  call void @llvm.x86.tilerelease()
  ret i32 0
}}
declare void @llvm.x86.ldtilecfg(ptr)
declare void @llvm.x86.tilerelease()
"""


def configure_tiles(sch: Schedule, task) -> None:
    """Mark the parallel loop ``task``: each of its iterations configures the tiles first and releases
    them last (`tile_configuration`)."""
    sch.annotate(task, TILES, 1)


def tile_configuration() -> tvm.transform.Pass:
    """Each iteration of a loop marked `TILES` calls `BEGIN` first and `END` last (a parallel task's
    iterations run on any thread of the pool, each configures its own)."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.AmxTileConfiguration")
    def transform(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
        def on_for(loop: tirx.For):
            if TILES not in loop.annotations:
                return loop
            body = tirx.SeqStmt([tirx.Evaluate(tirx.call_extern("int32", BEGIN)), loop.body,
                                 tirx.Evaluate(tirx.call_extern("int32", END))])
            annotations = {k: v for k, v in loop.annotations.items() if k != TILES}
            return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding, annotations)

        return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.For, on_for)]))

    return transform


def _tile(op: str, *args) -> tirx.Call:
    return tirx.call_llvm_intrin("void", f"llvm.x86.{op}", *args)


def _id(tile: int) -> tirx.IntImm:
    return tirx.const(tile, "int8")


def _bytes(stride, size: int):
    return tirx.Cast("int64", stride) * size


def _address(buf: tirx.Buffer, *index) -> tirx.Call:
    """The address of ``buf[index]`` (an element's, so that it stays right where TVM's storage rewrite
    merges the kernel's buffers into one allocation of another type)."""
    return tirx.address_of(tirx.BufferLoad(buf, list(index)))


def _block(func: tirx.PrimFunc, body: list) -> tirx.PrimFunc:
    """``func``'s signature and root block, with ``body`` (a list of statements) as its body."""
    root = func.body.block
    stmts = tirx.SeqStmt([s if isinstance(s, tirx.Stmt) else tirx.Evaluate(s) for s in body])
    block = SBlock([], root.reads, root.writes, "root", stmts)
    return func.with_body(SBlockRealize([], True, block))


def _zero(gemm: bool) -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    """`ZERO` (``gemm``: iterating as `dot_intrinsic`'s with ``gemm``)."""
    @T.prim_func(s_tir=True)
    def zero(c: T.handle) -> None:
        C = T.match_buffer(c, (BLOCK, BLOCK), "float32", scope="local", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:BLOCK, 0:BLOCK])
            for m, n in T.grid(BLOCK, BLOCK):
                with T.sblock("zero"):  # (iterators in the block's order: see `dot_intrinsic`)
                    if gemm:
                        vm, vn = T.axis.remap("SS", [m, n])
                        C[vm, vn] = T.float32(0)
                    else:
                        vn, vm = T.axis.remap("SS", [n, m])
                        C[vm, vn] = T.float32(0)

    zeros = [_tile("tilezero", _id(2 * i + j)) for i, j in HALVES]
    return zero, _block(zero, zeros)


def _store() -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    """`STORE`."""
    @T.prim_func(s_tir=True)
    def store(c: T.handle, d: T.handle) -> None:
        ldd = T.int32()
        C = T.match_buffer(c, (BLOCK, BLOCK), "float32", scope="local", offset_factor=1)
        D = T.match_buffer(d, (BLOCK, BLOCK), "float32", strides=[ldd, 1], offset_factor=1, align=F32_BYTES)
        with T.sblock("root"):
            T.reads(C[0:BLOCK, 0:BLOCK])
            T.writes(D[0:BLOCK, 0:BLOCK])
            for m, n in T.grid(BLOCK, BLOCK):
                with T.sblock("store"):
                    vm, vn = T.axis.remap("SS", [m, n])
                    D[vm, vn] = C[vm, vn]

    _, D = store.params
    stores = [_tile("tilestored64", _id(2 * i + j), _address(D, i * ROWS, j * ROWS),
                    _bytes(D.strides[0], F32_BYTES)) for i, j in HALVES]
    return store, _block(store, stores)


def zero_intrinsic(gemm: bool = False) -> str:
    """The name of `ZERO` for a block iterating as `dot_intrinsic`'s (``gemm``: row, column)."""
    return ZERO + ("_gemm" if gemm else "")


def _load_rows(a: tirx.Buffer, row) -> list:
    """A's 32 rows (``row(m, k)``: an index of A) into tmm4 and tmm5."""
    return [_tile("tileloadd64", _id(4 + i), _address(a, *row(i * ROWS, 0)), _bytes(a.strides[0], BF16_BYTES))
            for i in range(2)]


def _load_pairs(b: tirx.Buffer) -> list:
    """B's 32 columns of pairs into tmm6 and tmm7."""
    return [_tile("tileloadd64", _id(6 + j), _address(b, 0, j * ROWS, 0), _bytes(b.strides[0], BF16_BYTES))
            for j in range(2)]


HALVES = [(i, j) for i in range(2) for j in range(2)]  # the accumulator's tiles: (row half, column half)
PRODUCTS = [_tile("tdpbf16ps", _id(2 * i + j), _id(4 + i), _id(6 + j)) for i, j in HALVES]  # tmm(2i+j) += A_i·B_j
for _gemm in (False, True):
    deferred(zero_intrinsic(_gemm), functools.partial(_zero, _gemm))
deferred(STORE, _store)


def dot_intrinsic(heads_between: bool = False, gemm: bool = False, parts: bool = False) -> str:
    """The name of `DOT` for a row operand A of any row stride, registered on first use:
    ``heads_between``, rows of a (t, head, e) tensor (BSHD), one head of it. The attention's stages
    (QKᵀ, P·V) iterate (column, row, k) and multiply B·A; with ``gemm``, a projection's, (row,
    column, k) and A·B (x·W). ``parts``: fp16 operands as two bf16 parts each (`parts_dot`)."""
    if parts:
        return parts_dot(gemm)
    name = DOT + ("_bshd" if heads_between else "") + ("_gemm" if gemm else "")
    return registered(name, functools.partial(_dot, heads_between, gemm))


def _dot(heads_between: bool, gemm: bool) -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    shape = (BLOCK, 1, STEP) if heads_between else (BLOCK, STEP)
    row = (lambda m, k: [m, 0, k]) if heads_between else (lambda m, k: [m, k])  # noqa: E731

    @T.prim_func(s_tir=True)
    def dot(a: T.handle, b: T.handle, c: T.handle) -> None:
        lda, head_stride, ldb = T.int32(), T.int32(), T.int32()
        A = T.match_buffer(a, shape, "bfloat16", strides=[lda, head_stride, 1] if heads_between else [lda, 1],
                           offset_factor=1, align=BF16_BYTES)
        B = T.match_buffer(b, (STEP // PAIR, BLOCK, PAIR), "bfloat16", strides=[ldb, PAIR, 1], offset_factor=1,
                           align=BF16_BYTES)
        C = T.match_buffer(c, (BLOCK, BLOCK), "float32", scope="local", offset_factor=1)
        with T.sblock("root"):
            a_region = T.meta_var(A[0:BLOCK, 0:1, 0:STEP] if heads_between else A[0:BLOCK, 0:STEP])
            if gemm:
                T.reads(C[0:BLOCK, 0:BLOCK], a_region, B[0:STEP // PAIR, 0:BLOCK, 0:PAIR])
            else:
                T.reads(C[0:BLOCK, 0:BLOCK], B[0:STEP // PAIR, 0:BLOCK, 0:PAIR], a_region)
            T.writes(C[0:BLOCK, 0:BLOCK])
            for m, n, k in T.grid(BLOCK, BLOCK, STEP):
                with T.sblock("update"):
                    if gemm:
                        vm, vn, vk = T.axis.remap("SSR", [m, n, k])
                        C[vm, vn] = C[vm, vn] + T.cast(A[tuple(row(vm, vk))], "float32") * T.cast(
                            B[vk // PAIR, vn, vk % PAIR], "float32")
                    else:
                        vn, vm, vk = T.axis.remap("SSR", [n, m, k])
                        C[vm, vn] = C[vm, vn] + T.cast(B[vk // PAIR, vn, vk % PAIR], "float32") * T.cast(
                            A[tuple(row(vm, vk))], "float32")

    A, B, _ = dot.params
    return dot, _block(dot, _load_rows(A, row) + _load_pairs(B) + PRODUCTS)


def parts_dot(gemm: bool = False) -> str:
    """`DOT` of operands that are sums of two bf16 parts (`te_attention.bf16_parts`: fp16 as hi + lo):
    C += B_hi·A_hi + B_hi·A_lo + B_lo·A_hi (``gemm``: A_hi·B_hi + A_hi·B_lo + A_lo·B_hi, iterating as
    `dot_intrinsic`'s), three tile products per pair of tiles (10 tile loads and 12 products per step
    of 32, against 4 and 4), each part in a buffer of its own as `DOT`'s."""
    return registered(DOT + "_parts" + ("_gemm" if gemm else ""), functools.partial(_parts_dot, gemm))


def _parts_dot(gemm: bool) -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    @T.prim_func(s_tir=True)
    def dot(c: T.handle, a_hi: T.handle, a_lo: T.handle, b_hi: T.handle, b_lo: T.handle) -> None:
        lda, ldb = T.int32(), T.int32()
        C = T.match_buffer(c, (BLOCK, BLOCK), "float32", scope="local", offset_factor=1)
        A0 = T.match_buffer(a_hi, (BLOCK, STEP), "bfloat16", strides=[lda, 1], offset_factor=1, align=BF16_BYTES)
        A1 = T.match_buffer(a_lo, (BLOCK, STEP), "bfloat16", strides=[lda, 1], offset_factor=1, align=BF16_BYTES)
        B0 = T.match_buffer(b_hi, (STEP // PAIR, BLOCK, PAIR), "bfloat16", strides=[ldb, PAIR, 1], offset_factor=1,
                            align=BF16_BYTES)
        B1 = T.match_buffer(b_lo, (STEP // PAIR, BLOCK, PAIR), "bfloat16", strides=[ldb, PAIR, 1], offset_factor=1,
                            align=BF16_BYTES)
        with T.sblock("root"):
            rows = T.meta_var([A0[0:BLOCK, 0:STEP], A1[0:BLOCK, 0:STEP]])
            pairs = T.meta_var([B0[0:STEP // PAIR, 0:BLOCK, 0:PAIR], B1[0:STEP // PAIR, 0:BLOCK, 0:PAIR]])
            if gemm:  # (the reads in the order the product reads them: tensorize matches that order)
                T.reads(C[0:BLOCK, 0:BLOCK], rows[0], pairs[0], pairs[1], rows[1])
            else:
                T.reads(C[0:BLOCK, 0:BLOCK], pairs[0], rows[0], rows[1], pairs[1])
            T.writes(C[0:BLOCK, 0:BLOCK])
            for m, n, k in T.grid(BLOCK, BLOCK, STEP):
                with T.sblock("update"):
                    if gemm:
                        vm, vn, vk = T.axis.remap("SSR", [m, n, k])
                    else:
                        vn, vm, vk = T.axis.remap("SSR", [n, m, k])
                    a0, a1 = T.meta_var([T.cast(A[vm, vk], "float32") for A in (A0, A1)])
                    b0, b1 = T.meta_var([T.cast(B[vk // PAIR, vn, vk % PAIR], "float32") for B in (B0, B1)])
                    if gemm:
                        C[vm, vn] = C[vm, vn] + (a0 * b0 + a0 * b1 + a1 * b0)
                    else:
                        C[vm, vn] = C[vm, vn] + (b0 * a0 + b0 * a1 + b1 * a0)

    _, A0, A1, B0, B1 = dot.params
    row = lambda m, k: [m, k]  # noqa: E731
    body = (_load_rows(A0, row) + _load_pairs(B0) + PRODUCTS + _load_rows(A1, row) + PRODUCTS
            + _load_rows(A0, row) + _load_pairs(B1) + PRODUCTS)  # hi·hi, then lo of A, then lo of B
    return dot, _block(dot, body)


def transposed_values_intrinsic(heads_between: bool = False) -> str:
    """The tensor intrinsic (registered on first use) that packs 32 keys × 16 columns of V (bf16, any
    row stride; ``heads_between``: rows of a (t, head, c) tensor) into the 16 × 32 block of Vᵀ that
    `DOT`'s A operand reads: P·V runs as pvᵀ[c, s] += Vᵀ[c, t] · P[t/2, s, t%2], the key-major
    weights being the pair panel B. Rows 2p and 2p + 1 of V become the 32-bit words (V[2p, c],
    V[2p + 1, c]) of 16 columns, and their 16 × 16 transposition (`panels.transposed`) is Vᵀ: row
    c holds word p of every pair, keys 0 … 31 in order."""
    name = "tvmattn_amx_values_transposed_32x16" + ("_bshd" if heads_between else "")
    return registered(name, functools.partial(_transposed_values, heads_between))


def _transposed_values(heads_between: bool) -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    shape = (STEP, 1, ROWS) if heads_between else (STEP, ROWS)

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle) -> None:
        row_stride, head_stride, out_stride = T.int32(), T.int32(), T.int32()
        src = T.match_buffer(a, shape, "bfloat16", offset_factor=1, align=BF16_BYTES,
                             strides=[row_stride, head_stride, 1] if heads_between else [row_stride, 1])
        dst = T.match_buffer(b, (ROWS, STEP), "bfloat16", strides=[out_stride, 1], offset_factor=1)
        with T.sblock("root"):
            if heads_between:
                T.reads(src[0:STEP, 0:1, 0:ROWS])
            else:
                T.reads(src[0:STEP, 0:ROWS])
            T.writes(dst[0:ROWS, 0:STEP])
            for t, c in T.grid(STEP, ROWS):
                with T.sblock("pack"):  # the block's iterators as a copy's: key, column
                    vt, vc = T.axis.remap("SS", [t, c])
                    dst[vc, vt] = src[vt, 0, vc] if heads_between else src[vt, vc]

    src, dst = desc.params
    at = (lambda t: [t, 0, 0]) if heads_between else (lambda t: [t, 0])  # noqa: E731
    # through fp32: V may be a buffer of the kernel's own that the legaliser widens (as `x86_bf16._pairs`)
    rows = [tirx.Cast(f"float32x{ROWS}", src.vload(at(t), f"bfloat16x{ROWS}")) for t in range(STEP)]
    words = [pair_words(rows[2 * p], rows[2 * p + 1]) for p in range(STEP // PAIR)]
    stores = [dst.vstore([c, 0], tirx.reinterpret(f"bfloat16x{STEP}", column))
              for c, column in enumerate(transposed(words))]
    return desc, _block(desc, stores)


# (the LLVM IR links the dot product's too: P's pairs are rounded by `x86_bf16`'s PAIRS_FUNCTION)
AMX_TILES = Tiles("AMX", "tdpbf16ps", ROWS, BLOCK, STEP, dot_intrinsic, zero_intrinsic, STORE,
                  transposed_values_intrinsic, configure_tiles, "llvm.x86.tileloadd64", DOT_LLVM + AMX_LLVM)
# Sapphire Rapids and later (bf16 tile products; the dot products round P into its pairs)
AMX = dataclasses.replace(AVX512_BF16, name="amx", requires=(*AVX512_BF16.requires, "amx-tile", "amx-bf16"),
                          tiles=AMX_TILES, passes=(*AVX512_BF16.passes, tile_configuration()))
