"""A full layer's projections (W_Q, W_K, W_V, W_O): each a GEMM on the register-tile micro-kernel
(`micro_kernels.gemm`), on tile registers (`tile_gemm`), or on the bf16 dot products from pair
panels of W packed once, as `CpuPlan.projections` says; symbolic rows padded to whole blocks, 16-bit
x widened once where the products are fp32 FMAs."""

from __future__ import annotations

import functools
from typing import Mapping

from tvm.s_tir import Schedule

from tvmattn.compiler.passes import KEEP_16BIT
from tvmattn.schedules.cpu.packing import (
    before_tasks,
    tensorize_weight_pairs,
    weight_panels,
    widened_once,
)
from tvmattn.schedules.cpu.plan import CpuPlan, Projection
from tvmattn.schedules.cpu.tiles import tile_gemm
from tvmattn.schedules.knobs import KnobValue
from tvmattn.schedules.micro_kernels import PADDED_ROW_BLOCK, dot_columns, gemm
from tvmattn.schedules.primitives import copy_of, has_block, knob_int, vectorize


def schedule_projections(sch: Schedule, plan: CpuPlan, k: Mapping[str, KnobValue], later: list) -> None:
    """Every projection of the layer (none for a core kernel), and fp16's operand parts."""
    _widen_projection_inputs(sch, plan)
    for projection in plan.projections:
        if has_block(sch, projection.name):
            _gemm(sch, plan, projection, k, later)
    for x in ("x", "x_kv", "merged"):  # fp16 projections' operand parts (`CpuPlan.parts`): a pass each
        if has_block(sch, x + "_hi"):
            before_tasks(sch, (x + "_hi", x + "_lo"), plan.lanes)


def _widen_projection_inputs(sch: Schedule, plan: CpuPlan) -> None:
    """The 16-bit x of the projections that widen to fp32 FMAs (path "widened"), x_kv's and W_O's
    merged heads too, each widened once before the tasks (`widened_once`): a register tile's
    row then broadcasts plain fp32, where it took a broadcast and a conversion per element, a row of
    the tile each. Padded rows are widened in the pass that pads them (`_pad_rows`)."""
    spec = plan.spec
    widened = [sch.get_sblock(p.name + "_acc") for p in plan.projections if p.path == "widened" and not p.padded]
    for x, width in (("x", spec.d), ("x_kv", spec.d), ("attn", spec.d_v)):  # (W_O reads attn)
        readers = [blk for blk in widened if x in (r.source.name for r in sch.get(blk).reads)]
        if readers:
            widened_once(sch, sch.get(readers[0]).name_hint, (x,), width, plan.lanes, readers)


def _gemm(sch: Schedule, plan: CpuPlan, projection: Projection, k: Mapping[str, KnobValue], later: list) -> None:
    """A projection of the layer: `gemm` (`tile_gemm` on tile registers) on its block, and its cast
    to the storage dtype, if any: in `gemm`'s register-tile store, after the tiles' stores. On the
    bf16 dot products and the tiles W is packed into pairs first, once, before the tasks (fp16: its
    two parts' panels); the tensorize steps of the register tile and of that copy go to ``later``."""
    isa, lanes, name = plan.isa, plan.lanes, projection.name
    acc_name = name + "_acc" if has_block(sch, name + "_acc") else name
    blk = sch.get_sblock(acc_name)
    on_tiles = projection.path == "tiles"
    pairs = projection.path in ("tiles", "pairs")
    parts = projection.parts  # (x's parts and W's are stages of their own)
    if projection.row_tile is not None:  # (the panels below are of its columns)
        k = {**k, "gemm_rows": projection.row_tile[0], "gemm_vecs": projection.row_tile[1]}
    if projection.padded:
        _pad_rows(sch, blk, lanes, cast=acc_name != name, block=isa.tiles.block if on_tiles else PADDED_ROW_BLOCK,
                  widen=projection.path == "widened")
    if pairs:  # panels of a tile's columns, pairs of W's rows interleaved, (m/w, c/2, w, 2): tiles' w is
        # their block (each B operand's rows 128 bytes apart), the dot products' a register tile's columns
        width = int(sch.get(sch.get_loops(blk)[-2]).extent)
        block = isa.tiles.block if on_tiles else dot_columns(sch, width, lanes, k["gemm_vecs"])
        w = projection.weight
        panels = [sch.get_sblock(w + "_hi"), sch.get_sblock(w + "_lo")] if parts else [copy_of(sch, blk, (w,))]
        for panel in panels:
            sch.transform_layout(panel, ("write", 0), weight_panels(block), assume_injective_transform=True)
    elif projection.panels:
        _pack_panels(sch, blk, projection.weight, knob_int(sch, k["gemm_vecs"]) * lanes, lanes)
    # the cast to the storage dtype as each register tile is stored, but after the tiles' stores (of
    # fp32 rows) and padded rows' tiles (which run past the rows it stores)
    fused = acc_name != name and not on_tiles and not projection.padded
    left = []
    if on_tiles:
        tile_gemm(sch, isa.tiles, lanes, blk, k, later, parts)
    else:
        left = gemm(sch, blk, lanes, k, (sch.get_sblock(name),) if fused else (),
                    dot=isa.dot if pairs else None, later=later if pairs else None)
    if pairs:
        names = [sch.get(panel).name_hint for panel in panels]
        later.append(functools.partial(tensorize_weight_pairs, sch, isa.dot, names,
                                       plan.spec.dtype if parts else "bfloat16"))
    if acc_name != name and (not fused or left):  # the cast in a pass of its own, per output element
        cast = sch.get_sblock(name)
        loops = sch.get_loops(cast)
        sch.parallel(sch.fuse(*loops[:2]))
        vectorize(sch, loops[-1], int(sch.get(loops[-1]).extent), lanes)


def _pad_rows(sch: Schedule, blk, lanes: int, cast: bool, block: int, widen: bool = False) -> None:
    """A projection's rows computed in whole blocks (``pad_einsum``: x copied with zero rows past its
    end, in a parallel pass, widened to fp32 with ``widen``; the accumulator's extra rows are never
    stored): symbolic ones in blocks of `PADDED_ROW_BLOCK`, and on tile registers any in their blocks, so
    that `gemm`'s tiles divide them: no tail predicate in the micro-kernel (where the 16-bit products
    cannot take one at all)."""
    sch.pad_einsum(blk, [1, block, 1, 1])
    copies = [b for b in sch.get_producers(blk) if sch.get(b).name_hint.endswith("_pad")]  # x's (fp16: its parts')
    for copy in copies if widen else ():
        sch.unsafe_set_dtype(copy, 0, "float32")
    for stage in sch.get_producers(copies[0]):  # merged (W_O's x): read where it is padded
        if sch.get(stage).name_hint == "merged":
            sch.compute_inline(stage)
    back = sch.get_consumers(blk)[0]  # the copy of the real rows: into the cast to 16 bits, if any
    if cast:
        sch.compute_inline(back)
    else:  # (an fp32 projection: its readers look for it by name)
        copies.append(back)
    for copy in copies:
        *rows, c = sch.get_loops(copy)
        sch.parallel(sch.fuse(*rows))
        vectorize(sch, c, None, lanes)


def _pack_panels(sch: Schedule, blk, weight: str, width: int, lanes: int) -> None:
    """W (c, m) copied as (m / ``width``, c, ``width``): a register tile's columns are one run of
    memory along the reduction (read in place, each step of the reduction loads the tile's vectors
    from a row of W d_model elements after the last). One parallel pass over W before the tasks (a
    workspace its size)."""
    if int(sch.get(sch.get_loops(blk)[-2]).extent) % width:  # columns: a tail tile would read past a panel
        return
    panel = copy_of(sch, blk, (weight,))
    sch.transform_layout(panel, ("write", 0), lambda c, m: (m // width, c, m % width),
                         assume_injective_transform=True)
    c, m = sch.get_loops(panel)
    m_out, m_in = sch.split(m, [None, width])
    sch.reorder(m_out, c, m_in)
    sch.parallel(sch.fuse(m_out, c))
    vectorize(sch, m_in, width, lanes)
    sch.annotate(panel, KEEP_16BIT, 1)  # (bf16: TVM would store its own bf16 buffer widened to fp32)
