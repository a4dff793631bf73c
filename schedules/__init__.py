"""Schedule rules of the attention PrimFunc, tried in order for each target kind.

Each rule keeps the contract of `rule.AttentionRule`: ``applies``, ``KNOBS``, ``defaults``,
``workload`` (the function it schedules), ``apply`` (None where it does not apply) and ``passes``. A
kernel that returns an intermediate stage takes the `intermediate` rule; the attention itself takes
the target's flash-style rule (`cpu`, `cuda`). An LLVM CPU's rules are those of its instruction set's
family (`Isa.family`, the record `compiler.target.isa_of` chooses).
"""

from __future__ import annotations

from typing import Mapping

from tvm.s_tir import Schedule
from tvm.target import Target

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import isa_of
from tvmattn.schedules.cpu import CpuAttention
from tvmattn.schedules.cuda import CudaFlashAttention
from tvmattn.schedules.intermediate import IntermediateOutput
from tvmattn.schedules.knobs import KnobValue, resolve
from tvmattn.schedules.rule import AttentionRule

CPU_RULES = (IntermediateOutput(), CpuAttention())
# target kind → rules by family: an LLVM CPU's instruction-set family, another kind's own name
RULES: dict[str, dict[str, tuple[AttentionRule, ...]]] = {
    "llvm": {"x86": CPU_RULES, "generic": CPU_RULES},
    "cuda": {"cuda": (IntermediateOutput(), CudaFlashAttention())},
}


def rule_for(spec: AttentionSpec, target: Target) -> AttentionRule:
    """The first rule for ``target`` that applies to ``spec``."""
    families = RULES.get(target.kind.name)
    if families is None:
        raise TvmAttnError(f"no schedule for target kind {target.kind.name!r}: tvmattn schedules {sorted(RULES)}")
    isa = isa_of(target)
    return next(rule for rule in families[isa.family if isa else target.kind.name] if rule.applies(spec, target))


def default_knobs(spec: AttentionSpec, target: Target, rule: AttentionRule | None = None) -> dict[str, KnobValue]:
    """The knob values the default build uses for ``spec`` on ``target`` (``rule``: `rule_for`'s)."""
    rule = rule or rule_for(spec, target)
    return {**{k.name: k.default for k in rule.KNOBS}, **rule.defaults(spec, target)}


def schedule(spec: AttentionSpec, target: Target,
             knobs: Mapping[str, KnobValue] | None = None) -> tuple[Schedule, str]:
    """The rule's schedule of ``spec`` with its default knobs overridden by ``knobs``, and what it is."""
    rule = rule_for(spec, target)
    values = resolve(rule.KNOBS, {**default_knobs(spec, target, rule), **(knobs or {})})
    sch = rule.apply(Schedule(rule.workload(spec, target, values)), spec, target, values)
    return sch, rule.describe(spec, target, values)
