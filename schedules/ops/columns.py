"""GEMMs of a symbolic width, ``C[…, s, m] += A[…, s, c] · B[…, c, m]`` with m known only at run time
(DeBERTa's c2p scores against its relative positions, 2·min(n, span) of them): the register tiles of the
`matmul` rule need a static width, and the `reduce` rule ran them a product at a time (4.4 GFLOP/s, 86 %
of DeBERTa's symbolic run). Here the rows and columns are padded to whole register tiles (`pad_einsum`:
copies with zeros past the ends, so that no test of a tail is left in the tile's loop, which TVM's
vectoriser would have run a lane at a time), B's copy in panels of one vector of columns (contiguous
along the reduction: rows of a power-of-two width share a cache set), each register tile `ROWS` rows
× one vector, and the product's real part copied back."""

from __future__ import annotations

from tvm import tirx
from tvm.s_tir import Schedule
from tvm.s_tir.dlight import ScheduleRule, normalize_prim_func
from tvm.target import Target

from tvmattn.compiler.passes import register_tiles_on_stack
from tvmattn.compiler.target import vector_lanes
from tvmattn.schedules.ops.injective import spatial
from tvmattn.schedules.ops.matmul import gemm_operands

ROWS = 4  # rows of a register tile: 4 accumulators, each a vector of columns


class SymbolicColumns(ScheduleRule):
    passes = (register_tiles_on_stack(),)  # (the tile in registers: TVM's workspace kept it in memory)

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> Schedule | None:
        if target.kind.name != "llvm":
            return None
        sch = Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or len(infos) != 1 or infos[0].is_injective():
            return None  # (a prologue or an epilogue: TVM's rules)
        block = infos[0].block_rv
        found = gemm_operands(sch.get(block), symbolic_width=True)
        if found is None or not found[2]:
            return None
        lanes = vector_lanes(target, str(sch.get(block).writes[0].source.dtype))
        axes = len(sch.get(block).iter_vars)
        b_index = next(i for i, r in enumerate(sch.get(block).reads) if r.source.same_as(found[1]))
        sch.pad_einsum(block, [1] * (axes - 3) + [ROWS, lanes, 1])
        *batch, s, m, c = sch.get_loops(block)
        rows, row = sch.split(s, [None, ROWS])
        columns, vector = sch.split(m, [None, lanes])
        sch.reorder(*batch, rows, columns, c, row, vector)
        sch.parallel(sch.fuse(*batch, rows))
        sch.transform_layout(block, ("read", b_index), lambda *i: (*i[:-2], i[-1] // lanes, i[-2], i[-1] % lanes))
        acc = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(acc, columns, preserve_unit_loops=True)
        sch.transform_layout(block, ("write", 0), lambda *i: (i[-2] % ROWS, i[-1] % lanes),
                             assume_injective_transform=True)
        sch.unroll(row)
        sch.vectorize(vector)
        *_, tile_row, tile_vector = sch.get_loops(acc)
        sch.unroll(tile_row)
        sch.vectorize(tile_vector)
        init = sch.decompose_reduction(block, c)
        *_, init_row, init_vector = sch.get_loops(init)
        sch.unroll(init_row)
        sch.vectorize(init_vector)
        for copy in (b for b in sch.get_producers(block) if sch.get(b).name_hint.endswith("_pad")):
            spatial(sch, copy, target)
        spatial(sch, sch.get_consumers(acc)[0], target)
        return sch
