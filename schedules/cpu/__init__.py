"""FlashAttention-style CPU schedule of the attention tensor expression: the ``cpu`` rule.

`CpuAttention` makes its plan once (`plan.CpuPlan`: every decision, from the instruction set's record
and the knobs) and tries its kernel families on it in order, TVM dlight's way:

    decode.SplitKDecode       one query, few (batch, head) pairs: keys in parallel chunks (split-K)
    query_tiles.QueryTiles    a task per query tile (decode: the dot products along d_k)

after a full layer's projections (`projections`: GEMMs on `micro_kernels`, tile registers or the bf16
dot products). `packing` copies operands into the layouts the micro-kernels read; `tiles` puts
products on tile registers. Every tensor intrinsic is applied last (`micro_kernels.register_tile`'s
``later``): a tensorized stage can leave the root scope no "stage pipeline" for other primitives.
"""

from __future__ import annotations

from typing import Mapping

import tvm
from tvm.s_tir import Schedule
from tvm.target import Target
from tvm.tirx import PrimFunc

from tvmattn.compiler import passes
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import isa_of
from tvmattn.compiler.te_attention import attention_te
from tvmattn.schedules.cpu.decode import SplitKDecode
from tvmattn.schedules.cpu.plan import KNOBS, CpuPlan, gemm_widths, plan_of
from tvmattn.schedules.cpu.projections import schedule_projections
from tvmattn.schedules.cpu.query_tiles import QueryTiles
from tvmattn.schedules.knobs import KnobValue
from tvmattn.schedules.primitives import has_block, knob_int, lanes_for
from tvmattn.schedules.rule import AttentionRule, KernelRule

FAMILIES: tuple[KernelRule, ...] = (SplitKDecode(), QueryTiles())
INLINED = ("q_heads", "k_heads", "v_heads", "logits", "merged")


def lowering(spec: AttentionSpec, target: Target) -> list[tvm.transform.Pass]:
    """The passes a CPU attention kernel leaves to lowering: query tiles computed whole, symbolic
    tails peeled, a padded copy's whole vectors unclamped, maths as polynomials, widened copies read
    as they are, 16-bit buffers kept 16 bits wide, and the instruction set's own (`Isa.passes`)."""
    isa = isa_of(target)
    exp2 = passes.EXP2_P_BF16 if spec.dtype == "bfloat16" else passes.EXP2_P
    return [passes.pad_query_tiles(), passes.peel_key_tails(), passes.unclamp_whole_vectors(),
            passes.polynomial_math(exp2), passes.exact_widenings(), passes.keep_operands_16bit(isa.packed_readers),
            *isa.passes]


class CpuAttention(AttentionRule):
    name = "cpu"  # the name tuning records carry
    target_kind = "llvm"
    KNOBS = KNOBS

    def defaults(self, spec: AttentionSpec, target: Target) -> dict[str, int]:
        return dict(plan_of(spec, target).defaults)

    def workload(self, spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue]) -> PrimFunc:
        """The tensor expression's function, its lengths in the plan's blocks and fp16 in the plan's
        bf16 parts (`te_attention._core`)."""
        plan = plan_of(spec, target)
        return attention_te(spec, plan.padding, plan.parts, plan.half_keys).prim_func()

    def passes(self, spec: AttentionSpec, target: Target) -> list[tvm.transform.Pass]:
        return super().passes(spec, target) + lowering(spec, target)

    def describe(self, spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue]) -> str:
        return describe(plan_of(spec, target, knobs), knobs)

    def apply(self, sch: Schedule, spec: AttentionSpec, target: Target,
              knobs: Mapping[str, KnobValue]) -> Schedule | None:
        """Schedule the PrimFunc of ``spec`` (in place; returns ``sch``)."""
        if not self.applies(spec, target):
            return None
        plan = plan_of(spec, target, {name: knob_int(sch, value) for name, value in knobs.items()})
        for name in INLINED:
            # (W_O's x, merged, a stage of its own where its rows are padded: an einsum's operand)
            # (fp16's merged_hi and merged_lo read it instead)
            if not has_block(sch, name):
                continue
            if name != "merged" or has_block(sch, "merged_hi") or not plan.projection("out").padded:
                sch.compute_inline(sch.get_sblock(name))
        later: list = []
        schedule_projections(sch, plan, knobs, later)
        next(family for family in FAMILIES if family.apply(sch, plan, knobs, later) is not None)
        for step in later:
            step()
        if plan.tiles_used or (later and spec.dtype == "bfloat16" and plan.isa.dot is not None):
            first = sch.get_loops(sch.get_sblock("attn" if spec.projections else spec.output))[0]
            # the instructions' LLVM IR, linked into the kernel's module
            sch.annotate(first, "pragma_import_llvm", plan.isa.tiles.llvm if plan.tiles_used else plan.isa.dot.llvm)
        return sch


def describe(plan: CpuPlan, knobs: Mapping[str, KnobValue]) -> str:
    """The kernel ``plan`` builds, in words, with the knobs it reads."""
    spec, lanes, isa = plan.spec, plan.lanes, plan.isa
    dots = []
    if plan.split_k:
        used = ["key_chunks"]
        what = f"split-K decode over {plan.key_chunks} key chunks"
    else:
        used = ["q_tile", "qk_keys", "pv_rows", "pv_vecs"] if plan.q_tile_read else ["qk_keys", "pv_rows", "pv_vecs"]
        what = f"query tiles × {lanes}-lane vectors"
        if plan.along_head_dim:  # (qk_keys, and q_tile = n_q, unread)
            used = ["pv_rows", "pv_vecs"] if plan.q_tile > 1 else ["pv_vecs"]
            queries = "1 query" if plan.q_tile == 1 else f"{plan.q_tile} queries"
            what = f"{queries} per task × {lanes}-lane dot products along d_k"
        if plan.on_tiles:
            used = ["q_tile"]
            parts = ", fp16 as bf16 hi + lo" if plan.fp16_parts else ""
            what += f", QKᵀ and P·V on {isa.tiles.name} tiles ({isa.tiles.instruction}{parts})"
        else:
            dots = [stage for stage, on in zip(("QKᵀ", "P·V"), (plan.qk_pairs, plan.pv_pairs)) if on]
            widened = [x for x, on in zip("KV", (plan.widen_k, plan.widen_v)) if on]
            if plan.per_head:
                once = f"widening its {_listed(widened)}" if widened else "packing its V in pairs"
                what += f", a task per (batch, KV head) {once} once"
            if plan.half_keys:
                what += f", P·V on fp16 FMAs summed in fp16 over blocks of {plan.half_keys} keys"
    if "pv_vecs" in used and lanes_for(spec.d_v, lanes) < lanes:  # d_v in narrower vectors: one per tile
        used.remove("pv_vecs")
    if spec.projections:
        used += ["gemm_rows", "gemm_vecs", "gemm_block_rows", "gemm_block_cols"]
        on_tiles = [p.weight.upper() for p in plan.projections if p.path == "tiles"]
        if not on_tiles and all(lanes_for(w, lanes) < lanes for w in gemm_widths(spec)):  # `gemm`: one narrower vector
            used.remove("gemm_vecs")
        dots += [p.weight.upper() for p in plan.projections if p.path == "pairs"]
        if on_tiles:
            parts = " (fp16 as bf16 hi + lo)" if spec.dtype == "float16" else ""
            what += f", {_listed(on_tiles)} on {isa.tiles.name} tiles{parts}"
        for tile in dict.fromkeys(p.row_tile for p in plan.projections if p.row_tile):  # (`plan._row_tile`)
            names = [p.weight.upper() for p in plan.projections if p.row_tile == tile]
            what += f", {_listed(names)} in register tiles of {tile[0]} rows (a divisor of theirs) × {tile[1]} vectors"
    if dots:
        what += f", {_listed(dots)} on bf16 dot products ({isa.dot.instruction})"
    return f"{what}: " + " ".join(f"{name}={knobs[name]}" for name in used)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
