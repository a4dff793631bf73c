"""Schedules of the attention PrimFunc, one module per target kind.

Each module declares its knob space once (``KNOBS``) and has
``apply(sch, spec, target, knobs) -> Schedule``, which the default build and MetaSchedule's
design space both call. Optionally also:
  ``defaults(spec, target) -> dict``   knob defaults that depend on the spec and the target (arch);
  ``workload(spec, knobs) -> PrimFunc`` the function to schedule, when it is not the tensor
                                        expression's (CUDA schedules an online-softmax template).
"""

from __future__ import annotations

from types import ModuleType
from typing import Mapping

from tvm.s_tir import Schedule
from tvm.target import Target
from tvm.tirx import PrimFunc

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.spec import AttentionSpec

from . import cpu, cuda, generic
from .knobs import KnobValue, resolve

SCHEDULES: dict[str, ModuleType] = {"llvm": cpu, "cuda": cuda}


def for_target(target: Target, spec: AttentionSpec | None = None) -> ModuleType:
    """The schedule module for ``target``; kernels returning an intermediate stage get `generic`."""
    if spec is not None and spec.output != "attn" and target.kind.name in SCHEDULES:
        return generic
    try:
        return SCHEDULES[target.kind.name]
    except KeyError:
        raise TvmAttnError(f"no schedule for target kind {target.kind.name!r}: "
                           f"tvmattn schedules {sorted(SCHEDULES)}") from None


def default_schedule(func: PrimFunc, spec: AttentionSpec, target: Target,
                     knobs: Mapping[str, KnobValue] | None = None) -> tuple[Schedule, str]:
    """The target's schedule of ``func`` with default knobs (overridden by ``knobs``), and what it is."""
    rules = for_target(target, spec)
    values = resolve(rules.KNOBS, {**default_knobs(spec, target), **(knobs or {})})
    if hasattr(rules, "workload"):
        func = rules.workload(spec, values)
    return rules.apply(Schedule(func), spec, target, values), rules.describe(spec, target, values)


def default_knobs(spec: AttentionSpec, target: Target) -> dict[str, KnobValue]:
    """The knob values the default build uses for ``spec`` on ``target``."""
    rules = for_target(target, spec)
    values = {k.name: k.default for k in rules.KNOBS}
    if hasattr(rules, "defaults"):
        values.update(rules.defaults(spec, target))
    return values
