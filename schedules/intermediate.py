"""A plain schedule for kernels that return an intermediate stage (``spec.output`` other than "attn").

ONNX ``Attention`` can expose its (B, h, n, n_kv) scores or softmax weights (``qk_matmul_output``);
tvmattn computes those with a second kernel from the same tensor expression. It materialises the
whole score matrix anyway, so the flash schedule's tiling buys nothing: on the CPU every stage runs
in parallel over (batch, head); on CUDA TVM's default GPU rules (dlight's fallback) apply.
"""

from __future__ import annotations

from typing import Mapping

import tvm
from tvm.s_tir import Schedule, dlight
from tvm.target import Target

from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import is_cpu
from tvmattn.schedules.cpu import lowering
from tvmattn.schedules.knobs import KnobValue
from tvmattn.schedules.rule import AttentionRule


class IntermediateOutput(AttentionRule):
    name = "intermediate"

    def applies(self, spec: AttentionSpec, target: Target) -> bool:
        return spec.output != "attn"

    def describe(self, spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue]) -> str:
        if target.kind.name == "cuda":
            return "dlight fallback rules"
        return "every stage parallel over (batch, head)"

    def passes(self, spec: AttentionSpec, target: Target) -> list[tvm.transform.Pass]:
        return super().passes(spec, target) + (lowering(spec, target) if is_cpu(target) else [])

    def apply(self, sch: Schedule, spec: AttentionSpec, target: Target,
              knobs: Mapping[str, KnobValue]) -> Schedule | None:
        if not self.applies(spec, target):
            return None
        if target.kind.name == "cuda":
            with target:
                return dlight.gpu.Fallback().apply(sch.mod["main"], target, False)
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            batch, head = sch.get_loops(block)[:2]  # every stage is indexed (b, head, …) first
            sch.parallel(sch.fuse(batch, head))
        return sch
