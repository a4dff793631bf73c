"""spec → tensor expression → schedule → tvmattn passes → tvm.compile → CompiledAttention."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import tvm
from tvm import relax
from tvm.target import Target

from tvmattn import schedules
from tvmattn.compiler import openmp, passes
from tvmattn.compiler.annotations import OP_PATTERN, OPAQUE
from tvmattn.compiler.cuda.pipeline import compile_cuda, lower_cuda
from tvmattn.compiler.errors import TvmAttnError, tvm_reason
from tvmattn.compiler.flash import FlashTiles, flash_attention
from tvmattn.compiler.kernel import CompiledAttention
from tvmattn.compiler.layer import layer_around
from tvmattn.compiler.logs import tvm_logs_to_logging
from tvmattn.compiler.paged import CompiledPaged, PagedSpec
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import host_target, is_cpu, isa_of, resolve_target
from tvmattn.compiler.te_attention import attention_te
from tvmattn.compiler.tuning.lookup import tuned_knobs, tuned_schedule
from tvmattn.schedules.cpu.paged_decode import buffer_kernel, paged_kernel
from tvmattn.schedules.cpu.paged_decode import plan_of as paged_plan_of
from tvmattn.schedules.cpu.plan import padded_widths
from tvmattn.schedules.cuda import schedule_paged as cuda_schedule_paged
from tvmattn.schedules.micro_kernels import PADDED_ROW_BLOCK
from tvmattn.schedules.ops import ScheduleFunctions, before_legalize
from tvmattn.schedules.ops.precision import matmuls_in


def compile_attention(spec: AttentionSpec | PagedSpec, target: Any = "cpu", *, arch: str | None = None,
                      mcpu: str | None = None, knobs: Mapping[str, int] | None = None,
                      log_dirs: Sequence[str | Path] = (), tuned: bool = True,
                      thread_pool: str = "tvm") -> CompiledAttention:
    """``tvmattn.compile``: build the attention of ``spec`` for ``target`` (``"cpu"``, ``"cuda"``, ``"aarch64"``
    or ``"riscv64"`` with the CPU ``mcpu`` (`cross.cpus`), a dict or a Target). A `paged.PagedSpec`
    (attention over a paged KV cache) builds its kernel (`paged.CompiledPaged`): the CPU's, or on
    CUDA the flash template reading K/V through the block table (a fixed ``q_len``).

    Without ``knobs`` the best tuning record for this workload is used (``log_dirs`` are searched
    before the user's and the shipped logs; ``tuned=False`` ignores them all). ``thread_pool``
    (CPU): ``"tvm"``, TVM's own, or ``"openmp"``, the process's OpenMP threads (torch's; the kernel
    then runs in this process only: `compiler.openmp`).
    """
    tgt = resolve_target(target, arch, mcpu)
    if thread_pool not in THREAD_POOLS or (thread_pool == "openmp" and not is_cpu(tgt)):
        raise TvmAttnError(f"thread_pool={thread_pool!r}: use 'tvm', or 'openmp' for a CPU target")
    if isinstance(spec, PagedSpec):  # its own kernel, written as TIR (no tuning: no knobs)
        with tvm_logs_to_logging():
            return compile_paged(spec, tgt, thread_pool)
    start = time.perf_counter()
    with tvm_logs_to_logging():
        mod, how = schedule_attention(spec, tgt, knobs, log_dirs=log_dirs, tuned=tuned)
        executable = build_module(mod, spec, tgt, thread_pool)
    if thread_pool == "openmp":
        how += "; parallel loops on this process's OpenMP threads"
    return CompiledAttention(spec, tgt, executable, how, time.perf_counter() - start, mod, thread_pool)


def head_widths(spec: AttentionSpec, target: Target) -> AttentionSpec | None:
    """``spec`` with its head widths padded for the tiles or dot products, for a front end that can pad q, k
    and v (`schedules.cpu.plan.padded_widths`); None where the kernel is better as it is, or off the CPU."""
    return padded_widths(spec, target) if is_cpu(target) else None


def schedule_attention(spec: AttentionSpec, target: Target, knobs: Mapping[str, int] | None = None, *,
                       log_dirs: Sequence[str | Path] = (), tuned: bool = True) -> tuple[tvm.IRModule, str]:
    """The scheduled PrimFunc of ``spec`` (in an IRModule, as ``main``) and how it was scheduled.

    This is what `compile_attention` builds; other front ends (ONNX import) embed it in larger modules. Given
    ``knobs`` win; otherwise a tuning record (`tvmattn.compiler.tuning.lookup`), else the default schedule.
    """
    spec.validate()
    why = ""
    if knobs is None and tuned:
        sch, why = tuned_schedule(spec, target, log_dirs)
        if sch is not None:
            return lowering_passes(spec, target)(sch.mod), why
    sch, how = schedules.schedule(spec, target, knobs)
    how = f"default schedule ({how})"
    return lowering_passes(spec, target)(sch.mod), f"{how}: {why}" if why else how


def lowering_passes(spec: AttentionSpec, target: Target) -> tvm.transform.Pass:
    """The passes the schedule rule of ``spec`` declares (`AttentionRule.passes`), run on the scheduled
    module before TVM's pipeline."""
    return tvm.transform.Sequential(schedules.rule_for(spec, target).passes(spec, target))


def lower(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """The TIR that code generation would see (flat loops and allocations): for inspection."""
    if target.kind.name == "cuda":
        return lower_cuda(mod, target)
    bound = target if target.host is not None else target.with_host(target)
    mod = tvm.tirx.transform.BindTarget(bound)(mod)
    return (_cpu_pipeline() if is_cpu(target) else tvm.tirx.get_default_tir_pipeline(target))[0](mod)


def _cpu_pipeline(thread_pool: str = "tvm"):
    """`passes.element_aligned_arguments` (every CPU kernel takes arrays at any element offset), TVM's
    default TIR pipeline, then `passes.tighten_guarded_loops` (it must follow buffer compaction),
    `passes.vector_exp2` and `passes.narrow_bf16` (they read the vectors), `passes.stack_tiles` (final
    allocations) and, after MakePackedAPI, the thread pool's pass:
    `passes.one_parallel_launch` for TVM's, or `openmp.install_pass` for ``thread_pool="openmp"``."""
    pipeline, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("default")
    pool = openmp.install_pass() if thread_pool == "openmp" else passes.one_parallel_launch()
    seq = [passes.element_aligned_arguments(), pipeline, passes.tighten_guarded_loops(), passes.vector_exp2(),
           passes.narrow_bf16(),
           passes.interleave_tile_epilogues(), passes.stack_tiles(), pool]
    return tvm.transform.Sequential(seq), finalize_host, finalize_device


THREAD_POOLS = {"tvm": "tvmattn-cpu", "openmp": "tvmattn-cpu-openmp"}  # the CPU TIR pipeline of each
for _pool, _name in THREAD_POOLS.items():
    tvm.tirx.register_tir_pipeline(_name, functools.partial(_cpu_pipeline, _pool))
CPU_PIPELINE = THREAD_POOLS["tvm"]


def tvm_compile(mod: tvm.IRModule, target: Target, thread_pool: str = "tvm") -> tvm.runtime.Executable:
    """`tvm.compile`, with tvmattn's TIR pipelines (CUDA: `compiler.cuda.pipeline`; CPU: `_cpu_pipeline`
    for ``thread_pool``): for kernels and models."""
    if target.kind.name == "cuda":
        return compile_cuda(mod, target)
    return tvm.compile(mod, target, tir_pipeline=THREAD_POOLS[thread_pool] if is_cpu(target) else "default")


@tvm.transform.module_pass(opt_level=0, name="tvmattn.ProducersUnfused")
def _producers_unfused(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """PrimFuncs that read no tensor and write one of symbolic size (an arange over a sequence
    length), kept out of fused groups: FuseTIR fails on a group that passes their sizes to them
    (TVM 0.27, "VarRemapGet(source) == nullptr")."""
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        buffers = [p for p in func.params if isinstance(p.ty, tvm.tirx.BufferType)]
        if len(buffers) == 1 and any(not isinstance(d, tvm.tirx.IntImm) for d in buffers[0].shape):
            mod[gv] = func.with_attr(OP_PATTERN, OPAQUE)
    return mod


def compile_model(mod: tvm.IRModule, target: Target,
                  dtype: str | None = None) -> tuple[tvm.runtime.Executable, ScheduleFunctions | None]:
    """A Relax module (an imported model) compiled for ``target``, and on the CPU what scheduled its
    PrimFuncs (``rule_of``: function name → rule; ``tuned_functions``: those built from a tuning
    record; ``work``: their FLOPs as a function of their shapes). CPU: Relax's CPU pipeline with
    `schedules.ops` after operator fusion (TVM's schedules none); CUDA: Relax's, which applies dlight's
    GPU rules. ``dtype`` ("bfloat16", "float16"): the constant-weight matmuls in that precision
    (`schedules.ops.precision`)."""
    if is_cpu(target):
        from tvm.relax.backend.cpu_generic import pipeline as backend

        scheduler = ScheduleFunctions(target, tuned_knobs(target))
        after_fusion = [scheduler]
    else:
        from tvm.relax.backend.cuda import pipeline as backend

        after_fusion = []

    @tvm.transform.module_pass(opt_level=0, name="tvmattn.RelaxModelPipeline")
    def pipeline(m: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(
                until_scheduling(target, dtype) + after_fusion
                + backend.dataflow_lower_passes(target) + backend.finalize_passes(target))(m)

    if not is_cpu(target):
        return compile_cuda(mod, target, relax_pipeline=pipeline), None
    executable = tvm.compile(mod, target, relax_pipeline=pipeline, tir_pipeline=CPU_PIPELINE)
    return executable, scheduler


def until_scheduling(target: Target, dtype: str | None = None) -> list[tvm.transform.Pass]:
    """Relax's passes up to the fused PrimFuncs the schedule rules take. CPU: convolutions and x**2
    rewritten first (`schedules.ops.before_legalize`), then the matmuls in ``dtype`` where given; a
    call the graph repeats on the same arguments made once; a reshape kept a view (legalised, one of a
    symbolic flattening was a copy). Both keep symbolic-size producers unfused (`_producers_unfused`)."""
    if is_cpu(target):
        from tvm.relax.backend.cpu_generic import pipeline as backend
    else:
        from tvm.relax.backend.cuda import pipeline as backend
    legalize = backend.legalize_passes(target)
    if is_cpu(target):
        legalize = [relax.transform.LegalizeOps(skip_ops=["relax.reshape"]) if p.info.name == "LegalizeOps" else p
                    for p in legalize]
    fuse = [p.info.name for p in legalize].index("FuseOps")
    legalize = legalize[:fuse] + [_producers_unfused] + legalize[fuse:]
    isa = isa_of(target) if is_cpu(target) else None
    dot = isa.dot if isa is not None else None
    # the rows a bf16 GEMM pads to (AMX's blocks, the dot product's register tiles; none widened to fp32)
    row_block = None if dot is None or dtype != "bfloat16" else isa.tiles.block if isa.tiles else PADDED_ROW_BLOCK
    rewrites = before_legalize(dtype, row_block, isa) if is_cpu(target) else []
    if dtype is not None:
        rewrites.append(matmuls_in(dtype, *((dot.lanes, isa.tiles) if dot is not None else ())))
    # an exporter repeats a computation per layer (T5's position bias plus mask, in every attention)
    dedup = [relax.transform.EliminateCommonSubexpr(call_only=True)]
    return backend.library_dispatch_passes(target) + rewrites + dedup + legalize


def build_module(mod: tvm.IRModule, spec: AttentionSpec, target: Target,
                 thread_pool: str = "tvm") -> tvm.runtime.Executable:
    """TVM's lowering and code generation of a scheduled module."""
    try:
        return tvm_compile(mod, target, thread_pool)
    except Exception as err:  # a TVM failure here is our bug, but the user gets a sentence first
        raise TvmAttnError(f"TVM could not build this kernel for {target.kind.name} "
                           f"({spec.describe()}): {tvm_reason(err)}") from err


def build_serial(spec: AttentionSpec | PagedSpec, tiles: FlashTiles) -> CompiledAttention:
    """The online-softmax template compiled unscheduled for this CPU: the CUDA kernel's numerics,
    runnable here (a full layer: inside the tensor expression's projections, as on CUDA; a paged
    cache: K and V through its block table, called as `paged.CompiledPaged`)."""
    start = time.perf_counter()
    target = host_target()
    if isinstance(spec, PagedSpec):
        mod = tvm.IRModule({"main": flash_attention(spec.attention, tiles, paged=spec)})
        return CompiledPaged(spec, target, tvm_compile(mod, target), f"flash template, serial ({tiles})",
                             time.perf_counter() - start, mod)
    if spec.projections:
        expr = attention_te(spec)
        func = layer_around(spec, expr, flash_attention(spec, tiles, packed=True, dims=expr.dims))
    else:
        func = flash_attention(spec, tiles)
    executable = tvm_compile(tvm.IRModule({"main": func}), target)
    return CompiledAttention(spec, target, executable, f"flash template, serial ({tiles})",
                             time.perf_counter() - start)


def compile_paged(spec: PagedSpec, target: Any, thread_pool: str = "tvm") -> "CompiledPaged":
    """``tvmattn.compile`` of a `PagedSpec`: the CPU paged kernels (`schedules.cpu.paged_decode`), or the
    CUDA one (`schedules.cuda.schedule_paged`)."""
    cuda = target.kind.name == "cuda"
    if not (is_cpu(target) or (cuda and not spec.ragged)):
        raise TvmAttnError(f"a paged KV cache has CPU kernels, and a CUDA one for a fixed q_len: compile "
                           f"{spec.describe()} for 'cpu'" + ("" if not cuda else " (ragged queries)"))
    start = time.perf_counter()
    mod, how = cuda_schedule_paged(spec, target) if cuda else schedule_paged(spec, target)
    try:
        executable = compile_cuda(mod, target) if cuda else tvm_compile(mod, target, thread_pool)
    except Exception as err:  # our bug, but the user gets a sentence first
        raise TvmAttnError(f"TVM could not build the paged kernel ({spec.describe()}): {tvm_reason(err)}") from err
    return CompiledPaged(spec, target, executable, how, time.perf_counter() - start, mod, thread_pool)


def schedule_paged(spec: PagedSpec, target: Target, rows: int | None = None) -> tuple[tvm.IRModule, str]:
    """The paged kernel of ``spec`` for a CPU ``target`` ("main", its TIR written by the plan) and how;
    with ``rows``, its decode kernel over contiguous (B, h_kv, rows, d) buffers (`buffer_kernel`)."""
    plan = paged_plan_of(spec, target)
    func = paged_kernel(plan) if rows is None else buffer_kernel(plan, rows)
    how = plan.describe() + ("" if rows is None else f", over ({rows}-row buffers read as pages)")
    return passes.polynomial_math()(tvm.IRModule({"main": func})), how  # (softcap's tanh: a polynomial)
