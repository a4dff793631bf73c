"""Products on tile registers: QKᵀ and P·V of the query-tile kernel and a layer's projections, a
32 × 32 block of fp32 accumulators per tile product, with the intrinsics of the instruction set's
`Tiles` record."""

from __future__ import annotations

import functools
from typing import Mapping

import tvm
from tvm.s_tir import Schedule

from tvmattn.compiler.annotations import TILE_BLOCKS
from tvmattn.compiler.isa.panels import query_panel_intrinsic
from tvmattn.compiler.isa.record import Tiles
from tvmattn.schedules.cpu.packing import tensorize_queries
from tvmattn.schedules.knobs import KnobValue
from tvmattn.schedules.micro_kernels import L2_WEIGHT, weight_bytes
from tvmattn.schedules.primitives import copy_of, divisor_at_most, knob_int, tensorize

X_PANEL_BYTES = 512 * 1024  # a task's rows of x, which stay in L2 while the weight's panels stream past
SYMBOLIC_TASK_BLOCKS = 16  # accumulator blocks of a task whose rows are symbolic (one block of them)


def tile_stage(sch: Schedule, tiles: Tiles, name: str, heads_between: bool, parts: bool, later: list):
    """QKᵀ or P·V on the tiles (``tiles.dot``), a 32 × 32 accumulator block per (m, n), 32 steps of
    the reduction per product; both stages' loops run (queries n, m, reduction):

        scores  acc[32 keys][32 queries]     += k[t, e:e+32] · panel[e/2, s, e%2]   (K in place,
                                                ``heads_between`` in BSHD; the query pair panel)
        pv      accᵀ[32 of d_v][32 queries]  += Vᵀ[c, t:t+32] · P[t/2, s, t%2]     (`pack_pairs`' panels;
                                                stored d_v-major, `pv_rows` turns it for the epilogue)

    with ``parts``, each operand's bf16 parts (`CpuPlan.fp16_parts`). Returns the loop over blocks of m."""
    blk = sch.get_sblock(name)
    n, m, k = sch.get_loops(blk)[-3:]
    n_out, n_in = sch.split(n, [None, tiles.block])
    m_out, m_in = sch.split(m, [None, tiles.block])
    k_out, k_in = sch.split(k, [None, tiles.step])
    sch.reorder(m_out, n_out, k_out, m_in, n_in, k_in)
    # (keys come in blocks of 32 either way: QKᵀ's m, P·V's reduction; block == step)
    _block(sch, tiles, blk, n_out, k_out, False, f"b=v_b_o,s=v_s_o*{tiles.block},t=v_t_o*{tiles.block}", later,
           heads_between, parts)
    return m_out


def _block(sch: Schedule, tiles: Tiles, block, outer, reduction, gemm: bool, key_blocks: str | None, later: list,
           heads_between: bool = False, parts: bool = False) -> None:
    """The register-tile idiom (`register_tile`) on the tiles: ``block``'s 32 × 32 accumulator under
    ``outer``, its init, update (from the loop inside ``reduction``) and store as ``tiles.zero``,
    ``tiles.dot`` (of ``gemm``, ``heads_between`` and ``parts``) and ``tiles.store``, tensorized by
    ``later``. The block's buffer is (…, row, column) and its loops (…, rows, columns, reduction)
    blocks of 32 inside ``outer``."""
    acc = sch.cache_write(block, 0, "local")
    sch.transform_layout(block, ("write", 0),  # one 32 × 32 block per accumulator, whatever is around it
                         lambda *i, m, n: (*i, m // tiles.block, n // tiles.block, m % tiles.block, n % tiles.block),
                         assume_injective_transform=True)
    sch.reverse_compute_at(acc, outer, preserve_unit_loops=True)
    init = sch.decompose_reduction(block, reduction)
    dot = tiles.dot(heads_between, gemm, parts)
    later.append(functools.partial(tensorize, sch, sch.get_loops(block)[-3], dot, key_blocks))
    later.append(functools.partial(tensorize, sch, sch.get_loops(init)[-2], tiles.zero(gemm)))
    later.append(functools.partial(tensorize, sch, sch.get_loops(acc)[-2], tiles.store))


def tile_gemm(sch: Schedule, tiles: Tiles, lanes: int, blk, k: Mapping[str, KnobValue], later: list,
             parts: bool = False, cores: int | None = None):
    """y[…, s, m] = Σ_c x[…, s, c]·w[c, m] on the tiles (loops: batch…, s, m, c; rows and columns
    in whole blocks of 32, w a (m/32, c/2, 32, 2) pair panel): parallel over (batch, row block,
    column block) tasks of ``gemm_rows × gemm_block_rows`` rows (one block of 32 where they are
    symbolic; then, given the ``cores``, up to `SYMBOLIC_TASK_BLOCKS` blocks of columns) × ``gemm_vecs ×
    lanes × gemm_block_cols`` columns, the x and W panels a task streams, as
    `gemm`'s; per 32 × 32 accumulator block, 32 steps of c per product (``tiles.dot``, x's rows read
    in place; with ``parts``, x's and w's bf16 parts, `CpuPlan.parts`). Returns the loop under which
    each block of accumulators is stored."""
    *batch, s, m, c = sch.get_loops(blk)
    extent = sch.get(s).extent
    block = tiles.block
    row_blocks = extent.value // block if isinstance(extent, tvm.tirx.IntImm) else 1
    col_blocks = int(sch.get(m).extent) // block
    rows = divisor_at_most(row_blocks, max(1, knob_int(sch, k["gemm_rows"]) * knob_int(sch, k["gemm_block_rows"])
                                           // block))
    cols = divisor_at_most(col_blocks, max(1, knob_int(sch, k["gemm_vecs"]) * lanes
                                           * knob_int(sch, k["gemm_block_cols"]) // block))
    if cores and not isinstance(extent, tvm.tirx.IntImm):  # a task is one block of rows: more columns
        # each (its blocks' epilogues overlap the next products, `interleave_tile_epilogues`), a column
        # per core at least, and its panels kept in L2 for the next task's rows
        panel = max(1, weight_bytes(sch, blk, sch.get(c).extent, block))
        wide = min(SYMBOLIC_TASK_BLOCKS, col_blocks // cores, L2_WEIGHT // panel)
        cols = divisor_at_most(col_blocks, max(cols, wide))
    streamed = weight_bytes(sch, blk, sch.get(c).extent, int(sch.get(m).extent)) > L2_WEIGHT
    if streamed and row_blocks > 1:  # W streams once: a task's column panels against as many rows of x
        # as L2 keeps (`X_PANEL_BYTES`), each panel read once for all of them
        rows = divisor_at_most(row_blocks, max(1, X_PANEL_BYTES // (block * 2 * int(sch.get(c).extent))))
    r_task, r_out, r_in = sch.split(s, [None, rows, block])
    m_task, m_out, m_in = sch.split(m, [None, cols, block])
    c_out, c_in = sch.split(c, [None, tiles.step])
    if streamed:
        sch.reorder(*batch, m_task, r_task, m_out, r_out, c_out, r_in, m_in, c_in)
    else:
        sch.reorder(*batch, r_task, m_task, r_out, m_out, c_out, r_in, m_in, c_in)
    task = sch.fuse(*batch, m_task, r_task) if streamed else sch.fuse(*batch, r_task, m_task)
    sch.parallel(task)
    tiles.configure(sch, task)
    blocks = sch.fuse(m_out, r_out) if streamed else sch.fuse(r_out, m_out)  # (a task's blocks of accumulators)
    sch.annotate(blocks, TILE_BLOCKS, 1)  # each block's epilogue beside the next one's products
    _block(sch, tiles, blk, blocks, c_out, True, None, later, parts=parts)
    return blocks


def pv_rows(sch: Schedule, lanes: int, later: list) -> None:
    """The task's pvᵀ (d_v, q_tile) turned into rows of d_v for the epilogue: 16 × 16 blocks of fp32
    transposed in registers (`isa.panels`, as the query panel's)."""
    rows = copy_of(sch, sch.get_sblock("attn"), ("pv",))  # (after pv's store, inside the task)
    sch.transform_layout(rows, ("write", 0), lambda b, i, st, c, s: (b, i, st, s, c), assume_injective_transform=True)
    intrinsic = query_panel_intrinsic("float32", lanes, False, argument=True, heads_between=False)
    later.append(functools.partial(tensorize_queries, sch, sch.get(rows).name_hint, intrinsic, lanes, lanes, False))
