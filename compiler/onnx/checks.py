"""The run-time checks ONNX Runtime makes and TVM's converters leave out.

Gather   TVM's ``take`` reads out of bounds for an index outside [-extent, extent) (its fast mode:
         a token id past the vocabulary, a position past BERT's table segfaults or returns garbage).
         Indices that are constants are checked here; the others go through a small TIR function
         that asserts the range (naming the node) and maps negative indices, before the take. The
         check is a serial CPU loop: the importer asks for it on CPU targets.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx.kernels import OPAQUE


def gather(bb: relax.BlockBuilder, node: str, inputs: list, attrs: dict) -> relax.Expr | None:
    """A bounds-checked ONNX Gather, or None where TVM's converter is right as it is (constants folded,
    shape values, a symbolic axis extent)."""
    data, indices = inputs[0], inputs[1]
    if not isinstance(data.ty, relax.TensorType) or not isinstance(data.ty.shape, relax.ShapeExpr):
        return None
    dims = list(data.ty.shape.values)
    axis = int(attrs.get("axis", 0))
    if not -len(dims) <= axis < len(dims):
        raise TvmAttnError(f"axis={axis} is out of range for data of rank {len(dims)}")
    axis %= len(dims)
    if not isinstance(dims[axis], tirx.IntImm):
        return None
    extent = int(dims[axis].value)
    if isinstance(indices, tvm.ir.GenericConst):
        values = indices.value.numpy()
        if values.size and (values.min() < -extent or values.max() >= extent):
            bad = values[(values < -extent) | (values >= extent)].reshape(-1)[0]
            raise TvmAttnError(f"index {bad} is out of range: axis {axis} has {extent} entries, so indices lie "
                               f"in [{-extent}, {extent - 1}]")
        if isinstance(data, tvm.ir.GenericConst):
            return None  # TVM's converter folds it
        return relax.op.take(data, relax.const(np.where(values < 0, values + extent, values)), axis, mode="clip")
    if (not isinstance(indices.ty, relax.TensorType) or not isinstance(indices.ty.shape, relax.ShapeExpr)
            or str(indices.ty.dtype) not in ("int32", "int64")):
        return None
    flat = bb.normalize(relax.op.reshape(indices, [-1]))
    checker = bb.add_func(_checked_indices(str(indices.ty.dtype), extent, node), "check_gather_indices")
    checked = bb.normalize(relax.call_tir(checker, [flat], relax.TensorType(flat.ty.shape, indices.ty.dtype)))
    # in range now: "clip" reads the same elements as TVM's unchecked "fast" mode (and does not warn)
    return relax.op.take(data, bb.normalize(relax.op.reshape(checked, indices.ty.shape)), axis, mode="clip")


def _checked_indices(dtype: str, extent: int, node: str) -> tirx.PrimFunc:
    """out[i] = idx[i] (+ extent if negative), asserting -extent <= idx[i] < extent."""
    message = (f"node {node!r} (Gather): an index is out of range: the gathered axis has {extent} entries, so "
               f"indices lie in [{-extent}, {extent - 1}]")

    @T.prim_func(private=True, s_tir=True)
    def check(idx_h: T.handle, out_h: T.handle):
        n = T.int64()
        idx = T.match_buffer(idx_h, (n,), dtype)
        out = T.match_buffer(out_h, (n,), dtype)
        for i in range(n):
            with T.sblock("check"):
                vi = T.axis.spatial(n, i)
                assert -extent <= idx[vi] and idx[vi] < extent, message
                out[vi] = T.if_then_else(idx[vi] < 0, idx[vi] + T.Cast(dtype, extent), idx[vi])

    # opaque: Relax's fusion must not look into it (its op-pattern analysis wants block bodies)
    return check.with_attr("op_pattern", OPAQUE).with_attr("tirx.is_scheduled", True)
