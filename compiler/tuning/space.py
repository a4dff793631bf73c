"""The attention-aware design space: the grid of a schedule's declared knobs (``schedules/*.KNOBS``).

A point is one choice per knob, in declaration order. The same declaration gives MetaSchedule its
`ScheduleFn` design space (each knob a ``sample_categorical``), and gives the search its grid: the
search rebuilds every candidate from knob values exactly as `tvmattn.compile` does, rather than
replaying a trace with one decision changed, because the schedule reads some knob values when it
lays out buffers and a replayed trace would keep the layout of the old decision.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
from dataclasses import dataclass
from typing import Mapping

import tvm
from tvm.s_tir import Schedule
from tvm.s_tir.meta_schedule.space_generator import ScheduleFn
from tvm.target import Target
from tvm.tirx import PrimFunc

from tvmattn import schedules
from tvmattn.compiler.annotations import SPEC
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.schedules.knobs import Knob, sample

Point = tuple[int, ...]
SPEC_ATTR = SPEC  # the workload's AttentionSpec (JSON), for the build workers


@dataclass(frozen=True)
class KnobSpace:
    knobs: tuple[Knob, ...]

    @property
    def size(self) -> int:
        return math.prod(len(k.choices) for k in self.knobs)

    def default(self) -> Point:
        return tuple(k.default for k in self.knobs)

    def values(self, point: Point) -> dict[str, int]:
        return {k.name: v for k, v in zip(self.knobs, point)}

    def point(self, values: Mapping[str, int]) -> Point | None:
        """The point of stored knob values, None when they do not fit this space any more."""
        if set(values) != {k.name for k in self.knobs}:
            return None
        point = tuple(values[k.name] for k in self.knobs)
        return point if all(v in k.choices for k, v in zip(self.knobs, point)) else None

    def random(self, rng: random.Random) -> Point:
        return tuple(rng.choice(k.choices) for k in self.knobs)

    def neighbours(self, point: Point) -> list[Point]:
        """Points that move one knob to an adjacent choice: where a good point's betters usually are."""
        out = []
        for i, (knob, value) in enumerate(zip(self.knobs, point)):
            j = knob.choices.index(value)
            for step in (-1, 1):
                if 0 <= j + step < len(knob.choices):
                    out.append(point[:i] + (knob.choices[j + step],) + point[i + 1:])
        return out


def relevant(space: KnobSpace, schedule_hash) -> KnobSpace:
    """``space`` without choices that build the same kernel as another choice of the same knob, each
    tried with the other knobs at their defaults (``schedule_hash(point)``: a hash of the scheduled
    TIR, None if it does not schedule). A core kernel has no projection tiles to choose; a decode
    step's one query leaves no query tile to choose. Interactions between knobs are left to the
    search, which also skips candidates whose TIR it has measured."""
    base = space.default()
    knobs = []
    for i, knob in enumerate(space.knobs):
        kept: dict[object, int] = {}
        for choice in (knob.default, *knob.choices):  # the default represents its class
            digest = schedule_hash(base[:i] + (choice,) + base[i + 1:])
            if digest is not None:
                kept.setdefault(digest, choice)
        knobs.append(dataclasses.replace(knob, choices=tuple(c for c in knob.choices if c in kept.values())))
    return KnobSpace(tuple(knobs))


def workload(spec: AttentionSpec, target: Target) -> PrimFunc:
    """The function the rule for a concrete spec schedules (default knobs), carrying the spec for the
    build workers' tvmattn passes."""
    rule = schedules.rule_for(spec, target)
    func = rule.workload(spec, target, schedules.default_knobs(spec, target))
    return func.with_attr(SPEC_ATTR, json.dumps(spec.to_dict()))


def spec_of(mod: tvm.IRModule) -> AttentionSpec:
    (func,) = mod.functions.values()
    return AttentionSpec.from_dict(json.loads(str(func.attrs[SPEC_ATTR])))


def candidate(func: PrimFunc, spec: AttentionSpec, target: Target, values: Mapping[str, int]) -> Schedule:
    """The schedule `tvmattn.compile` builds for these knob values (carrying ``func``'s spec attribute
    also where the schedule replaced the function: the CUDA template, a full layer)."""
    sch = schedules.schedule(spec, target, values)[0]
    main = sch.mod["main"]
    if SPEC_ATTR in func.attrs and SPEC_ATTR not in main.attrs:
        sch = Schedule(main.with_attr(SPEC_ATTR, func.attrs[SPEC_ATTR]))
    return sch


def design_space(spec: AttentionSpec, target: Target) -> ScheduleFn:
    """MetaSchedule's view of the same space: every knob sampled, nothing else (no generic rules or
    postprocessors: the schedule is complete)."""
    return ScheduleFn(functools.partial(_sampled, spec, target), sch_rules=[], postprocs=[], mutator_probs={})


def _sampled(spec: AttentionSpec, target: Target, sch: Schedule) -> Schedule:
    """A sampled schedule (``sch``, scheduled in place), handed to MetaSchedule as its module with a
    trace of its own: TVM 0.27's ``Trace.simplified``, which the task scheduler applies to every design
    space it logs, drops the ``get_sblock`` of a block that only a ``cache_read``'s consumer list reads
    (a 16-bit x widened once for some projections, a packed mask), and printing the trace then fails;
    `KnobSearch` rebuilds every candidate from knob values, so the trace is never replayed. A schedule
    of its own template (CUDA) is its default instead: some knobs shape the template and others must
    fit them (warps and q_rows), so `KnobSearch` enumerates that grid itself and MetaSchedule only
    needs one valid design space."""
    rule = schedules.rule_for(spec, target)
    if any(k.shapes_workload for k in rule.KNOBS):
        return schedules.schedule(spec, target)[0]
    return Schedule(rule.apply(sch, spec, target, sample(sch, rule.KNOBS)).mod)
