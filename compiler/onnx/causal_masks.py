"""A mask the patterns read as the kernel's causal rule (and window) instead of a tensor: a window of a
constant lower-triangular buffer (`sliced`), or a mask computed from positions (`positional`), each
proved the rule at every length against the scores' (n, n_kv)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from tvmattn.compiler.onnx import positions, run_checks
from tvmattn.compiler.onnx.kernels import shape_of
from tvmattn.compiler.onnx.shape_ops import bounded_below

HUGE_NEGATIVE = -1e30  # a fill at or below this absorbs any score: where(keep, s, f) == s + where(keep, 0, f)
# where(keep, s, f) with f at or below this hides a key from a row that keeps one: exp(f − max) is 0 in fp32
# unless every kept logit of the row is below f + 104 (old Hugging Face models' -1e4)
MODERATE_FILL = -1e4


def sliced(cond: relax.Expr, scores: relax.Expr, var2val: dict, negate: bool, fill: float) -> dict:
    """The spec's causal rule when ``cond`` is a window of a constant lower-triangular matrix C
    whose offset is provably causal's at every length (Hugging Face GPT-2 slices its tril buffer
    as ``C[n_kv - n : n_kv, :n_kv]``): the window keeps key j for query i iff
    begin_c + j ≤ begin_r + i, i.e. j ≤ i + (begin_r − begin_c). Empty otherwise."""
    begin: dict[int, tirx.PrimExpr] = {}
    expr = var2val.get(cond, cond)
    if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.astype":
        expr = var2val.get(expr.args[0], expr.args[0])  # a window of a 0/1 buffer cast to bool (`canonical`)
    while isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.strided_slice":
        data, axes, begins, _, strides = expr.args
        if any(not (isinstance(st, tirx.IntImm) and st.value == 1) for st in strides):
            return {}
        rank = len(shape_of(data, "a mask"))
        for axis, b in zip(axes, begins):
            axis = int(axis) % rank
            begin[axis] = begin.get(axis, 0) + b  # a window of a window: offsets add up
        expr = run_checks.unchecked(var2val.get(data, data), var2val)
    if not begin or not isinstance(expr, tvm.ir.GenericConst):
        return {}
    keep = expr.value.numpy() != negate
    if (keep.ndim < 2 or keep.shape[-1] != keep.shape[-2]
            or not (keep == keep.reshape(-1, *keep.shape[-2:])[0]).all()):
        return {}
    size = keep.shape[-1]
    if not np.array_equal(keep.reshape(-1, size, size)[0], np.tri(size, dtype=bool)):
        return {}
    *_, n, n_kv = shape_of(scores, "the scores")
    *_, rows, cols = shape_of(cond, "a mask")
    analyzer = tvm.sym.Analyzer()
    if not (analyzer.can_prove_equal(rows, n) and analyzer.can_prove_equal(cols, n_kv)):
        return {}  # broadcast along the queries or keys: not a per-(query, key) rule
    offset = begin.get(keep.ndim - 2, 0) - begin.get(keep.ndim - 1, 0)
    if analyzer.can_prove_equal(offset, 0):
        return {"causal": True, "causal_align": "top_left"}  # every query sees key 0
    # bottom-right: a finite fill gives a row that sees no key uniform weights, the kernel zeros
    if analyzer.can_prove_equal(offset, n_kv - n) and (fill == -np.inf or analyzer.can_prove(n_kv >= n)):
        return {"causal": True, "causal_align": "bottom_right"}
    return {}

def positional(mask: relax.Expr, scores: relax.Expr, values: dict, negate: bool, additive: bool = False,
           fill: float = -np.inf) -> dict:
    """The spec's causal rule (and sliding window) when ``mask`` is computed from positions
    (`positions`) as that rule at every length: a bool ``keep`` (``hide`` when ``negate``), or an
    additive where(keep, 0, fill). Empty otherwise."""
    *lead, n, n_kv = shape_of(scores, "the scores")
    index = [tirx.Var(f"i{axis}", "int64") for axis in range(len(lead) + 2)]  # (B, h, query, key)
    value = positions.rule(mask, positions.broadcast(index, mask), values)
    if additive:
        if isinstance(value, tirx.FloatImm) and value.value == 0:  # a bias of zeros: no mask at all
            return {"causal": False}
        if not isinstance(value, tirx.Select):
            return {}
        hidden = [tvm.sym.Analyzer().simplify(v) for v in (value.true_value, value.false_value)]
        if not all(isinstance(v, (tirx.FloatImm, tirx.IntImm)) for v in hidden):
            return {}
        (zero, fill), negate = (hidden, False) if hidden[0].value == 0 else (hidden[::-1], True)
        value, fill = value.condition, fill.value
        if zero.value != 0 or fill > HUGE_NEGATIVE:
            return {}
    if value is None or positions.dtype(value) != "bool":
        return {}
    keep = tirx.Not(value) if negate else value
    if isinstance(tvm.sym.Analyzer().simplify(keep), tirx.IntImm) and tvm.sym.Analyzer().simplify(keep).value:
        return {"causal": False}  # every key visible: no mask at all
    rule = positions.key_rule(keep, index, n, n_kv)
    if rule and fill != -np.inf and (rule["causal_align"] == "bottom_right" or "window" in rule):
        # a row that sees no key: uniform weights in the model, zeros from the kernel
        if not bounded_below(n_kv - n).can_prove(n_kv >= n):
            return {}
    return rule or {}
