"""The query-tile kernel (prefill, and any spec with more tasks than cores), the `QueryTiles` rule.

One parallel task per (batch, head, query tile of ``q_tile`` rows); the query heads of a GQA group
take consecutive tasks on the same tile, so the K/V rows they share are still in cache. A 16-bit K or
V widened to fp32 for the FMAs is widened once: in a task per (batch, KV head) that runs its query
tiles in turn, where those pairs split evenly over the cores (`CpuPlan.per_head`), else in a pass
before the tasks. Every attention stage is computed inside the query tile, so a task holds a
q_tile × n_kv score tile, never the n × n_kv matrix. Tiles are stored key-major, (tile, t, s), so
that every stage vectorises over queries:

    pack    q tile → (d_k, q_tile)                           once per task, lanes × lanes blocks
                                                             transposed in registers (`isa.panels`)
    scores  acc[qk_keys][q_tile/lanes vectors] += k[t, e] (broadcast) · q[e, s:s+lanes]
            row_max: of each register tile as it is stored (a mask tile: a pass of its own)
    probs   exp2(logits - row_max), vectorised over s; row_sum: of each key's row as it is computed
    pv      acc[pv_rows][pv_vecs vectors] += probs[t, s] (broadcast) · v[t, c:c+lanes]
    attn    pv / row_sum

Each stage reads what the one before wrote while it is in L1: the q_tile × n_kv tile streams through
L2 once per stage. On the bf16 dot products (`CpuPlan.qk_pairs`, `pv_pairs`) P's pair panel is
packed from each pair of keys as probs computes it, and V's once. On tile registers (`CpuPlan.on_tiles`,
`tiles`) the same stages keep their layout:

    scores  acc[32 keys][32 queries] += k[t:t+32, e:e+32] · panel[e/2, s:s+32, 2]    (K in place)
    pv      accᵀ[32 of d_v][32 queries] += vᵀ[c:c+32, t:t+32] · P[t/2, s:s+32, 2]  (Vᵀ before the tasks)
    attn    pvᵀ turned into rows (`pv_rows`), then / row_sum

with lengths padded to whole blocks (`CpuPlan.padding`) and fp16 as bf16 parts (`fp16_parts`). A
query tile no vector of queries fits (one query, a decode step) runs its dot products along d_k
instead (`decode`). Masked key tiles are removed after scheduling (`passes.skip_masked_key_tiles`).
"""

from __future__ import annotations

import functools
from typing import Mapping

from tvm.s_tir import Schedule

from tvmattn.compiler.annotations import KEY_STEP
from tvmattn.compiler.isa.panels import PAIR
from tvmattn.compiler.isa.record import Dot
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.schedules.cpu.decode import scores_along_head_dim, split_head_dim
from tvmattn.schedules.cpu.packing import (
    before_tasks,
    in_blocks,
    pack_mask,
    pack_pairs,
    pack_parts,
    pack_queries,
    pack_query_parts,
    tensorize_pairs,
    tensorize_parts,
    widened_once,
)
from tvmattn.schedules.cpu.plan import CpuPlan
from tvmattn.schedules.cpu.tiles import pv_rows, tile_stage
from tvmattn.schedules.knobs import KnobValue
from tvmattn.schedules.micro_kernels import register_tile
from tvmattn.schedules.primitives import (
    copy_of,
    divisor_at_most,
    has_block,
    knob_int,
    lanes_for,
    loops_by_axis,
    vectorize,
)
from tvmattn.schedules.rule import KernelRule

PER_TILE = ("pv", "row_sum", "probs", "row_max", "scores")  # consumers first, for compute_at


class QueryTiles(KernelRule):
    name = "query tiles"

    def apply(self, sch: Schedule, plan: CpuPlan, knobs: Mapping[str, KnobValue], later: list) -> Schedule | None:
        if plan.split_k:
            return None
        _attention_core(sch, plan, knobs, later)
        return sch


def _attention_core(sch: Schedule, plan: CpuPlan, k: Mapping[str, KnobValue], later: list) -> None:
    spec, lanes, isa = plan.spec, plan.lanes, plan.isa
    tile_factor = k["q_tile"] if plan.q_tile_is_knob else plan.q_tile
    q_tile = plan.q_tile
    s_lanes = lanes_for(q_tile, lanes)  # queries per vector
    qk_keys = k["qk_keys"] if plan.qk_keys_is_knob else plan.qk_keys
    on_tiles, parts = plan.on_tiles, plan.fp16_parts
    if plan.along_head_dim:
        scores_rf = split_head_dim(sch, lanes_for(spec.d_k, lanes))
    # Tile-local buffers are laid out (query tile, key, query in tile): vectors run along queries, and
    # the tile axis makes their compacted size q_tile × n_kv even when lengths are symbolic.
    by_tile = lambda b, i, s, *rest: (b, i, s // q_tile, *rest, s % q_tile)  # noqa: E731
    for name in ("scores", "probs", "row_max", "row_sum"):
        sch.transform_layout(sch.get_sblock(name), ("write", 0), by_tile, assume_injective_transform=True)
    # (tiles: pvᵀ, d_v-major, as they compute it: `tile_stage`)
    pv_at = (lambda b, i, s, c: (b, i, s // q_tile, c, s % q_tile)) if on_tiles else (  # noqa: E731
        lambda b, i, s, c: (b, i, s // q_tile, s % q_tile, c))
    sch.transform_layout(sch.get_sblock("pv"), ("write", 0), pv_at, assume_injective_transform=True)

    attn = sch.get_sblock("attn")
    loops = loops_by_axis(sch, attn)
    s_tile, s_in = sch.split(loops["s"], [None, tile_factor])
    # GQA: the query heads of a group take consecutive tasks on the same query tile, so the key and
    # value rows one task streams are still in cache for the next
    head_kv, head_in_group = sch.split(loops["i"], [None, spec.group])
    sch.reorder(loops["b"], head_kv, s_tile, head_in_group, s_in, loops["c"])
    if plan.per_head:  # the per-tile stages live in ``task``, the loop over a head task's tiles
        head = sch.fuse(loops["b"], head_kv)
        task = sch.fuse(s_tile, head_in_group)
        sch.parallel(head)
    else:
        head = None  # (16-bit K and V widened in a pass before the tasks)
        task = sch.fuse(loops["b"], head_kv, s_tile, head_in_group)
        sch.parallel(task)
    if on_tiles:
        isa.tiles.configure(sch, task)
    vectorize(sch, loops["c"], spec.d_v, lanes)
    inner = ("p_hi", "p_lo") if parts else ("pv_block",) if plan.half_keys else ()  # P·V's own stages
    for name in PER_TILE[:1] + inner + PER_TILE[1:]:  # consumers first
        sch.compute_at(sch.get_sblock(name), task, preserve_unit_loops=True)
    if has_block(sch, "v_rows"):  # keys in whole blocks (`CpuPlan.padding`): P·V's panels are packed from them
        if not plan.v_pairs:  # (else in the head's task, before V's panel: `pack_pairs`)
            in_blocks(sch, "v_rows", lanes, plan.pv_pairs)
        in_blocks(sch, "k_rows", lanes, on_tiles)
    if parts:  # K's and V's parts, once before the tasks, in one pass
        before_tasks(sch, ("k_hi", "k_lo", "v_hi", "v_lo"), lanes)

    if plan.along_head_dim:
        scores_along_head_dim(sch, scores_rf, later)
        _row_reduction(sch, "row_max", s_lanes)
    else:
        _scores_and_row_max(sch, plan, task, head, qk_keys, later)
    probs = sch.get_sblock("probs")
    s, t = sch.get_loops(probs)[-2:]
    if plan.pv_pairs:  # a pair of keys at a time: P's panel is packed from them while they are in registers
        t, t_pair = sch.split(t, [None, PAIR])
        sch.reorder(t, t_pair, s)
    else:
        sch.reorder(t, s)
    if s_lanes > 1:
        vectorize(sch, s, q_tile, s_lanes)
        _row_reduction(sch, "row_sum", s_lanes, t)
    else:  # one query: the keys are contiguous
        vectorize(sch, t, spec.n_kv if isinstance(spec.n_kv, int) else None, lanes)
        _row_reduction(sch, "row_sum", s_lanes)
    panels = None
    if plan.pv_pairs and parts:
        panels = pack_parts(sch, t, q_tile, isa.tiles.step)
    elif plan.pv_pairs:
        panels = pack_pairs(sch, spec, t, isa.tiles.step if on_tiles else None, head if plan.v_pairs else None,
                            lanes=lanes)
    if plan.widen_v:
        widened_once(sch, "pv", ("v_rows", "v", "v_proj"), spec.d_v, lanes, at=head)
    if on_tiles:
        tile_stage(sch, isa.tiles, "pv", False, parts, later)
        pv_rows(sch, lanes, later)
    elif plan.half_keys:
        _weights_v_in_half(sch, spec, isa.vector_lanes("float16"), q_tile, plan.pv_rows, k["pv_vecs"])
    else:  # whole row groups per tile: a partial group's accumulator has a loop-dependent size
        _weights_v(sch, spec, lanes, plan.pv_rows, k["pv_vecs"], isa.dot if plan.pv_pairs else None, later,
                   isa.key_step)
    if panels and parts:
        later.append(functools.partial(tensorize_parts, sch, isa, panels, q_tile))
    elif panels:
        later.append(functools.partial(tensorize_pairs, sch, isa, spec, panels, q_tile, on_tiles, plan.v_pairs))


def _scores_and_row_max(sch: Schedule, plan: CpuPlan, task, head, qk_keys: KnobValue, later: list) -> None:
    """QKᵀ from the task's query panel (on tile registers, the bf16 dot products or fp32 FMAs) and
    the row maxima: of each register tile as it is stored, or a pass over a per-query mask's tile."""
    spec, lanes, q_tile = plan.spec, plan.lanes, plan.q_tile
    s_lanes = lanes_for(q_tile, lanes)
    if plan.fp16_parts:
        pack_query_parts(sch, task, q_tile, lanes, later)
    else:
        pack_queries(sch, spec, task, q_tile, lanes, plan.qk_pairs, later)
    if plan.widen_k:
        widened_once(sch, "scores", ("k", "k_proj"), spec.d_k, lanes, at=head)
    if plan.on_tiles:
        in_place = not (plan.fp16_parts or spec.projections or has_block(sch, "k_rows"))  # K read as it is given
        tile_keys = tile_stage(sch, plan.isa.tiles, "scores", in_place and spec.layout == "BSHD",
                                    plan.fp16_parts, later)
    else:
        # (a layer's k_proj outside head tasks)
        widen = spec.dtype != "float32" and not plan.qk_pairs and not plan.widen_k
        tile_keys = _scores(sch, s_lanes, qk_keys, plan.isa.dot if plan.qk_pairs else None, later, widen=widen)
    if spec.attn_mask is not None and {"s", "t"} <= set(spec.attn_mask_dims):
        # (row_max then reads the mask's tile: a pass of its own)
        pack_mask(sch, spec, task, q_tile, lanes, later, per_head=head is not None)
        _row_reduction(sch, "row_max", s_lanes)
    else:  # of each register tile as it is stored
        _row_reduction(sch, "row_max", s_lanes, tile_keys)


def _row_reduction(sch: Schedule, name: str, s_lanes: int, at=None) -> None:
    """row_max or row_sum vectorised over queries, reducing along keys: a pass of its own over the
    task's tile, or, ``at`` the loop over keys of the stage it reads, inside it (reading what that
    stage just wrote, from L1: the tile streams through L2 once per stage)."""
    blk = sch.get_sblock(name)
    if at is None:
        s, t = sch.get_loops(blk)[-2:]
        s_out, s_vec = sch.split(s, [None, s_lanes])
        sch.reorder(s_out, t, s_vec)
        vectorize(sch, s_vec, s_lanes, s_lanes)
        sch.decompose_reduction(blk, t)
        return
    sch.reverse_compute_at(blk, at, preserve_unit_loops=True)
    s, t = sch.get_loops(blk)[-2:]
    sch.reorder(t, s)
    vectorize(sch, s, None, s_lanes)
    sch.decompose_reduction(blk, at)


def _scores(sch: Schedule, lanes: int, keys_factor: KnobValue, dot: Dot | None, later: list, widen: bool):
    """acc[qk_keys keys][q_tile queries] += k[t, e] · q[e, s], over e, in registers (``lanes``
    queries per vector); with ``dot``, two steps of e per instruction (``dot.intrinsic``: the pair
    k[t, e:e+2] broadcast, the panel's q[e:e+2, s:s+lanes]); ``widen``: 16-bit keys widened to fp32
    a key tile at a time (`_widen_keys`: a layer's k_proj where no head task widens it).
    Returns the loop over register tiles of keys."""
    scores = sch.get_sblock("scores")
    s, t, e = sch.get_loops(scores)[-3:]
    keys = knob_int(sch, keys_factor)
    t_out, t_in = sch.split(t, [None, keys_factor])
    s_out, s_vec = sch.split(s, [None, lanes])
    if dot is not None:
        e, e_pair = sch.split(e, [None, dot.pair])
        sch.reorder(t_out, e, t_in, s_out, s_vec, e_pair)
    else:
        sch.reorder(t_out, e, t_in, s_out, s_vec)
    if widen:
        _widen_keys(sch, scores, t_out, lanes)
    register_tile(sch, scores, t_out, lambda b, i, st, t, s: (b, i, st, t // keys, t % keys, s),
                  (t_in, s_out), s_vec, lanes, e, intrinsic=None if dot is None else dot.intrinsic,
                  key_blocks=f"b=v_b_o,s=v_s_o*{lanes},t=v_t_o", later=later)
    return t_out


def _widen_keys(sch: Schedule, scores, t_out, lanes: int) -> None:
    """The qk_keys × d_k keys of a register tile converted to fp32 once, a vector at a time, into a
    small tile the FMAs broadcast from: widening each key element where it is broadcast costs a
    conversion per FMA group."""
    tile = copy_of(sch, scores, ("k_proj",))
    sch.compute_at(tile, t_out, preserve_unit_loops=True)
    sch.unsafe_set_dtype(tile, 0, "float32")
    vectorize(sch, sch.get_loops(tile)[-1], None, lanes)


def _weights_v_in_half(sch: Schedule, spec: AttentionSpec, lanes: int, q_tile: int, rows: int, vecs: KnobValue) -> None:
    """P·V on fp16 FMAs (``lanes``: fp16's): for each block of keys, acc[pv_rows queries][pv_vecs·lanes
    of d_v] in fp16 registers += probs[t, s] · v[t, c] over the block (pv_block), then added to the
    task's fp32 pv tile (`te_attention._pv_in_half`)."""
    # P stored in fp16 as probs computes it: the FMAs take it by element, no conversion each (row_sum
    # then sums the same rounded weights that P·V does)
    sch.unsafe_set_dtype(sch.get_sblock("probs"), 0, "float16")
    pv = sch.get_sblock("pv")
    s, c, tb = sch.get_loops(pv)[-3:]
    s_out, s_in = sch.split(s, [None, rows])
    vecs = divisor_at_most(spec.d_v // lanes, knob_int(sch, vecs))  # (d_v in whole vectors: `plan._half_keys`)
    c_out, c_mid, c_vec = sch.split(c, [None, vecs, lanes])
    sch.reorder(s_out, c_out, tb, s_in, c_mid, c_vec)
    block = sch.get_sblock("pv_block")
    # (by query tile and row group, as the task's other buffers: its size stays whole query tiles where a
    # query tail cuts the last one, whose rows all compute: `passes.pad_query_tiles`)
    sch.transform_layout(block, ("write", 0),
                         lambda b, i, s, t, c: (b, i, s // q_tile, s % q_tile // rows, t, s % rows, c),
                         assume_injective_transform=True)
    sch.compute_at(block, tb, preserve_unit_loops=True)
    sch.set_scope(block, 0, "local")
    *_, b_s, b_t, b_c, ti = sch.get_loops(block)  # (the block's rows, its one block of keys, d_v; the keys in it)
    b_mid, b_vec = sch.split(b_c, [None, lanes])
    sch.reorder(ti, b_t, b_s, b_mid, b_vec)
    for loop in (b_t, b_s, b_mid, s_in, c_mid):  # the register tile and its store into pv, unrolled
        sch.unroll(loop)
    vectorize(sch, b_vec, lanes, lanes)
    vectorize(sch, c_vec, lanes, lanes)
    sch.decompose_reduction(block, ti)
    init = sch.get_sblock("pv_block_init")
    vectorize(sch, sch.get_loops(init)[-1], lanes, lanes)
    for loop in sch.get_loops(init)[-4:-1]:
        sch.unroll(loop)
    sch.decompose_reduction(pv, tb)


def _weights_v(sch: Schedule, spec: AttentionSpec, lanes: int, rows: int, vecs: KnobValue, dot: Dot | None,
               later: list, key_step: int = 1) -> None:
    """acc[pv_rows queries][pv_vecs·lanes of d_v] += probs[t, s] · v[t, c], over t, in registers;
    with ``dot``, two keys per instruction (``dot.pair_first`` on `pack_pairs`' panels); else
    ``key_step`` keys a step of the loop over keys (`Isa.key_step`)."""
    pv = sch.get_sblock("pv")
    s, c, t = sch.get_loops(pv)[-3:]
    s_out, s_in = sch.split(s, [None, rows])
    lanes_c = lanes_for(spec.d_v, lanes)
    if dot is not None:  # whole tiles: a tile tail's predicate would sit inside the instruction
        vecs = divisor_at_most(spec.d_v // lanes_c, knob_int(sch, vecs))
    c_out, c_mid, c_vec = sch.split(c, [None, vecs if lanes_c == lanes else 1, lanes_c])
    if dot is not None:
        t, t_pair = sch.split(t, [None, dot.pair])
        sch.reorder(s_out, c_out, t, s_in, c_mid, c_vec, t_pair)
    else:
        sch.reorder(s_out, c_out, t, s_in, c_mid, c_vec)
    register_tile(sch, pv, c_out, lambda b, i, st, s, c: (b, i, st, s // rows, s % rows, c),
                  (s_in, c_mid), c_vec, lanes_c, t, intrinsic=None if dot is None else dot.pair_first,
                  key_blocks=f"b=v_b_o,s=v_s_o,t=v_t_o*{PAIR}", later=later)
    if dot is None and key_step > 1:  # the loop over keys in steps of key_step, each unrolled
        _, t_step = sch.split(t, [None, key_step])
        sch.unroll(t_step)
        sch.annotate(pv, KEY_STEP, key_step)
