"""Attention sinks as exporters write them (transformers' GPT-OSS eager attention) → the kernel's ``sinks``.

    logits = concat([logits, sinks.view(1, h, 1, 1).expand(B, h, n, 1)], -1)   a key column per head
    logits = logits - logits.max(-1, keepdim=True)                              (the kernel takes its own max)
    probs  = softmax(logits)[..., :-1]                                          the sink's weight dropped

The kernel's sinks are the same column: exp(s_t) / (exp(sink_h) + Σ_t exp(s_t)) (`AttentionSpec.sinks`).
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax, tirx

from tvmattn.compiler.onnx.chain import AttentionPattern, NoMatch
from tvmattn.compiler.onnx.kernels import shape_of

_BROADCAST_TO = tvm.ir.Op.get("relax.broadcast_to")


def sink_logits(bb: relax.BlockBuilder, m: dict, p: AttentionPattern, scores: list[tirx.PrimExpr], split: bool,
                bound: Callable[[relax.Expr], relax.Expr], visit: Callable[[relax.Expr], relax.Expr]
                ) -> relax.Expr | None:
    """Each head's sink logit, (h,) float32, where the match ``m`` joins one to every row of its (B, h, n,
    n_kv) logits ``scores`` as a last key column and drops that column's weight after the softmax; None
    where it joins none. ``split``: the chain's logits are (B·h) batches split around the softmax."""
    _check_row_max(m, p)
    if p.joined not in m and p.sunk not in m:
        return None
    if p.joined not in m or p.sunk not in m or split or len(scores) != 4:
        raise NoMatch("a column joined to the scores or sliced off the weights, not a sink of (B, h) logits")
    _check_kept_columns(m[p.joined], m[p.sunk], scores[3])
    sink = bound(m[p.sink])
    while isinstance(sink, relax.Call) and sink.op.same_as(_BROADCAST_TO):
        sink = bound(sink.args[0])
    if isinstance(sink, tvm.ir.GenericConst):  # folded at static sizes: (B, h, n, 1), constant along B and n
        table = sink.value.numpy()
        table = table.reshape((1,) * (4 - table.ndim) + table.shape)
        if table.ndim != 4 or not (table == table[:1, :, :1, :1]).all():
            raise NoMatch("the column joined to the scores varies along another axis than the heads")
        sink = relax.const(table[:1, :, :1, :1].astype("float32"))
    shape = [tirx.IntImm("int64", 1)] * 4 + shape_of(sink, "the joined column")
    if len(shape) > 8 or not all(isinstance(d, tirx.IntImm) and (d.value == 1 or axis == 1)
                                 for axis, d in enumerate(shape[-4:])):
        raise NoMatch("the column joined to the scores varies along another axis than the heads")
    sink = bb.emit(relax.op.reshape(visit(sink), [shape[-3]]))
    sink = bb.emit(relax.op.broadcast_to(sink, [scores[1]])) if shape[-3].value == 1 else sink
    return bb.emit(relax.op.astype(sink, "float32")) if str(sink.ty.dtype) != "float32" else sink


def _check_row_max(m: dict, p: AttentionPattern) -> None:
    """softmax(x - max x) is softmax(x) where the max is x's own over the key axis, kept as a column."""
    if p.stable not in m:
        return
    x, row_max = m[p.stable].args[0], m[p.row_max]
    rank = len(shape_of(x, "the logits"))
    if not x.same_as(row_max.args[0]) or not row_max.attrs.keepdims or row_max.attrs.axis is None or [
            int(a) % rank for a in row_max.attrs.axis] != [rank - 1]:
        raise NoMatch("the logits less another row statistic than their own maximum over the keys")


def _check_kept_columns(joined: relax.Call, sliced: relax.Call, n_kv: tirx.PrimExpr) -> None:
    """The weights keep columns [0, n_kv) of the n_kv + 1 the join made: the keys', not the sink's."""
    _, axes, begins, ends, strides = sliced.args
    end = ends[0] if len(ends) == 1 else None
    if isinstance(end, tirx.IntImm) and end.value < 0:  # probs[..., :-1]: counted from the end
        end = n_kv + 1 + end
    analyzer = tvm.sym.Analyzer()
    if int(joined.attrs.axis) % 4 != 3 or [int(a) % 4 for a in axes] != [3] or end is None or not (
            analyzer.can_prove_equal(begins[0], 0) and analyzer.can_prove_equal(end, n_kv)
            and analyzer.can_prove_equal(strides[0], 1)):
        raise NoMatch("the softmax weights keep other columns than the keys before the joined one")
