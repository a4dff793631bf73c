"""spec → tensor expression → schedule → tvmattn passes → tvm.compile → CompiledAttention."""

from __future__ import annotations

import time
from typing import Any, Mapping

import tvm
from tvm.target import Target

from tvmattn import schedules

from . import passes
from .errors import TvmAttnError
from .kernel import CompiledAttention
from .spec import AttentionSpec
from .target import is_cpu, resolve_target
from .te_attention import attention_te


def compile(spec: AttentionSpec, target: Any = "cpu", *, arch: str | None = None,
            knobs: Mapping[str, int] | None = None) -> CompiledAttention:  # noqa: A001 (tvm.compile's name)
    """Build the attention of ``spec`` for ``target`` (``"cpu"``, ``"cuda"``, a dict or a Target)."""
    tgt = resolve_target(target, arch)
    start = time.perf_counter()
    mod, how = schedule_attention(spec, tgt, knobs)
    executable = build_module(mod, spec, tgt)
    return CompiledAttention(spec, tgt, executable, how, time.perf_counter() - start)


def schedule_attention(spec: AttentionSpec, target: Target,
                       knobs: Mapping[str, int] | None = None) -> tuple[tvm.IRModule, str]:
    """The scheduled PrimFunc of ``spec`` (in an IRModule, as ``main``) and how it was scheduled.

    This is what `compile` builds; other front ends (ONNX import) embed it in larger modules.
    """
    spec.validate()
    func = attention_te(spec).prim_func()
    sch, how = schedules.default_schedule(func, spec, target, knobs)
    return lowering_passes(spec, target)(sch.mod), f"default schedule ({how})"


def lowering_passes(spec: AttentionSpec, target: Target) -> tvm.transform.Pass:
    """tvmattn's own passes, run on the scheduled module before TVM's pipeline."""
    seq = [passes.skip_masked_key_tiles(spec)]
    if is_cpu(target):
        seq.append(passes.polynomial_exp())
    return tvm.transform.Sequential(seq)


def lower(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """The TIR that code generation would see (flat loops and allocations): for inspection."""
    bound = target if target.host is not None else target.with_host(target)
    mod = tvm.tirx.transform.BindTarget(bound)(mod)
    return tvm.tirx.get_default_tir_pipeline(target)[0](mod)


def build_module(mod: tvm.IRModule, spec: AttentionSpec, target: Target) -> tvm.runtime.Executable:
    """TVM's lowering and code generation of a scheduled module."""
    try:
        return tvm.compile(mod, target)
    except Exception as err:  # a TVM failure here is our bug, but the user gets a sentence first
        raise TvmAttnError(f"TVM could not build this kernel for {target.kind.name} "
                           f"({spec.describe()}): {str(err).strip().splitlines()[-1]}") from err
