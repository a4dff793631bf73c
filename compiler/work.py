"""What a compiled function computes, as a function of its arguments' shapes: the FLOPs a profile
divides by its time (`compiler.onnx.profile`).

`tir_work`: two FLOPs per multiply-add of each reduction block whose body multiplies two different
operands (a GEMM, a batched matmul, a convolution; not a variance's x·x), its iteration extents in
terms of the parameters' size variables.
`attention_work`: an attention kernel's useful FLOPs as FlashAttention counts them
(`explain.useful_flops`: only the (query, key) pairs a query may see).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import SBlock

from tvmattn.compiler.explain import useful_flops
from tvmattn.compiler.passes import substitute
from tvmattn.compiler.spec import AttentionSpec


@dataclass(frozen=True)
class TirWork:
    shapes: tuple  # each tensor parameter's shape: ints and size variables
    macs: tuple  # int64 PrimExprs: each product reduction's multiply-adds

    def flops(self, shapes: list[tuple[int, ...]]) -> float:
        binding = {w: g for want, got in zip(self.shapes, shapes) for w, g in zip(want, got)
                   if isinstance(w, tirx.Var)}
        analyzer = tvm.sym.Analyzer()
        total = 0.0
        for expr in self.macs:
            value = analyzer.simplify(substitute(expr, {v: tirx.IntImm(v.ty.dtype, g) for v, g in binding.items()}))
            total += 2.0 * int(value) if isinstance(value, tirx.IntImm) else 0.0
        return total


@dataclass(frozen=True)
class AttentionWork:
    spec: AttentionSpec

    def flops(self, shapes: list[tuple[int, ...]]) -> float:
        sizes = {w: g for want, got in zip(self.spec.input_shapes().values(), shapes) for w, g in zip(want, got)
                 if isinstance(w, str)}
        return float(useful_flops(self.spec, sizes))


def tir_work(func: tirx.PrimFunc) -> TirWork | None:
    """The multiply-adds of ``func``'s product reductions; None where it has none."""
    macs = []

    def visit(node) -> None:
        if isinstance(node.body, tirx.BufferStore) \
                and any(iv.iter_type == tirx.IterVar.CommReduce for iv in node.iter_vars) \
                and _multiplies(node.body):
            extent = tirx.IntImm("int64", 1)
            for iv in node.iter_vars:
                extent = extent * tirx.Cast("int64", iv.dom.extent)
            macs.append(extent)

    tvm_ffi.structural_walk(func.body, [(SBlock, visit)])
    if not macs:
        return None
    return TirWork(tuple(tuple(p.ty.shape) for p in func.params if hasattr(p.ty, "shape")), tuple(macs))


def _multiplies(store: tirx.BufferStore) -> bool:
    """A product of two different operands (a variance's x·x is no matrix product's work)."""
    found = []
    tvm_ffi.structural_walk(store.value, [(tirx.Mul, lambda n: found.append(n))])
    return any(not tvm_ffi.structural_equal(m.a, m.b) for m in found)
