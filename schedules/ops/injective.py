"""Elementwise and data-movement functions (GELU, residual Add, casts, transposes, gathers, concat,
the rotary maths): every stage inlined into the last one, parallel over its outer loops, vectorised
along the innermost (the contiguous axis of the output)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.s_tir import Schedule
from tvm.s_tir.dlight import ScheduleRule, normalize_prim_func, try_inline
from tvm.target import Target

from tvmattn.compiler.passes import peel_key_tails, uses
from tvmattn.compiler.target import vector_lanes

PARALLEL_GRAIN = 4096  # elements per parallel task at least: below it a thread's start costs more than its work
PARALLEL_TASKS = 64  # iterations of a parallel loop enough to share among threads (`_parallel_prefix`)
SYMBOLIC_TASKS = 8  # what a symbolic extent (a batch, a sequence) is assumed to contribute to them
MIN_LANES = 4  # the narrowest vector an odd static extent is split into
_IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")
_COMPARISONS = (tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.EQ, tirx.NE)


class Injective(ScheduleRule):
    passes = (peel_key_tails(),)  # a symbolic transposition's tiles: the tail's test off their vectors

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> Schedule | None:
        if target.kind.name != "llvm":
            return None
        sch = Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or not all(info.is_injective() for info in infos):
            return None
        for info in try_inline(sch, infos):
            spatial(sch, info.block_rv, target)
        return sch


def spatial(sch: Schedule, block: s_tir.schedule.SBlockRV, target: Target) -> None:
    """One spatial block: innermost loop vectorised (whole vectors of a static extent; of a symbolic
    one where the block gathers: its load, index load and store per element pay for the tail), the loops
    outside it fused and parallel when there is enough work for more than one thread; where a test of the
    innermost axis (a pad, a concatenation) falls between vectors, one loop of vectors per side of it
    (`_partition_at`). A transposition takes square tiles (`_transposed_tiles`)."""
    loops = sch.get_loops(block)
    if not loops:
        return
    dtype = sch.get(block).writes[0].source.dtype
    lanes = vector_lanes(target, str(dtype)) if dtype.bits in (16, 32, 64) else 1
    *outer, inner = loops
    extent = sch.get(inner).extent
    gathers = _gathers(sch.get(block))
    bounds = _inner_bounds(sch.get(block), extent)
    lanes = _uniform_lanes(bounds, lanes)
    while isinstance(extent, tirx.IntImm) and lanes > MIN_LANES and extent.value % lanes:
        lanes //= 2  # narrower vectors that divide the loop (a 56-wide image row: 8), not none
    if not gathers and _transposed_tiles(sch, block, lanes):  # (a gather's reads are its indices')
        return
    vectors, cuts = None, []  # the loop over whole vectors of the innermost axis, where a test cuts it
    if isinstance(extent, tirx.IntImm) and extent.value > 0 and extent.value % lanes == 0 and lanes > 1:
        if extent.value > lanes:
            vectors = sch.split(inner, [None, lanes])[0]
            filled = _fills(sch.get(block)) and dtype.bits == 16
            cuts = [] if filled else sorted({b // lanes for b in bounds if 0 < b < extent.value})
            if not cuts:
                outer.append(vectors)
            inner = sch.get_loops(block)[-1]
        sch.vectorize(inner)
    elif not isinstance(extent, tirx.IntImm) and lanes > 1 and gathers:
        sch.vectorize(sch.split(inner, [None, lanes])[1])  # (the tail's test peeled off the whole vectors)
    elif isinstance(extent, tirx.IntImm) and not outer:
        outer = [inner]  # one short loop: at least parallel
    if outer:
        outer = outer[:_parallel_prefix(sch, outer)]
        fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if _work(sch, block) >= PARALLEL_GRAIN:
            sch.parallel(fused)
    if cuts:
        _partition_at(sch, vectors, cuts)


def _partition_at(sch: Schedule, vectors, cuts: list[int]) -> None:
    """The loop over vectors split into one loop per stretch between ``cuts`` (in vectors): in each, a
    padding's or concatenation's test is the same for all its vectors, and TVM's simplifier folds it to
    one value. Left to it, it folded ``8 <= v·8 + lane`` only with 32-bit indices: with a symbolic
    size's 64-bit ones (ESM's rotary over 16-wide heads) the vectoriser met a test that differs between
    lanes, ran the loop a lane at a time, and the kernel ran 10× slower than at static sizes."""
    edges = [0, *cuts]
    sch.loop_partition(vectors, [b - a for a, b in zip(edges, edges[1:])] + [None])  # (the last: the rest)


def _parallel_prefix(sch: Schedule, loops: list) -> int:
    """How many of the outer ``loops`` the parallel loop fuses: the fewest that make `PARALLEL_TASKS`
    tasks (a symbolic extent counted as `SYMBOLIC_TASKS`); the loops inside stay loops of each task.
    Every loop fused into it costs each iteration a division to recover its index, by a symbolic
    extent a 64-bit one: the GELU fused with Wav2Vec2's im2col (a loop per vector) ran at 16 GB/s."""
    tasks = 1
    for n, loop in enumerate(loops):
        extent = sch.get(loop).extent
        tasks *= int(extent) if isinstance(extent, tirx.IntImm) else SYMBOLIC_TASKS
        if tasks >= PARALLEL_TASKS:
            return n + 1
    return len(loops)


def _transposed_tiles(sch: Schedule, block, lanes: int) -> bool:
    """For a block whose output's contiguous axis j is not contiguous in an input that is contiguous
    along another output axis i (a transposition: out[…, i, …, j] = x[…, j, …, i]), the loops with
    (i, j) split into tiles of lanes × lanes and those two innermost: each tile reads whole cache lines
    of x once (row by row, the lines stay in L1) and writes whole vectors of the output. Parallel over
    the loops outside i's tiles only: fused with j's symbolic extent, every vector paid a few integer
    divisions by it to recover its indices, and a (2, 6399, 512) → (2, 512, 6399) transposition ran at
    3 GB/s. False where the block is no transposition."""
    if lanes < 2:
        return False
    stmt = sch.get(block)
    axes = [iv.var for iv in stmt.iter_vars]
    store = stmt.body
    if not isinstance(store, tirx.BufferStore) or len(axes) < 2:
        return False
    last = store.indices[-1]
    if not any(last.same_as(v) for v in axes):
        return False
    found = []
    tvm_ffi.structural_walk(store.value, [(TensorLoad, lambda load: found.append(load))])
    for load in found:
        inner = load.indices[-1] if load.indices else None
        if inner is None or any(inner.same_as(v) for v in (last,)) or not any(inner.same_as(v) for v in axes):
            continue
        if not any(uses(i, last) for i in load.indices[:-1]):
            continue
        loops = sch.get_loops(block)
        j_loop = loops[next(k for k, v in enumerate(axes) if v.same_as(last))]
        i_loop = loops[next(k for k, v in enumerate(axes) if v.same_as(inner))]
        i_out, i_in = sch.split(i_loop, [None, lanes])
        j_out, j_in = sch.split(j_loop, [None, lanes])
        rest = [lp for lp in sch.get_loops(block) if not any(sch.get(lp).same_as(sch.get(t))
                                                             for t in (i_out, i_in, j_out, j_in))]
        sch.reorder(*rest, i_out, j_out, i_in, j_in)
        sch.vectorize(j_in)
        outer = sch.fuse(*rest, i_out) if rest else i_out
        if _work(sch, block) >= PARALLEL_GRAIN:
            sch.parallel(outer)
        return True
    return False


def _inner_bounds(block, extent) -> list[int]:
    """The bounds an ``if_then_else`` sets inside the innermost axis (a Pad's ``j < 80`` of 96)."""
    axis = block.iter_vars[-1].var if block.iter_vars else None
    bounds: list[int] = []

    def on_compare(compare):
        for side, other in ((compare.a, compare.b), (compare.b, compare.a)):
            if isinstance(other, tirx.IntImm) and uses(side, axis) and (
                    not isinstance(extent, tirx.IntImm) or 0 < other.value < extent.value):
                bounds.append(int(other.value))

    def on_call(call):
        if call.op.same_as(_IF_THEN_ELSE):
            tvm_ffi.structural_walk(call.args[0], [(kind, on_compare) for kind in _COMPARISONS])

    if axis is not None:
        tvm_ffi.structural_walk(block.body, [(Call, on_call)])
    return bounds


def _fills(block) -> bool:
    """Whether an ``if_then_else`` of ``block`` has a constant side (a pad's zeros): in 16 bits a loop of
    vectors all that constant fails TVM's bf16 storage legalisation ("dtype mismatch on BufferStore"), so
    such a loop is not partitioned (`_partition_at`); in fp32 it is (MobileViT's SiLU fused into the pad
    before its depthwise convolutions: a lane at a time, 4.7 GB/s, a fifth of its run)."""
    found: list = []

    def on_call(call):
        if call.op.same_as(_IF_THEN_ELSE) and any(isinstance(_uncast(a), (tirx.IntImm, tirx.FloatImm))
                                                  for a in call.args[1:]):
            found.append(call)

    tvm_ffi.structural_walk(block.body, [(Call, on_call)])
    return bool(found)


def _uncast(e):
    while isinstance(e, tirx.Cast):
        e = e.value
    return e


def _uniform_lanes(bounds: list[int], lanes: int) -> int:
    """``lanes``, halved until every one of the innermost axis's ``bounds`` falls between vectors: TVM's
    vectoriser keeps a choice that is the same for a whole vector and runs one that differs between
    lanes a lane at a time (a symbolic (2, 4, n, 80) → (…, 96) pad ran 7× slower)."""
    for bound in bounds:
        while lanes > 1 and bound % lanes:
            lanes //= 2
    return lanes


def _work(sch: Schedule, block) -> int:
    """Elements the block writes (a symbolic size counts as large)."""
    total = 1
    for loop in sch.get_loops(block):
        extent = sch.get(loop).extent
        if not isinstance(extent, tirx.IntImm):
            return PARALLEL_GRAIN
        total *= extent.value
    return total


def _gathers(block) -> bool:
    """Whether ``block`` reads a buffer at an index it loads from another (a gather: per element a
    load, an index load and a store, which vectors of a symbolic loop pay for; a copy's do not)."""
    loads: list = []
    tvm_ffi.structural_walk(block.body, [(TensorLoad, loads.append)])
    inner: list = []
    for load in loads:
        for index in load.indices:
            tvm_ffi.structural_walk(index, [(TensorLoad, inner.append)])
    return bool(inner)
