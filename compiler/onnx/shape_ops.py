"""Converters for the shape plumbing exporters emit, where TVM 0.27's stock ones fail on symbolic sizes.

Each returns None to let TVM's own converter handle the node (every case it already gets right).

Expand   a constant target shape on data with symbolic dimensions (TorchScript's
         ``mask.expand(bsz, heads, -1, -1)``): the stock converter reads every data dimension as a number.
Reshape  a scalar of shape arithmetic (``batch * heads`` from Shape → Squeeze → Mul, as the dynamo
         exporter writes it) reshaped to one element: the stock converter wants a tensor; a
         one-element shape is what the following Concat builds a shape from.
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax, tirx

ShapeFix = Callable[[list], relax.Expr | None]


def expand(inputs: list) -> relax.Expr | None:
    data, shape = inputs[0], inputs[1]
    if not isinstance(shape, tvm.ir.GenericConst) or not isinstance(data.ty, relax.TensorType):
        return None
    dims = list(data.ty.shape.values) if isinstance(data.ty.shape, relax.ShapeExpr) else None
    if dims is None or all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    target = [int(t) for t in shape.value.numpy().tolist()]
    rank = max(len(target), len(dims))
    dims = [tirx.IntImm("int64", 1)] * (rank - len(dims)) + dims
    target = [1] * (rank - len(target)) + target
    # ONNX broadcasting: a target 1 (or torch's -1) keeps the data's size, a data 1 takes the target's
    out = [d if t in (1, -1) else tirx.IntImm("int64", t) for d, t in zip(dims, target)]
    return relax.op.broadcast_to(data, relax.ShapeExpr(out))


def reshape(inputs: list) -> relax.Expr | None:
    data, shape = inputs[0], inputs[1]
    if not isinstance(data.ty, tvm.ir.PrimType) or not isinstance(shape, tvm.ir.GenericConst):
        return None
    if shape.value.numpy().size != 1 or "int" not in str(data.ty):
        return None
    return relax.ShapeExpr([data])  # in TVM 0.27 a Relax scalar of shape arithmetic is the PrimExpr itself


SHAPE_FIXES: dict[str, ShapeFix] = {"Expand": expand, "Reshape": reshape}
