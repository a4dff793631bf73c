"""Elementwise and data-movement functions (GELU, residual Add, casts, transposes, gathers, concat,
the rotary maths): every stage inlined into the last one, parallel over its outer loops, vectorised
along the innermost (the contiguous axis of the output)."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import Schedule
from tvm.s_tir.dlight import ScheduleRule, normalize_prim_func, try_inline
from tvm.target import Target

from tvmattn.compiler.target import vector_lanes

PARALLEL_GRAIN = 4096  # elements per parallel task at least: below it a thread's start costs more than its work


class Injective(ScheduleRule):
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
    """One spatial block: innermost loop vectorised (whole vectors of a static extent), the loops
    outside it fused and parallel when there is enough work for more than one thread."""
    loops = sch.get_loops(block)
    if not loops:
        return
    *outer, inner = loops
    dtype = sch.get(block).writes[0].source.dtype
    lanes = vector_lanes(target, str(dtype)) if dtype.bits in (16, 32, 64) else 1
    extent = sch.get(inner).extent
    if isinstance(extent, tirx.IntImm) and extent.value > 0 and extent.value % lanes == 0 and lanes > 1:
        if extent.value > lanes:
            outer.append(sch.split(inner, [None, lanes])[0])
            inner = sch.get_loops(block)[-1]
        sch.vectorize(inner)
    elif isinstance(extent, tirx.IntImm) and not outer:
        outer = [inner]  # one short loop: at least parallel
    if outer:
        fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if _work(sch, block) >= PARALLEL_GRAIN:
            sch.parallel(fused)


def _work(sch: Schedule, block) -> int:
    """Elements the block writes (a symbolic size counts as large)."""
    total = 1
    for loop in sch.get_loops(block):
        extent = sch.get(loop).extent
        if not isinstance(extent, tirx.IntImm):
            return PARALLEL_GRAIN
        total *= extent.value
    return total
