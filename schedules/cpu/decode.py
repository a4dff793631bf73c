"""Decode (one query): the dot products run along d_k, each key's in one vector of partial sums summed
as a tree; with few (batch, head) pairs for the cores, the keys split into parallel chunks (split-K,
the `SplitKDecode` rule). The query-tile kernel's decode path shares the dot products."""

from __future__ import annotations

import functools
from typing import Mapping

from tvm.s_tir import Schedule

from tvmattn.compiler.isa.lane_sums import lane_sum_intrinsic
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.schedules.cpu.plan import CpuPlan
from tvmattn.schedules.knobs import KnobValue
from tvmattn.schedules.primitives import knob_int, lanes_for, loops_by_axis, tensorize, vectorize
from tvmattn.schedules.rule import KernelRule


class SplitKDecode(KernelRule):
    """One query against many keys with fewer (batch, head) pairs than twice the cores: only the keys
    can keep the cores busy (`CpuPlan.key_chunks`)."""

    name = "split-K decode"

    def apply(self, sch: Schedule, plan: CpuPlan, knobs: Mapping[str, KnobValue], later: list) -> Schedule | None:
        if not plan.split_k:
            return None
        _split_keys(sch, plan.spec, plan.lanes, plan.key_chunks, later)
        return sch


def _split_keys(sch: Schedule, spec: AttentionSpec, lanes: int, chunks: int, later: list) -> None:
    """Split-K decode: every key reduction becomes per-chunk partials computed in parallel (rfactor)
    and a small combine; scores and probs run in parallel over key chunks directly. ``chunks``
    divides n_kv.

        scores[t]              parallel over chunks of t     (dot products along d_k, `scores_along_head_dim`)
        row_max_rf[chunk]      parallel  → row_max = max over chunks
        probs[t]               parallel over chunks of t
        row_sum_rf[chunk], pv_rf[chunk, c]   parallel → sums over chunks
    """
    scores_rf = split_head_dim(sch, lanes_for(spec.d_k, lanes))
    partial = {}
    for name in ("row_max", "row_sum", "pv"):
        t = sch.get_loops(sch.get_sblock(name))[-1]
        chunk, _ = sch.split(t, [chunks, None])
        partial[name] = sch.rfactor(chunk, 0)
    attn = sch.get_sblock("attn")
    loops = loops_by_axis(sch, attn)
    sch.reorder(loops["b"], loops["i"], loops["s"], loops["c"])
    task = sch.fuse(loops["b"], loops["i"], loops["s"])  # few: serial, the parallelism is inside
    vectorize(sch, loops["c"], spec.d_v, lanes)
    for blk in (sch.get_sblock("pv"), partial["pv"], sch.get_sblock("row_sum"), partial["row_sum"],
                sch.get_sblock("probs"), sch.get_sblock("row_max"), partial["row_max"], sch.get_sblock("scores")):
        sch.compute_at(blk, task, preserve_unit_loops=True)

    scores_along_head_dim(sch, scores_rf, later, chunks)
    for name in ("row_max", "row_sum"):
        chunk = sch.get_loops(partial[name])[-5]  # (chunk, b, i, s, t_in)
        sch.parallel(chunk)
    probs_t = sch.get_loops(sch.get_sblock("probs"))[-1]
    chunk, t_in = sch.split(probs_t, [chunks, None])
    sch.parallel(chunk)
    vectorize(sch, t_in, None, lanes)
    chunk, *_, c, t_in = sch.get_loops(partial["pv"])[-6:]  # (chunk, b, i, s, c, t_in)
    sch.reorder(t_in, c)
    sch.parallel(chunk)
    vectorize(sch, c, spec.d_v, lanes)
    sch.decompose_reduction(partial["pv"], t_in)
    vectorize(sch, sch.get_loops(sch.get_sblock("pv"))[-1], spec.d_v, lanes)


def split_head_dim(sch: Schedule, lanes: int):
    """Before anything moves: scores = Σ_lane Σ_e_out q·k, each inner sum one vector lane (a key's
    lanes side by side, the operand of `isa.lane_sums.lane_sum_intrinsic`)."""
    scores = sch.get_sblock("scores")
    *_, e = sch.get_loops(scores)
    _, e_lane = sch.split(e, [None, lanes])
    scores_rf = sch.rfactor(e_lane, 0)
    sch.transform_layout(scores_rf, ("write", 0), lambda lane, b, i, s, t: (b, i, s, t, lane))
    return scores_rf


def scores_along_head_dim(sch: Schedule, scores_rf, later: list, chunks: KnobValue | None = None) -> None:
    """Per key: lanes partial dot products over d_k (one vector FMA per step), then their sum in a
    tree (`isa.lane_sums`, a step for ``later``); with ``chunks``, the keys run in that many parallel chunks.

    The blocks' loops follow their iterators: scores (e_lane, b, i, s, t) and, inside one key,
    scores_rf (e_lane, b, i, s, t, e_out).
    """
    scores = sch.get_sblock("scores")
    e_lane, *_, t = sch.get_loops(scores)[-5:]
    sch.reorder(t, e_lane)
    if chunks is not None:
        chunk, t = sch.split(t, [chunks, None])
        sch.parallel(chunk)
    sch.compute_at(scores_rf, t, preserve_unit_loops=True)
    e_lane, *_, e_out = sch.get_loops(scores_rf)[-6:]
    sch.reorder(e_out, e_lane)
    sch.vectorize(e_lane)
    sch.decompose_reduction(scores_rf, e_out)
    *_, t, unit, _, _, lane = sch.get_loops(scores)  # (t, b, i, s units, lane)
    sch.decompose_reduction(scores, unit)
    lanes = knob_int(sch, sch.get(lane).extent)
    later.append(functools.partial(tensorize, sch, lane, lane_sum_intrinsic(lanes)))
