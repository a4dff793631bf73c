"""Schedule rules of the attention PrimFunc, tried in order for each target kind.

Each rule keeps the contract of `rule.AttentionRule`: ``applies``, ``KNOBS``, ``defaults``,
``workload`` (the function it schedules) and ``apply`` (None where it does not apply). A kernel that
returns an intermediate stage takes the `intermediate` rule; the attention itself takes the target's
flash-style rule (`cpu`, `cuda`).
"""

from __future__ import annotations

from typing import Mapping

from tvm.s_tir import Schedule
from tvm.target import Target

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.schedules.cpu import CpuAttention
from tvmattn.schedules.cuda import CudaFlashAttention
from tvmattn.schedules.intermediate import IntermediateOutput
from tvmattn.schedules.knobs import KnobValue, resolve
from tvmattn.schedules.rule import AttentionRule

RULES: dict[str, tuple[AttentionRule, ...]] = {
    "llvm": (IntermediateOutput(), CpuAttention()),
    "cuda": (IntermediateOutput(), CudaFlashAttention()),
}


def rule_for(spec: AttentionSpec, target: Target) -> AttentionRule:
    """The first rule for ``target`` that applies to ``spec``."""
    rules = RULES.get(target.kind.name)
    if rules is None:
        raise TvmAttnError(f"no schedule for target kind {target.kind.name!r}: tvmattn schedules {sorted(RULES)}")
    return next(rule for rule in rules if rule.applies(spec, target))


def default_knobs(spec: AttentionSpec, target: Target) -> dict[str, KnobValue]:
    """The knob values the default build uses for ``spec`` on ``target``."""
    rule = rule_for(spec, target)
    return {**{k.name: k.default for k in rule.KNOBS}, **rule.defaults(spec, target)}


def schedule(spec: AttentionSpec, target: Target,
             knobs: Mapping[str, KnobValue] | None = None) -> tuple[Schedule, str]:
    """The rule's schedule of ``spec`` with its default knobs overridden by ``knobs``, and what it is."""
    rule = rule_for(spec, target)
    values = resolve(rule.KNOBS, {**default_knobs(spec, target), **(knobs or {})})
    sch = rule.apply(Schedule(rule.workload(spec, target, values)), spec, target, values)
    return sch, rule.describe(spec, target, values)
