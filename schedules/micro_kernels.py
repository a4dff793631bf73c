"""The register-tile micro-kernels of the CPU schedules: a block accumulating a tile of its output in
vector registers (`register_tile`), and the GEMM and one-row GEMV built on it, which a layer's
projections (`schedules.cpu`) and an imported model's fused GEMMs (`schedules.ops.matmul`, `gemv`)
share, with their knobs and default tiles."""

from __future__ import annotations

import functools
from typing import Mapping

import tvm
from tvm.s_tir import Schedule

from tvmattn.compiler.isa.record import Dot
from tvmattn.schedules.knobs import Knob, KnobValue
from tvmattn.schedules.primitives import (
    at_most,
    divisor_at_most,
    knob_int,
    lanes_for,
    only_consumer,
    tensorize,
    vectorize,
)

GEMM_KNOBS = (
    Knob("gemm_rows", (1, 2, 3, 4, 6, 8), 4, "rows per projection register tile"),
    Knob("gemm_vecs", (1, 2, 3, 4), 2, "vectors of columns per projection register tile"),
    Knob("gemm_block_rows", (1, 4, 8, 16, 32), 16, "register tiles of rows per projection task"),
    Knob("gemm_block_cols", (1, 2, 4, 8), 4, "register tiles of columns per projection task"),
)
PANEL_BYTES = 384 * 1024  # a task's panel of W (d_in × its columns), to stay in L2
L2_WEIGHT = 1 << 20  # a weight larger than this does not stay in L2 from one row block to the next
PADDED_ROW_BLOCK = 16  # the block symbolic rows of a projection are padded to (`cpu.projections`)


def gemm_defaults(d_in: int, lanes: int, bits: int, widths: tuple[int, ...] = (),
                  registers: int = 32) -> dict[str, int]:
    """GEMM register tiles: 4 rows × 4 vectors of accumulators where a vector holds 16 of them and
    there are 32 registers; with 16 registers (or narrower vectors), 4 × 3 where every output width
    (``widths``) is whole tiles of them
    (12 accumulators, 3 W vectors and the broadcast x fill all 16), else 4 × 2 (a tail tile is
    predicated lane by lane). As many column tiles per task as keep the task's W panel (``d_in``
    rows) within `PANEL_BYTES` (wide models: fewer columns, or W streams from memory)."""
    vecs = 4 if lanes >= 16 and registers >= 32 else 3 if widths and all(w % (3 * lanes) == 0 for w in widths) else 2
    knobs = {}
    needed = max((-(-w // lanes) for w in widths), default=vecs)  # vectors the widest output has
    if needed < vecs:  # narrow (a grouped conv's 16 channels)
        vecs = needed
        knobs["gemm_rows"] = 8  # the accumulators the width cannot give, from rows
    tile_bytes = d_in * vecs * lanes * bits // 8
    cols = next((c for c in (8, 4, 2) if c * tile_bytes <= PANEL_BYTES), 1)
    return {**knobs, "gemm_vecs": vecs, "gemm_block_cols": cols}


def whole_row_tile(rows: int, vecs: int, width: int, registers: int) -> tuple[int, int] | None:
    """(rows, vectors) of a dot-product register tile for a static row count: the most accumulators
    from 3 to 8 rows that divide ``rows``, at most ``vecs`` vectors that divide the ``width`` (in
    vectors), the accumulators, the weight's vectors and the broadcast within the ``registers``;
    None where no such count divides it (a ViT's 197). The instruction takes no tail predicate, so a
    count the knobs' rows do not divide otherwise runs padded, or on a smaller divisor's tile (CLIP's
    50 tokens: 2 rows of 4 vectors, where 5 rows give 20 accumulators)."""
    fits = [(r * v, r, v) for r in range(3, 9) for v in range(1, vecs + 1)
            if rows % r == 0 and width % v == 0 and r * v + v + 1 <= registers]
    return max(fits)[1:] if fits else None


def dot_columns(sch: Schedule, width: int, lanes: int, vecs: KnobValue) -> int:
    """Columns of a dot-product GEMM's register tile: the most whole vectors, up to ``vecs``, that divide
    the width (the instruction takes no tail predicate: every tile is whole)."""
    return divisor_at_most(width // lanes, knob_int(sch, vecs)) * lanes


def gemm(sch: Schedule, blk, lanes: int, k: Mapping[str, KnobValue], epilogue: tuple = (),
         padded_columns: bool = False, dot: Dot | None = None, later: list | None = None) -> list:
    """y[…, s, m] = Σ_c x[…, s, c]·w[…, c, m] (loops: batch…, s, m, c): parallel over (batch, row
    tile, column tile), register-tiled; the ``epilogue`` blocks (bias, activation, residual) are
    computed on each register tile as it is stored; those that cannot be are returned. With
    ``padded_columns`` (w is zero-padded to whole tiles) the column tail takes whole vectors too.
    Given ``dot`` (bf16, w read in pairs of its rows as the caller lays it out, a weight in panels of
    `dot_columns`; a static row count, the width in whole vectors), two steps of c per
    ``dot.pair_first``, every tile whole (the factors are the largest divisors up to the knobs), its
    tensorize step appended to ``later`` (`register_tile`'s)."""
    *batch, s, m, c = sch.get_loops(blk)
    width = int(sch.get(m).extent)
    # Row tiles stay inside one sequence: a tile crossing a batch boundary would make the
    # accumulator's region non-rectangular, and its write-back would cover rows it never computed.
    extent = sch.get(s).extent
    n_rows = int(extent) if isinstance(extent, tvm.tirx.IntImm) else None
    if n_rows is None and tvm.sym.Analyzer().can_prove_equal(tvm.tirx.floormod(extent, PADDED_ROW_BLOCK), 0):
        n_rows = PADDED_ROW_BLOCK  # rows in whole blocks (padded): tiles that divide a block, no tail
    fit = (lambda knob, n: divisor_at_most(n, knob_int(sch, knob))) if dot is not None else (  # noqa: E731
        lambda knob, n: at_most(sch, knob, n))
    rows_factor = fit(k["gemm_rows"], n_rows)  # one token (decode): a one-row register tile
    row_tiles = None if n_rows is None else -(-n_rows // knob_int(sch, rows_factor))
    block_factor = fit(k["gemm_block_rows"], row_tiles)
    r_task, r_out, r_in = sch.split(s, [None, block_factor, rows_factor])
    lanes_m = lanes if padded_columns else lanes_for(width, lanes)
    # never more vectors than the width has: the rest would be padding behind a guard on every lane
    vecs = at_most(sch, k["gemm_vecs"], -(-width // lanes_m)) if lanes_m == lanes else 1
    if dot is not None:
        vecs = dot_columns(sch, width, lanes_m, vecs) // lanes_m
    col_tiles = -(-width // (knob_int(sch, vecs) * lanes_m))
    # a divisor of the column tiles: a partial last block would guard every register tile of the task
    m_task, m_out, m_mid, m_vec = sch.split(m, [None, divisor_at_most(col_tiles, knob_int(sch, k["gemm_block_cols"])),
                                                vecs, lanes_m])
    # a task owns a block of rows × columns, so its panels of x and w stay in L2 across register tiles;
    # consecutive tasks share a row block, or, for a weight an L2 cannot hold, a column panel (streamed
    # once per panel rather than once per row block: the row blocks of a padded symbolic GEMM are 16)
    tasks = (m_task, r_task) if weight_bytes(sch, blk, sch.get(c).extent, width) > L2_WEIGHT else (r_task, m_task)
    c, *pair = sch.split(c, [None, dot.pair]) if dot is not None else (c,)  # (the intrinsic's pair inside)
    sch.reorder(*batch, *tasks, r_out, m_out, c, r_in, m_mid, m_vec, *pair)
    sch.parallel(sch.fuse(*batch, *tasks))
    rows = knob_int(sch, rows_factor)
    # whole column tiles in the accumulator: with padded columns the last tile computes past the width
    w = knob_int(sch, vecs) * lanes_m
    return register_tile(sch, blk, m_out, lambda *i: (*i[:-2], i[-2] // rows, i[-2] % rows, i[-1] // w, i[-1] % w),
                         (r_in, m_mid), m_vec, lanes_m, c, epilogue,
                         intrinsic=None if dot is None else dot.pair_first, later=later)


def weight_bytes(sch: Schedule, blk, depth, width: int) -> int:
    """Bytes of a GEMM's (depth × width) weight, at its operands' widest dtype (0 for a symbolic depth:
    an activation × activation product's, whose "weight" changes every call)."""
    if not isinstance(depth, tvm.tirx.IntImm):
        return 0
    block = sch.get(blk)
    bits = max(tvm.DataType(r.source.dtype).bits for r in block.reads if not r.source.same_as(block.writes[0].source))
    return int(depth) * width * bits // 8


def gemv(sch: Schedule, blk, lanes: int, k: Mapping[str, KnobValue], epilogue: tuple = (),
         padded_columns: bool = False, dot: Dot | None = None, later: list | None = None) -> list:
    """y[…, m] = Σ_c x[…, c]·w[…, c, m] (loops: batch…, m, c; one row: a decode step's projection):
    parallel over (batch, column tile), each tile ``gemm_vecs`` vectors of accumulators streaming its
    panel of w; the epilogue as in `gemm`. Given ``dot``, two steps of c per ``dot.pair_first`` on
    w's pair panel (as `gemm`'s)."""
    *batch, m, c = sch.get_loops(blk)
    width = int(sch.get(m).extent)
    lanes_m = lanes if padded_columns else lanes_for(width, lanes)
    vecs = k["gemm_vecs"] if lanes_m == lanes else 1
    if dot is not None:
        vecs = dot_columns(sch, width, lanes_m, vecs) // lanes_m
    m_task, m_mid, m_vec = sch.split(m, [None, vecs, lanes_m])
    c, *pair = sch.split(c, [None, dot.pair]) if dot is not None else (c,)  # (the intrinsic's pair inside)
    sch.reorder(*batch, m_task, c, m_mid, m_vec, *pair)
    task = sch.fuse(*batch, m_task)
    sch.parallel(task)
    w = knob_int(sch, vecs) * lanes_m  # whole column tiles in the accumulator (see `gemm`)
    return register_tile(sch, blk, task, lambda *i: (*i[:-1], i[-1] // w, i[-1] % w), (m_mid,), m_vec, lanes_m,
                         c, epilogue, intrinsic=None if dot is None else dot.pair_first, later=later)


def register_tile(sch: Schedule, block, outer, layout, unrolled: tuple, vector, lanes: int, reduction,
                  epilogue: tuple = (), intrinsic: str | None = None, key_blocks: str | None = None,
                  later: list | None = None) -> list:
    """The register-tile idiom: ``block`` accumulates its tile under ``outer`` in a local buffer
    (``cache_write``) that LLVM keeps in registers once its loops are unrolled and vectorised.
    ``layout`` gives that buffer a fixed size even where a tail predicate cuts the tile. The init
    is split off last: vectorising after ``decompose_reduction`` fails. The ``epilogue`` blocks
    (elementwise consumers of ``block``, in order) are inlined into the store of the tile, up to the
    first that cannot be (or while the tile has other consumers): that one and the rest are returned.
    With ``intrinsic``, the loop nest from ``vector`` in is that tensor intrinsic instead of a vector:
    tensorized now, or, given ``later``, a step appended to it for the caller to run last (a
    tensorized stage can leave the root scope no "stage pipeline" for other stages' primitives)."""
    acc = sch.cache_write(block, 0, "local")
    left = list(epilogue)
    while left and only_consumer(sch, acc, left[0]):
        try:
            sch.reverse_compute_inline(left[0])
        except RuntimeError:  # TVM refused (a ScheduleError or internal error): e.g. a consumer reading other elements
            break
        left.pop(0)
    sch.transform_layout(block, ("write", 0), layout, assume_injective_transform=True)
    sch.reverse_compute_at(acc, outer, preserve_unit_loops=True)
    for loop in unrolled:
        sch.unroll(loop)
    if intrinsic is None:
        vectorize(sch, vector, lanes, lanes)
    vectorize(sch, sch.get_loops(acc)[-1], None, lanes)
    # the store unrolled like the update: a loop over the tile would leave it a stack array that LLVM
    # zeroes before and spills after every tile (32 stores per 16 accumulators)
    acc_loops = sch.get_loops(acc)
    at = next(i for i, loop in enumerate(acc_loops) if sch.get(loop).same_as(sch.get(outer)))
    for loop in acc_loops[at + 1:-1]:
        sch.unroll(loop)
    init = sch.decompose_reduction(block, reduction)
    if intrinsic is not None:  # ``vector`` and the loops inside it are the intrinsic's
        vectorize(sch, sch.get_loops(init)[-1], lanes, lanes)
        step = functools.partial(tensorize, sch, vector, intrinsic, key_blocks)
        step() if later is None else later.append(step)
    return left
