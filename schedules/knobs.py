"""Schedule knobs, declared once: the default schedule reads their defaults, tuning samples their choices.

A schedule function takes ``knobs``: a mapping from knob name to a value, which is either a plain int
(the default schedule, a user override) or a MetaSchedule random variable made by `sample` (tuning).
Knobs are split factors only, so both kinds of value go straight into ``sch.split``.

A knob with ``shapes_workload`` changes the PrimFunc that is scheduled, not only its schedule (the
tile shapes of the CUDA online-softmax template): it is always a plain int, `sample` leaves it out,
and a tuner enumerates its choices as separate workloads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

from tvm.ir.expr import Expr as PrimExpr
from tvm.s_tir import Schedule

from tvmattn.compiler.errors import TvmAttnError

KnobValue = Union[int, PrimExpr]


@dataclass(frozen=True)
class Knob:
    name: str
    choices: tuple[int, ...]
    default: int
    doc: str
    shapes_workload: bool = False


def resolve(space: tuple[Knob, ...], given: Mapping[str, KnobValue] | None) -> dict[str, KnobValue]:
    """The defaults of ``space`` overridden by ``given``; unknown names and off-list values are errors."""
    known = {k.name: k for k in space}
    out: dict[str, KnobValue] = {k.name: k.default for k in space}
    for name, value in (given or {}).items():
        if name not in known:
            raise TvmAttnError(f"unknown schedule knob {name!r}: this target's knobs are {sorted(known)}")
        if isinstance(value, int) and value not in known[name].choices:
            raise TvmAttnError(f"knob {name}={value} is not one of {list(known[name].choices)}")
        out[name] = value
    return out


def sample(sch: Schedule, space: tuple[Knob, ...]) -> dict[str, KnobValue]:
    """One random variable per knob, uniform over its choices (MetaSchedule's design space); knobs that
    shape the workload are not sampled."""
    return {k.name: sch.sample_categorical(list(k.choices), [1.0 / len(k.choices)] * len(k.choices))
            for k in space if not k.shapes_workload}
