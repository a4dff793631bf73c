"""CUDA schedule: TVM's default GPU rules (`tvm.s_tir.dlight`), one thread-bound loop nest per stage."""

from __future__ import annotations

from typing import Mapping

from tvm.s_tir import Schedule
from tvm.s_tir import dlight
from tvm.target import Target

from tvmattn.compiler.spec import AttentionSpec

from .knobs import Knob, KnobValue

KNOBS: tuple[Knob, ...] = ()


def describe(spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue]) -> str:
    return "dlight fallback rules"


def apply(sch: Schedule, spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue]) -> Schedule:
    with target:
        scheduled = dlight.gpu.Fallback().apply(sch.mod["main"], target, False)
    return scheduled
