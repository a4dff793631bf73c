"""The last rule: whatever no other rule took still runs in parallel over each block's outermost
spatial loop (spatial blocks are inlined where they can be, as the injective rule does)."""

from __future__ import annotations

import tvm_ffi
from tvm import tirx
from tvm.s_tir import Schedule
from tvm.s_tir.dlight import ScheduleRule, normalize_prim_func, try_inline_contiguous_spatial
from tvm.target import Target

from tvmattn.schedules.ops.injective import spatial


class Fallback(ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> Schedule | None:
        if target.kind.name != "llvm":
            return None
        sch = Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:  # opaque blocks (TVM's own extern-like loops): leave the order, parallelise nothing
            return sch
        for info in try_inline_contiguous_spatial(sch, infos):
            if info.is_injective():
                spatial(sch, info.block_rv, target)
            elif info.dom_kind().startswith("S"):
                sch.parallel(info.get_loops()[0])
        return sch


class Scan(ScheduleRule):
    """A function TVM's operator library writes as loops of its own (cumsum's scan, with opaque blocks)
    that already runs in parallel over its rows: kept as written."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> Schedule | None:
        if target.kind.name != "llvm":
            return None
        sch = Schedule(func)
        if normalize_prim_func(sch) is not None:
            return None
        found = []
        tvm_ffi.structural_walk(func.body, [(tirx.For, lambda f: found.append(f.kind == tirx.ForKind.PARALLEL))])
        return sch if any(found) else None
