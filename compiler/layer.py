"""A full attention layer as one PrimFunc around a separately built core: the projections, then the
core, then W_O.

    x ─W_Q─► q_proj (B, n, h·d_k) ─┐
    x_kv ─W_K, W_V─► k_proj, v_proj ┼─► core (heads packed) ─► merged (B, n, h·d_v) ─W_O─► out

The four GEMMs are the tensor expression's own stages (each its own PrimFunc, scheduled by the
caller's ``gemm``); the core reads the projections' (B, n, h·d) output as packed heads and writes
merged heads, so the head split and merge cost no pass over memory. The intermediates are
q_proj, k_proj, v_proj and merged.
"""

from __future__ import annotations

from typing import Callable

import tvm_ffi
from tvm import te, tirx
from tvm.s_tir import SBlock, SBlockRealize

from tvmattn.compiler import arguments
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.te_attention import AttentionTE, linear


def layer_around(spec: AttentionSpec, expr: AttentionTE, core: tirx.PrimFunc,
                 gemm: Callable[[tirx.PrimFunc], tirx.PrimFunc] = lambda f: f) -> tirx.PrimFunc:
    """The layer of ``spec`` around ``core`` (``main(q, k, v, *extras, o)`` over packed heads whose
    symbolic sizes are ``expr``'s), in the calling convention of ``spec``; ``gemm`` schedules each
    projection's PrimFunc."""
    stages, inputs = expr.stages, {t.op.name: t for t in expr.inputs}
    x_kv = inputs.get("x_kv", inputs["x"])
    merged = te.placeholder(stages["merged"].shape, spec.dtype, "merged")
    gemms = [([inputs["x"], inputs["w_q"]], stages["q_proj"]), ([x_kv, inputs["w_k"]], stages["k_proj"]),
             ([x_kv, inputs["w_v"]], stages["v_proj"])]
    gemms.append(([merged, inputs["w_o"]], linear(merged, inputs["w_o"], "out")))

    buffers = {t.op.name: tirx.decl_buffer(t.shape, t.dtype, t.op.name) for t in expr.inputs}
    for name in ("q_proj", "k_proj", "v_proj", "merged"):
        buffers[name] = tirx.decl_buffer(stages[name].shape, spec.dtype, name)
    buffers["out"] = tirx.decl_buffer(stages["out"].shape, spec.dtype, "out")

    bodies = [_bind(gemm(_prim_func(args + [y])), [t.op.name for t in args] + [y.op.name], buffers)
              for args, y in gemms[:3]]
    core_args = ["q_proj", "k_proj", "v_proj", *(a.name for a in arguments.extras(spec)), "merged"]
    bodies.append(_bind(core, core_args, buffers))
    args, y = gemms[3]
    bodies.append(_bind(gemm(_prim_func(args + [y])), ["merged", "w_o", "out"], buffers))

    params = [buffers[name] for name in spec.input_shapes()] + [buffers["out"]]
    intermediates = [buffers[name] for name in ("q_proj", "k_proj", "v_proj", "merged")]
    root = SBlock([], [], [], "root", tirx.SeqStmt(bodies), alloc_buffers=intermediates)
    return tirx.PrimFunc(params, SBlockRealize([], True, root)).with_attr("global_symbol", "main")


def _prim_func(tensors: list[te.Tensor]) -> tirx.PrimFunc:
    return te.create_prim_func(tensors).with_attr("global_symbol", "main")


def _bind(func: tirx.PrimFunc, names: list[str], buffers: dict) -> tirx.Stmt:
    """The body of ``func`` with its parameters, in order, replaced by the layer's buffers ``names``."""
    pairs = [(param, buffers[name]) for param, name in zip(func.params, names)]

    def on_var(var: tirx.Var) -> tirx.Var:
        return next((new for old, new in pairs if old.same_as(var)), var)

    return tvm_ffi.structural_map(func.body, [(tirx.Var, on_var)])
