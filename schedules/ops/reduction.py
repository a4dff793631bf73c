"""Row reductions with their elementwise neighbours (LayerNorm, RMSNorm, softmax, mean/variance): one
parallel task per row, every stage of the row computed inside it; reductions along a row accumulate
in vector lanes (``rfactor``: lanes partial sums, then their sum), elementwise stages are vectorised.

Rows are the leading spatial axes that every reduction and the last (elementwise) block share; a
function whose rows are all of size one (a decode step's LayerNorm) runs as one task. (TVM dlight's
CPU reduction rule takes the last block's first axis as the row: for one row that is the columns, and
each column's task recomputed, racing, the whole row's sums.)
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir import SBlockRealize, Schedule
from tvm.s_tir.dlight import ScheduleRule, normalize_prim_func
from tvm.sym import Analyzer
from tvm.target import Target

from tvmattn.compiler.passes import uses
from tvmattn.compiler.target import vector_lanes
from tvmattn.schedules.ops.injective import PARALLEL_GRAIN

COMBINED = 8  # independent sums of the lanes' partial sums (`_lanes_of_partial_sums`)


class RowReduction(ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> Schedule | None:
        if target.kind.name != "llvm":
            return None
        sch = Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or len(infos) < 2 or not infos[-1].is_injective() or all(i.is_injective() for i in infos):
            return None
        rows = _row_axes(infos)
        if rows is None:
            return None
        if _inline_epilogue(sch, infos):
            infos = normalize_prim_func(sch)
        lanes = vector_lanes(target, str(sch.get(infos[-1].block_rv).writes[0].source.dtype))
        for info in infos[:-1]:  # before anything moves: each reduction in its own loop nest
            if not info.is_injective():
                _lanes_of_partial_sums(sch, info, lanes)
        last = sch.get_loops(infos[-1].block_rv)
        if rows:
            row = sch.fuse(*last[:rows]) if rows > 1 else last[0]
            for blk in reversed(sch.get_child_blocks(sch.get_sblock("root"))[:-1]):
                sch.compute_at(blk, row, preserve_unit_loops=True)
            if _extent_product(infos[-1], rows) >= 2 and _work(infos[-1]) >= PARALLEL_GRAIN:
                sch.parallel(row)
        for blk in sch.get_child_blocks(sch.get_sblock("root")) if not rows else _blocks_under(sch, infos[-1]):
            if not _vectorize_inner(sch, blk, lanes):
                _vectorize_inner(sch, blk, COMBINED)  # the combining sums (`_lanes_of_partial_sums`)
        return sch


def _inline_epilogue(sch: Schedule, infos) -> bool:
    """The elementwise stages after the last reduction (a norm's scale, a GELU, a cast) inlined into
    the last block: each had stored its row and read it back (LayerNorm, erf-GELU and bf16 cast over
    12798 × 512: 2.75 → 2.18 ms); and a conversion before the first (a 16-bit input widened,
    `precision`'s). Other stages before a reduction stay: softmax's exp feeds a sum and the division,
    and would be computed twice."""
    reductions = [i for i, info in enumerate(infos) if not info.is_injective()]
    first, last = reductions[0], reductions[-1]
    inlined = False
    widening = [info for info in infos[:first] if isinstance(sch.get(info.block_rv).body, tirx.BufferStore)
                and isinstance(sch.get(info.block_rv).body.value, tirx.Cast)
                and isinstance(sch.get(info.block_rv).body.value.value, tvm.ir.TensorLoad)]
    for info in widening + infos[last + 1:-1]:
        try:
            sch.compute_inline(info.block_rv)
            inlined = True
        except Exception:  # s_tir.ScheduleError: a stage another block reads differently stays
            continue
    return inlined


def _row_axes(infos) -> int | None:
    """How many leading spatial axes all blocks share as rows (same extents), or None if the reductions
    do not reduce within those rows."""
    analyzer = Analyzer()
    last = infos[-1].iters
    counts = []
    for info in infos[:-1]:
        kinds = info.dom_kind()
        k = len(kinds) - len(kinds.lstrip("S"))
        if not info.is_injective():
            if "S" in kinds[k:]:  # spatial axes after the reduction
                return None
            if all(_static(it.dom) == 1 for it in info.iters[:k]):
                k = 0  # one row
            elif k > len(last):  # more rows than the output has
                return None
            counts.append(k)
    k = counts[0]
    if any(c != k for c in counts):
        return None
    for info in infos[:-1]:
        if len(info.iters) < k or not all(analyzer.can_prove_equal(a.dom, b.dom)
                                          for a, b in zip(info.iters[:k], last[:k])):
            return None
    return k


def _lanes_of_partial_sums(sch: Schedule, info, lanes: int) -> None:
    """A reduction over a static multiple of ``lanes``: ``lanes`` partial results, combined after in
    `COMBINED` independent sums, then those: one sum of the lanes in a row was a chain of 32 dependent
    scalar adds, which a LayerNorm waits for twice a row (bf16 LayerNorm over 12798 × 512: 1.19 →
    1.05 ms; with an erf-GELU 2.0 → 1.77)."""
    loops = sch.get_loops(info.block_rv)
    extent = _static(info.iters[-1].dom)
    if info.dom_kind().count("R") != 1 or extent is None or extent % lanes or lanes == 1:
        return
    _, lane = sch.split(loops[-1], [None, lanes])
    try:
        sch.rfactor(lane, len(info.iters) - 1)
    except Exception:  # s_tir.ScheduleError: a reduction rfactor cannot split (e.g. argmax's pair)
        return
    if lanes > COMBINED and lanes % COMBINED == 0:
        _, chains = sch.split(sch.get_loops(info.block_rv)[-1], [None, COMBINED])
        sch.rfactor(chains, len(info.iters) - 1)


def _blocks_under(sch: Schedule, info):
    return sch.get_child_blocks(sch.get_loops(info.block_rv)[0])


def _vectorize_inner(sch: Schedule, blk, lanes: int) -> bool:
    """The innermost loop of a block vectorised when it is spatial of a static multiple of ``lanes``
    (an rfactor's lanes, an elementwise stage's columns); reductions stay serial. An rfactor's lanes
    come first (`compute_at` orders a block's spatial loops before its reduction): they move inside."""
    loops = sch.get_loops(blk)
    if not loops:
        return False
    lane = _lanes_before_the_reduction(sch, blk, loops, lanes)
    if lane is not None:
        sch.reorder(*loops[lane + 1:], loops[lane])
        loops = sch.get_loops(blk)
    inner = sch.get(loops[-1])
    realize = inner.body
    if not isinstance(realize, SBlockRealize) or not isinstance(inner.extent, tirx.IntImm) or \
            inner.extent.value % lanes or any(iv.iter_type != tirx.IterVar.DataPar and uses(v, inner.loop_var)
                                              for iv, v in zip(realize.block.iter_vars, realize.iter_values)):
        return False
    sch.vectorize(loops[-1] if inner.extent.value == lanes else sch.split(loops[-1], [None, lanes])[1])
    return True


def _lanes_before_the_reduction(sch: Schedule, blk, loops, lanes: int) -> int | None:
    """The index of a loop of ``lanes`` iterations that only a spatial axis reads, followed by loops
    (of more than one iteration) only reduction axes read: an rfactor's partial sums outside the
    reduction they split."""
    realize = sch.get(loops[-1]).body
    if not isinstance(realize, SBlockRealize):
        return None
    bound = list(zip(realize.block.iter_vars, realize.iter_values))

    def readers(loop) -> set:
        var = sch.get(loop).loop_var
        return {iv.iter_type for iv, v in bound if uses(v, var)}

    for i in range(len(loops) - 2, -1, -1):
        kinds = readers(loops[i])
        if _static(sch.get(loops[i]).extent) == lanes and kinds == {tirx.IterVar.DataPar}:
            after = [readers(lp) for lp in loops[i + 1:] if _static(sch.get(lp).extent) != 1]
            if after and all(k <= {tirx.IterVar.CommReduce} for k in after) and any(after):
                return i
            return None
    return None


def _static(extent) -> int | None:
    if isinstance(extent, int):
        return extent
    return int(extent.value) if isinstance(extent, tirx.IntImm) else None


def _extent_product(info, rows: int) -> int:
    total = 1
    for it in info.iters[:rows]:
        if _static(it.dom) is None:
            return 2  # symbolic: at least two
        total *= _static(it.dom)
    return total


def _work(info) -> int:
    total = 1
    for it in info.iters:
        if _static(it.dom) is None:
            return PARALLEL_GRAIN
        total *= _static(it.dom)
    return total


class Reduce(ScheduleRule):
    """Any reduction `RowReduction` leaves (a sum of an integer mask per row, the min over a stacked
    axis): its producers inlined, parallel over its output's elements, the reduction inside each."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> Schedule | None:
        if target.kind.name != "llvm":
            return None
        sch = Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or infos[-1].is_injective() or any(not i.is_injective() for i in infos[:-1]):
            return None
        for info in infos[:-1]:
            try:
                sch.compute_inline(info.block_rv)
            except Exception:  # s_tir.ScheduleError: not inlinable, so not this rule's
                return None
        block = infos[-1].block_rv
        kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
        loops = sch.get_loops(block)
        spatial = [lp for lp, k in zip(loops, kinds) if k == tirx.IterVar.DataPar]
        reduce = [lp for lp, k in zip(loops, kinds) if k != tirx.IterVar.DataPar]
        if not spatial:
            return sch
        sch.reorder(*spatial, *reduce)
        row = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        if _work(infos[-1]) >= PARALLEL_GRAIN:
            sch.parallel(row)
        return sch
