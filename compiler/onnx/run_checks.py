"""The run-time checks ONNX Runtime makes and TVM's converters leave out.

Gather   TVM's ``take`` reads out of bounds for an index outside [-extent, extent) (its fast mode:
         a token id past the vocabulary, a position past BERT's table segfaults or returns garbage).
         Indices that are constants are checked here; the others go through a small TIR function
         that asserts the range (naming the node) and maps negative indices, before the take. The
         check is a CPU kernel (parallel chunks of vectorised loops): the importer asks for it on CPU
         targets. GatherElements (TVM's ``gather_elements`` segfaulted too) gets the same check,
         before a broadcast of its indices, which it then reads through the broadcast (the expanded
         tensor is never written). GatherND's index tuples are checked coordinate by coordinate.
Ranges   an index input of ONNX Runtime's attention ops (GroupQueryAttention's seqlens_k and
         total_sequence_length, RotaryEmbedding's position_ids) checked at run time against the buffer it
         indexes, as ONNX Runtime checks it (`in_range`, asked for on CPU targets by the converters).
Pad      an amount computed from the sizes that is not provably ≥ 0 (a negative one crops, and TVM's fill
         of a negative size failed in its allocator) is asserted ≥ 0 at run time (`nonnegative`).
Slice    TVM's converter assumes a symbolic end (``seq``) within the sliced axis and reads past it
         (BERT's 512 position ids sliced to a longer input segfaulted); ONNX clamps it, ONNX Runtime
         then rejects the sizes. The end is checked against a static axis at run time (naming the
         node), in place: the check returns the table itself; clamping instead makes TVM's FuseTIR crash.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, te, tirx, topi
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.script import tirx as T

from tvmattn.compiler.annotations import INJECTIVE, IS_SCHEDULED, OP_PATTERN, OPAQUE
from tvmattn.compiler.errors import TvmAttnError


def gather(bb: relax.BlockBuilder, node: str, inputs: list, attrs: dict) -> relax.Expr | None:
    """A bounds-checked ONNX Gather, or None where TVM's converter is right as it is (constants folded,
    shape values)."""
    data, indices = inputs[0], inputs[1]
    gathered = _gathered_axis(data, attrs)
    if gathered is None:
        return None
    axis, extent = gathered
    if isinstance(extent, int) and isinstance(indices, tvm.ir.GenericConst):
        values = _constant_in_range(indices.value.numpy(), axis, extent, "")
        if isinstance(data, tvm.ir.GenericConst):
            return None  # TVM's converter folds it
        return relax.op.take(data, relax.const(values), axis, mode="clip")
    if not _index_tensor(indices):
        return None
    if not isinstance(extent, int):  # in [-extent, extent) now, the negative ones counted from the end
        # once over the indices ("wrap" took two int64 remainders an output element: a quarter of
        # ConvBERT's symbolic run, its unfold)
        checked = in_range(bb, f"node {node!r} (Gather): an index", indices, -extent, extent)
        return relax.op.take(data, _from_the_end(bb, checked, data, axis), axis, mode="clip")
    # in range now: "clip" reads the same elements as TVM's unchecked "fast" mode (and does not warn)
    checked = _checked(bb, indices, extent, node, "Gather")
    if isinstance(data, tvm.ir.GenericConst) and _bytes(data) <= SMALL_TABLE_BYTES:
        # a lookup in a small table (T5's bias per bucket and head) fused into its consumer (the bias's
        # transposition to heads first): TVM marks a take opaque, and its (n, n, heads) result was
        # written and read again
        out = bb.emit_te(topi.take, data, checked, axis, mode="clip", primfunc_name_hint="take")
        gv = bb.lookup_binding(out).args[0]
        bb.update_func(gv, bb.get()[gv].with_attr(OP_PATTERN, INJECTIVE))
        return out
    return relax.op.take(data, checked, axis, mode="clip")


def gather_nd(bb: relax.BlockBuilder, node: str, inputs: list, attrs: dict) -> relax.Expr | None:
    """A bounds-checked ONNX GatherND (TVM's reads out of bounds: an index past the data is garbage or a
    segfault): coordinate j of every index tuple in [-extent_j, extent_j) of data's axis batch_dims + j,
    the negative ones counted from the end as TVM's converter counts them."""
    data, indices = inputs[0], inputs[1]
    batch_dims = int(attrs.get("batch_dims", 0))
    if not _index_tensor(indices) or not isinstance(data.ty, relax.TensorType) \
            or not isinstance(data.ty.shape, relax.ShapeExpr):
        return None
    dims, coords = list(data.ty.shape.values), indices.ty.shape.values[-1]
    if not isinstance(coords, tirx.IntImm) or not 0 < batch_dims + int(coords) <= len(dims):
        return None  # TVM's converter, and its error
    extents = [dims[batch_dims + j] for j in range(int(coords))]
    checked = indices
    if isinstance(indices, tvm.ir.GenericConst) and all(isinstance(e, tirx.IntImm) for e in extents):
        values = indices.value.numpy()
        for j, extent in enumerate(extents):
            values[..., j] = _constant_in_range(values[..., j], batch_dims + j, int(extent),
                                                f"node {node!r} (GatherND): ")
        # (in the indices' dtype: relax.const's default for an int array is int32, which gather_nd refuses)
        return relax.op.gather_nd(data, relax.const(values, str(indices.ty.dtype)), batch_dims)
    for j, extent in enumerate(extents):
        column = bb.normalize(relax.op.strided_slice(indices, axes=[len(indices.ty.shape.values) - 1], begin=[j],
                                                     end=[j + 1]))
        checked = in_range(bb, f"node {node!r} (GatherND): coordinate {j} of an index", column, -extent, extent,
                           carry=checked)
    extent = onnx_frontend._coord_axis_extents(bb, data, checked, batch_dims)
    return relax.op.gather_nd(data, onnx_frontend._normalize_negative_indices(bb, checked, extent), batch_dims)


def _from_the_end(bb: relax.BlockBuilder, indices: relax.Expr, data: relax.Expr, axis: int) -> relax.Expr:
    """``indices`` (checked in [-extent, extent)) with the negative ones counted from the end of ``data``'s
    ``axis``, as TVM's converter counts them."""
    return onnx_frontend._normalize_negative_indices(
        bb, indices, onnx_frontend._axis_extent(bb, data, axis, str(indices.ty.dtype)))


def gather_elements(bb: relax.BlockBuilder, node: str, inputs: list, attrs: dict) -> relax.Expr | None:
    """A bounds-checked ONNX GatherElements (TVM's read out of bounds: a segfault). Indices broadcast
    from a smaller tensor (DeBERTa's (n, n) relative positions expanded over batch and heads) are
    checked before the broadcast: after it, the check is a pass of its own over the expanded tensor."""
    data, indices = inputs[0], inputs[1]
    gathered = _gathered_axis(data, attrs)
    if gathered is None or not _index_tensor(indices):
        return None
    axis, extent = gathered
    if isinstance(extent, int) and isinstance(indices, tvm.ir.GenericConst):
        return relax.op.gather_elements(data, relax.const(_constant_in_range(
            indices.value.numpy(), axis, extent, f"node {node!r} (GatherElements): ")), axis)
    source = bb.lookup_binding(indices) if isinstance(indices, relax.Var) else indices  # (TVM's: often a Call)
    broadcast = isinstance(source, relax.Call) and source.op.same_as(_BROADCAST_TO) and _index_tensor(source.args[0])
    given = source.args[0] if broadcast else indices
    if isinstance(extent, int):
        checked = _checked(bb, given, extent, node, "GatherElements")
    else:  # in [-extent, extent) now, the negative ones then counted from the end as TVM's converter does
        checked = _from_the_end(bb, in_range(bb, f"node {node!r} (GatherElements): an index", given, -extent, extent),
                                data, axis)
    if broadcast:
        shape = [d for d in source.args[1].values] if isinstance(source.args[1], relax.ShapeExpr) else None
        if shape is not None and _broadcasts_in_place(checked, shape):  # the small tensor read as broadcast
            return bb.call_te(_gather_broadcast_indices, data, checked, shape, axis,
                              primfunc_name_hint="gather_elements")
        checked = bb.normalize(relax.op.broadcast_to(checked, source.args[1]))
    return relax.op.gather_elements(data, checked, axis)


def _broadcasts_in_place(indices: relax.Expr, shape: list) -> bool:
    """Whether each axis of ``indices`` (aligned to the right of ``shape``) is 1 or ``shape``'s own."""
    dims = list(indices.ty.shape.values)
    return len(dims) <= len(shape) and all(
        (isinstance(d, tirx.IntImm) and int(d) == 1) or tvm_ffi.structural_equal(d, t)
        for d, t in zip(dims, shape[len(shape) - len(dims):]))


def _gather_broadcast_indices(data: te.Tensor, indices: te.Tensor, shape: list, axis: int) -> te.Tensor:
    """GatherElements whose indices are ``indices`` broadcast to ``shape``, read in place: the expanded
    index tensor (DeBERTa's (n, n) positions over batch × heads: 8 bytes an element of the output)
    is never written or read."""
    offset = len(shape) - len(indices.shape)

    def element(*out):
        at = [tirx.IntImm(str(o.ty.dtype), 0) if isinstance(d, tirx.IntImm) and int(d) == 1 else o
              for d, o in zip(indices.shape, out[offset:])]
        source = list(out)
        source[axis] = indices(*at).astype(str(out[axis].ty.dtype))
        return data(*source)

    return te.compute(shape, element, name="gather_elements")


def _gathered_axis(data: relax.Expr, attrs: dict) -> tuple[int, Any] | None:
    """(axis, its extent: an int, or the graph's size expression) that a gather of ``data`` reads along."""
    if not isinstance(data.ty, relax.TensorType) or not isinstance(data.ty.shape, relax.ShapeExpr):
        return None
    dims = list(data.ty.shape.values)
    axis = int(attrs.get("axis", 0))
    if not -len(dims) <= axis < len(dims):
        raise TvmAttnError(f"axis={axis} is out of range for data of rank {len(dims)}")
    axis %= len(dims)
    return axis, (int(dims[axis].value) if isinstance(dims[axis], tirx.IntImm) else dims[axis])


def _bytes(constant: tvm.ir.GenericConst) -> int:
    """A constant's size, from its type (its values stay where they are: an embedding table is large)."""
    dims = [int(d) for d in constant.ty.shape.values]
    return int(np.prod(dims)) * tvm.DataType(str(constant.ty.dtype)).bits // 8


def _index_tensor(indices: relax.Expr) -> bool:
    return (isinstance(indices.ty, relax.TensorType) and isinstance(indices.ty.shape, relax.ShapeExpr)
            and str(indices.ty.dtype) in ("int32", "int64"))


def _constant_in_range(values: np.ndarray, axis: int, extent: int, where: str) -> np.ndarray:
    """Constant indices, negative ones counted from the end; a TvmAttnError for one out of range."""
    if values.size and (values.min() < -extent or values.max() >= extent):
        bad = values[(values < -extent) | (values >= extent)].reshape(-1)[0]
        raise TvmAttnError(f"{where}index {bad} is out of range: axis {axis} has {extent} entries, so indices lie "
                           f"in [{-extent}, {extent - 1}]")
    return np.where(values < 0, values + extent, values)


def _checked(bb: relax.BlockBuilder, indices: relax.Expr, extent: int, node: str, op: str) -> relax.Expr:
    """``indices`` through the run-time check (`_checked_indices`), in their shape."""
    flat = bb.normalize(relax.op.reshape(indices, [-1]))
    checker = bb.add_func(_checked_indices(str(indices.ty.dtype), extent, node, op), "check_gather_indices")
    checked = bb.normalize(relax.call_tir(checker, [flat], relax.TensorType(flat.ty.shape, indices.ty.dtype)))
    return bb.normalize(relax.op.reshape(checked, indices.ty.shape))


_BROADCAST_TO = tvm.ir.Op.get("relax.broadcast_to")
CHECK_CHUNKS = 16  # parallel tasks of a run-time index check
SMALL_TABLE_BYTES = 1 << 15  # a gathered constant up to this size is read in cache by its consumer's loop


def _checked_indices(dtype: str, extent: int, node: str, op: str = "Gather") -> tirx.PrimFunc:
    """out[i] = idx[i] (+ extent if negative), asserting -extent <= idx[i] < extent."""
    message = (f"node {node!r} ({op}): an index is out of range: the gathered axis has {extent} entries, so "
               f"indices lie in [{-extent}, {extent - 1}]")

    # Chunks in parallel (the indices are fresh from a parallel producer, half of them in the other
    # core's cache: T5's (n, n) bucket maps), each two loops without a branch, which LLVM vectorises:
    # its indices out of range counted, its negative ones mapped; then one assert on the counts.
    chunks = CHECK_CHUNKS

    @T.prim_func(private=True, s_tir=True)
    def check(idx_h: T.handle, out_h: T.handle):
        n = T.int64()
        idx = T.match_buffer(idx_h, (n,), dtype)
        out = T.match_buffer(out_h, (n,), dtype)
        with T.sblock("root"):
            bad = T.sblock_alloc_buffer((chunks,), "int64")
            total = T.sblock_alloc_buffer((1,), "int64", scope="local")
            for c in T.parallel(chunks):
                with T.sblock("chunk"):
                    lo = T.meta_var(c * n // chunks)
                    size = T.meta_var((c + 1) * n // chunks - c * n // chunks)
                    count = T.sblock_alloc_buffer((1,), "int64", scope="local")
                    count[0] = T.int64(0)
                    for i in range(size):
                        count[0] = count[0] + T.Cast("int64", T.Or(idx[lo + i] < T.Cast(dtype, -extent),
                                                                   idx[lo + i] >= T.Cast(dtype, extent)))
                    bad[c] = count[0]
                    for i in range(size):
                        out[lo + i] = T.Select(idx[lo + i] < T.Cast(dtype, 0), idx[lo + i] + T.Cast(dtype, extent),
                                               idx[lo + i])
            total[0] = T.int64(0)
            for c in range(chunks):
                total[0] = total[0] + bad[c]
            assert total[0] == T.int64(0), message

    # opaque: Relax's fusion must not look into it (its op-pattern analysis wants block bodies)
    return check.with_attr(OP_PATTERN, OPAQUE).with_attr(IS_SCHEDULED, True)


_STRIDED_SLICE = tvm.ir.Op.get("relax.strided_slice")
CHECK_SLICE = "check_slice_end"  # the check's function name (`unchecked` recognises it)
CHECK_RANGE = "check_index_range"  # `in_range`'s
CHECK_SIZE = "check_nonnegative"  # `nonnegative`'s
_PASSED_THROUGH = {CHECK_SLICE: 0, CHECK_RANGE: 3, CHECK_SIZE: 0}  # a check → its argument it returns (data, carry)


def slice_bounds(bb: relax.BlockBuilder, node: str, sliced: relax.Expr) -> relax.Expr:
    """TVM's Slice with its symbolic ends (sizes, or expressions of them) checked against the static sizes of
    their axes."""
    if not (isinstance(sliced, relax.Call) and sliced.op.same_as(_STRIDED_SLICE) and sliced.attrs.assume_inbound):
        return sliced
    data, axes, begin, end, strides = sliced.args
    ty = data.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return sliced
    dims = list(ty.shape.values)
    if not all(isinstance(d, tirx.IntImm) for d in dims):
        return sliced
    checked = data
    for axis, bound in zip([int(a) for a in axes.fields], end.fields):
        extent = dims[axis % len(dims)]
        if isinstance(bound, tirx.IntImm) or not isinstance(extent, tirx.IntImm):  # (a size or an expression
            continue  # of sizes: Wav2Vec2-Conformer's rotary table sliced to its frames, (n - 400) // 320 + 1)
        flat = bb.normalize(relax.op.reshape(checked, [-1]))
        probe = bb.normalize(relax.op.zeros(relax.ShapeExpr([bound]), "int8"))  # its length is the end
        checker = bb.add_func(_checked_end(str(ty.dtype), int(extent.value), axis % len(dims), node), CHECK_SLICE)
        # in place: the check writes nothing and returns the table itself (a copy, every run, had cost a
        # 1024 × 1024 mask buffer more than its attention, so large tables went unchecked)
        flat = bb.normalize(relax.call_tir_inplace(checker, [flat, probe], [0],
                                                   relax.TensorType(flat.ty.shape, ty.dtype)))
        checked = bb.normalize(relax.op.reshape(flat, ty.shape))
    if checked is data:
        return sliced
    return relax.op.strided_slice(checked, list(axes.fields), list(begin.fields), list(end.fields),
                                  list(strides.fields), assume_inbound=True)


def unchecked(expr: relax.Expr, var2val) -> relax.Expr:
    """The data under `slice_bounds` or `in_range` checks (each passes its data through, flat, and the
    result is reshaped back), else ``expr``: patterns that read a sliced constant (a tril mask buffer) see
    the constant, position rules the positions a GatherND's checked indices are (Hugging Face's vmap
    masks: a check per coordinate, chained)."""
    reshaped = _value(expr, var2val)
    if not _is_op(reshaped, "relax.reshape"):
        return expr
    data = _value(reshaped.args[0], var2val)
    passed = _passed_through(data)
    if passed is None:
        return expr
    while passed is not None:  # through the chain of checks to the flat data
        data = _value(data.args[1].fields[passed], var2val)
        passed = _passed_through(data)
    if not _is_op(data, "relax.reshape"):
        return expr
    source = _value(data.args[0], var2val)
    have, want = (getattr(getattr(x, "ty", None), "shape", None) for x in (source, reshaped))
    analyzer = tvm.sym.Analyzer()
    same = isinstance(have, relax.ShapeExpr) and isinstance(want, relax.ShapeExpr) and len(have.values) == len(
        want.values) and all(analyzer.can_prove_equal(a, b) for a, b in zip(have.values, want.values))
    return source if same else expr


def _value(expr: relax.Expr, var2val) -> relax.Expr:
    """What ``expr`` is bound to, through variables bound to variables."""
    while isinstance(expr, relax.Var) and expr in var2val:
        expr = var2val[expr]
    return expr


def _passed_through(expr: relax.Expr) -> int | None:
    """The argument a run-time check returns, where ``expr`` calls one."""
    if not (_is_op(expr, "relax.call_tir") or _is_op(expr, "relax.call_tir_inplace")):
        return None
    return next((at for name, at in _PASSED_THROUGH.items() if expr.args[0].name_hint.startswith(name)), None)


def _is_op(expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == name


def _checked_end(dtype: str, extent: int, axis: int, node: str) -> tirx.PrimFunc:
    """Asserts the length of ``probe`` (the slice's end) is at most ``extent``; ``data`` is its in-place
    output, untouched."""
    message = (f"node {node!r} (Slice): its end is past the {extent} entries of axis {axis} (a longer input "
               f"than the model's table allows); use inputs of at most {extent} along it")

    @T.prim_func(private=True, s_tir=True)
    def check(data_h: T.handle, probe_h: T.handle):
        m, end = T.int64(), T.int64()
        T.match_buffer(data_h, (m,), dtype)
        T.match_buffer(probe_h, (end,), "int8")
        assert end <= extent, message

    return check.with_attr(OP_PATTERN, OPAQUE).with_attr(IS_SCHEDULED, True)


def in_range(bb: relax.BlockBuilder, where: str, values: relax.Expr, lo, hi,
             carry: relax.Expr | None = None) -> relax.Expr:
    """``carry`` (default ``values``) passed through a run-time check that every element of the int tensor
    ``values`` lies in [lo, hi) (ints, or PrimExprs of the graph's sizes); otherwise the run fails with
    ``where`` and the range. What follows must read the result, so that the check runs before it."""
    carry = values if carry is None else carry
    flat = bb.normalize(relax.op.reshape(values, [-1]))
    kept = bb.normalize(relax.op.reshape(carry, [-1]))
    bounds = [relax.prim_value(tirx.IntImm("int64", b) if isinstance(b, int) else tirx.Cast("int64", b))
              for b in (lo, hi)]
    message = f"{where}: a value lies outside [{_size(lo)}, {_size(hi)})"
    checker = bb.add_func(_checked_range(str(flat.ty.dtype), str(kept.ty.dtype), message), CHECK_RANGE)
    out = bb.normalize(relax.call_tir(checker, [flat, *bounds, kept], relax.TensorType(kept.ty.shape, kept.ty.dtype)))
    return bb.normalize(relax.op.reshape(out, carry.ty.shape))


def nonnegative(bb: relax.BlockBuilder, message: str, carry: relax.Expr, value: tirx.PrimExpr) -> relax.Expr:
    """``carry`` passed through, in place, after a run-time assertion that ``value`` (an expression of the
    graph's sizes) is ≥ 0; otherwise the run fails with ``message``. What follows must read the result."""
    flat = bb.normalize(relax.op.reshape(carry, [-1]))
    checker = bb.add_func(_checked_nonnegative(str(flat.ty.dtype), message), CHECK_SIZE)
    flat = bb.normalize(relax.call_tir_inplace(checker, [flat, relax.prim_value(tirx.Cast("int64", value))], [0],
                                               relax.TensorType(flat.ty.shape, flat.ty.dtype)))
    return bb.normalize(relax.op.reshape(flat, carry.ty.shape))


def _checked_nonnegative(dtype: str, message: str) -> tirx.PrimFunc:
    """Asserts ``value`` ≥ 0; ``data`` is its in-place output, untouched."""

    @T.prim_func(private=True, s_tir=True)
    def check(data_h: T.handle, value: T.int64):
        m = T.int64()
        T.match_buffer(data_h, (m,), dtype)
        assert value >= 0, message

    return check.with_attr(OP_PATTERN, OPAQUE).with_attr(IS_SCHEDULED, True)


def _size(x) -> str:
    if isinstance(x, tirx.Mul) and isinstance(x.b, tirx.IntImm) and x.b.value == -1:  # (-n, as TVM writes it)
        return f"-{_size(x.a)}"
    return str(int(x.value)) if isinstance(x, tirx.IntImm) else str(x)


def _checked_range(dtype: str, carried: str, message: str) -> tirx.PrimFunc:
    """out = carry, asserting lo <= values[i] < hi for every i."""

    @T.prim_func(private=True, s_tir=True)
    def check(values_h: T.handle, lo: T.int64, hi: T.int64, carry_h: T.handle, out_h: T.handle):
        n, m = T.int64(), T.int64()
        values = T.match_buffer(values_h, (n,), dtype)
        carry = T.match_buffer(carry_h, (m,), carried)
        out = T.match_buffer(out_h, (m,), carried)
        for i in range(n):
            with T.sblock("check"):
                vi = T.axis.spatial(n, i)
                assert lo <= T.Cast("int64", values[vi]) and T.Cast("int64", values[vi]) < hi, message
        for i in range(m):
            with T.sblock("carry"):
                vi = T.axis.spatial(m, i)
                out[vi] = carry[vi]

    return check.with_attr(OP_PATTERN, OPAQUE).with_attr(IS_SCHEDULED, True)
