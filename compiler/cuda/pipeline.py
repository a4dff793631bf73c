"""TVM's TIR lowering for CUDA, plus what the attention kernels need on top of it.

* cp.async: the software-pipelined K/V loads become asynchronous copies (``tirx.use_async_copy``).
* No StorageRewrite: inside a pipeline epilogue it gives an fp32 wmma store the storage of an fp16
  shared buffer but keeps the store's pointer typed fp32, which LowerIntrin rejects. shared.dyn
  buffers are still packed by liveness (MergeSharedMemoryAllocations); registers are nvcc's job.
* Constant async waits: the loop over key tiles has a trip count that depends on the thread block
  (causal and window masks skip tiles). TVM's pipeliner then emits ``cp.async.wait_group`` counts as
  conditions on the loop variable that its analyzer cannot prove, because it binds the loop to the
  unsimplified extent ``E + 1 - 1`` and joins conditions with a bitwise ``&`` it does not fold; CUDA
  needs a constant. `constant_async_waits` proves them again with simplified extents. A count it
  still cannot prove is left for codegen to reject.
* ``tirx.fma``: TVM 0.27 lowers it for LLVM only (the logit rule in `variant` rounds its scale
  product with one, against the CPU compiler's contraction); for CUDA it becomes a multiply-add
  before lowering, the arithmetic FlashAttention's kernels do.
"""

from __future__ import annotations

from typing import Any

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Call
from tvm.sym import Analyzer
from tvm.target import Target
from tvm.tirx import AttrStmt, For

PIPELINE = "tvmattn_cuda"
_FMA = tvm.ir.Op.get("tirx.fma")


def plain_fma() -> tvm.transform.Pass:
    """fma(a, b, c) → a·b + c: TVM 0.27's CUDA code generation has no fma (see the module docstring)."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.PlainFma")
    def transform(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
        def on_call(call):
            if call.op.same_as(_FMA):
                a, b, c = call.args
                return a * b + c
            return call

        return tvm_ffi.structural_map(func, [(Call, on_call)])

    return transform
_WAIT_COUNT = "async_wait_inflight_count"


def constant_async_waits() -> tvm.transform.Pass:
    """Fold every async wait count to the constant it is under the bounds of its enclosing loops."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.ConstantAsyncWaits")
    def transform(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
        analyzer = Analyzer()

        def on_for(node: For, visitor) -> None:  # loop variables are unique: bind them all up front
            analyzer.bind(node.loop_var, tvm.ir.Range.from_min_extent(node.min, analyzer.simplify(node.extent)))
            visitor.default_visit(node)

        def on_attr(node: AttrStmt) -> AttrStmt:
            if node.attr_key == _WAIT_COUNT and not isinstance(node.value, tirx.IntImm):
                return AttrStmt(node.node, node.attr_key, analyzer.simplify(_logical(node.value)), node.body)
            return node

        tvm_ffi.structural_visit(func.body, [(For, on_for)])
        return func.with_body(tvm_ffi.structural_map(func.body, [(AttrStmt, on_attr)]))

    return transform


def _logical(expr):
    """The pipeliner joins conditions with bitwise ``&``, which the analyzer does not fold: use And."""
    def on_and(node: tirx.BitwiseAnd):
        return tirx.And(node.a, node.b) if str(node.ty.dtype) == "bool" else node

    return tvm_ffi.structural_map(expr, [(tirx.BitwiseAnd, on_and)])


def _pipeline_factory():
    from tvm.s_tir.pipeline import default_s_tir_pipeline

    lower, finalize_host, finalize_device = default_s_tir_pipeline()
    return tvm.transform.Sequential([plain_fma(), lower, constant_async_waits()]), finalize_host, finalize_device


_CONFIG = {"tirx.use_async_copy": True, "tirx.disable_storage_rewrite": True}


def compile_cuda(mod: tvm.IRModule, target: Target, relax_pipeline: Any = "default") -> tvm.runtime.Executable:
    """`tvm.compile` with the TIR pipeline above (and Relax's, or ``relax_pipeline``, for a Relax module)."""
    with tvm.transform.PassContext(config=_CONFIG):
        return tvm.compile(mod, target, relax_pipeline=relax_pipeline, tir_pipeline=PIPELINE)


def lower_cuda(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """The lowered TIR that `compile_cuda` generates code from: host and device functions (without
    common-subexpression elimination, so that sizes read as expressions of the symbolic lengths)."""
    lower, _, _ = tvm.tirx.get_tir_pipeline(PIPELINE)
    bound = target if target.host is not None else target.with_host({"kind": "llvm"})
    with tvm.transform.PassContext(config={**_CONFIG, "tirx.disable_cse_tir": True}):
        return lower(tvm.tirx.transform.BindTarget(bound)(mod))


tvm.tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline_factory)
