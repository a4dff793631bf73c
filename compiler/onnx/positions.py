"""Masks computed from positions: the rule a tensor of position arithmetic computes, proved causal.

Dynamic-shape exports cannot bake a causal mask into a constant; they compute it where the model
runs, from aranges of the sequence lengths (the dynamo exporter's ``arange(n_kv)[None, :] <=
(past + arange(n))[:, None]``, then ``where(keep, 0, finfo.min)``). `rule` reads such an expression
back as a TIR expression of the element's index, and `key_rule` proves that rule is the spec's causal
one (with or without a sliding window) at every length, so the kernel skips the hidden key tiles
instead of reading an (n, n_kv) mask.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.ir.expr import Expr as PrimExpr

from tvmattn.compiler.annotations import TILE_FUNCTION
from tvmattn.compiler.onnx import run_checks
from tvmattn.compiler.onnx.constant_masks import band
from tvmattn.compiler.onnx.shape_ops import bounded_below

Index = list[PrimExpr]  # one index per axis of the tensor being read

_BINARY: dict[str, Callable[[PrimExpr, PrimExpr], PrimExpr]] = {
    "relax.add": lambda a, b: a + b, "relax.subtract": lambda a, b: a - b, "relax.multiply": lambda a, b: a * b,
    "relax.less": tirx.LT, "relax.less_equal": tirx.LE, "relax.greater": tirx.GT,
    "relax.greater_equal": tirx.GE, "relax.equal": tirx.EQ, "relax.not_equal": tirx.NE,
    "relax.logical_and": tirx.And, "relax.logical_or": tirx.Or,
    "relax.floor_mod": tirx.floormod, "relax.floor_divide": tirx.floordiv,
}


def rule(expr: relax.Expr, index: Index | None, var2val: dict) -> PrimExpr | None:
    """The value of ``expr`` at ``index`` (its own rank's worth of indices) as an expression of the
    indices and the model's symbolic sizes, or None where it reads anything but positions (a tensor
    input, a constant of more than one value) or through an op no rule of `_RULES` follows."""
    if index is None:
        return None
    expr = run_checks.unchecked(var2val.get(expr, expr), var2val)
    expr = var2val.get(expr, expr)
    if isinstance(expr, tvm.ir.GenericConst):
        return _constant(expr.value.numpy(), index)
    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return None
    if expr.op.name in _BINARY:
        a, b = (rule(x, broadcast(index, x), var2val) for x in expr.args)
        return None if a is None or b is None else _BINARY[expr.op.name](*_same_type(a, b))
    follow = _RULES.get(expr.op.name)
    return follow(expr, index, var2val) if follow is not None else None


def _constant(value, index: Index) -> PrimExpr | None:
    """One value everywhere (an all-True mask broadcast to the batch), a band of the last two axes (a
    causal mask baked in by an export or an import at static sizes: `_band`), or the element at an
    index known when the model is compiled (ALiBi's slope of one head: `onnx.alibi`)."""
    if value.size and (value == value.flat[0]).all():
        return tirx.const(value.flat[0].item(), str(value.dtype))
    banded = _band(value, index)
    if banded is not None:
        return banded
    analyzer = tvm.sym.Analyzer()
    at = [analyzer.simplify(i) for i in index]
    if len(at) != value.ndim or not all(isinstance(i, tirx.IntImm) for i in at):
        return None
    return tirx.const(value[tuple(int(i.value) for i in at)].item(), str(value.dtype))


def _band(value, index: Index) -> PrimExpr | None:
    """A bool constant (…, n, n_kv) that is a band of its last two axes (`constant_masks.band`): the
    rule ``j − i ≤ u`` (and ``j − i ≥ l``) of query i and key j, which `key_rule` then proves causal,
    windowed or not. None for any other constant."""
    found = band(value) if value.dtype == np.bool_ and min(value.shape[-2:], default=0) >= 2 else None
    if found is None:
        return None
    i, j = index[-2], index[-1]
    upper, lower = (None if v is None else tirx.const(v, j.ty.dtype) for v in found)
    return j - i <= upper if lower is None else tirx.And(j - i <= upper, j - i >= lower)


# ---- one rule per op: the element at ``index`` of the op's output, from its operands' ----------------------
def _arange(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    start, _, step = (a if tvm.ir.is_prim_expr(a) else None for a in expr.args)
    return None if start is None or step is None or len(index) != 1 else start + step * index[0]


def _shape_to_tensor(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    """Shape arithmetic as a tensor: a ShapeExpr's values, or the static shape of a shape_of."""
    shape = var2val.get(expr.args[0], expr.args[0])
    values = (dims_of(shape.args[0]) or [] if _is_call(shape, "relax.shape_of")
              else list(shape.values) if isinstance(shape, relax.ShapeExpr) else [])
    if len(index) != 1 or not (len(values) == 1 or (values and isinstance(index[0], tirx.IntImm))):
        return None
    return values[0 if len(values) == 1 else index[0].value]


def _astype(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    a = rule(expr.args[0], index, var2val)
    if a is None:
        return None
    sides = (a.true_value, a.false_value) if isinstance(a, tirx.Select) else ()
    if str(expr.attrs.dtype) == "bool" and all(isinstance(v, (tirx.IntImm, tirx.FloatImm)) for v in sides) \
            and len(sides) == 2 and (sides[0].value != 0) != (sides[1].value != 0):
        return a.condition if sides[0].value != 0 else tirx.Not(a.condition)  # where(keep, 0, fill) as bool
    return tirx.Cast(str(expr.attrs.dtype), a)


def _strided_slice(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    """Element i of the slice is element begin + stride·i (a negative begin of a static axis counts from
    its end: TorchScript reverses a pads tensor with [-1::-1])."""
    args = expr.args
    axes, begins, strides = (_prims(a) for a in (args[1], args[2], args[4] if len(args) > 4 else None))
    dims = dims_of(args[0])
    if axes is None or begins is None or dims is None:
        return None
    inner = list(index)
    for k, (axis, begin) in enumerate(zip(axes, begins)):
        axis = int(axis) % len(index)
        if isinstance(begin, tirx.IntImm) and begin.value < 0 and isinstance(dims[axis], tirx.IntImm):
            begin = tirx.IntImm("int64", max(begin.value + dims[axis].value, 0))
        if not bounded_below(begin).can_prove(begin >= 0):
            return None  # a begin that may count from the end
        inner[axis] = begin + (strides[k] if strides else 1) * index[axis]
    return rule(args[0], inner, var2val)


def _reshape(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    """A reshape that adds or removes unit axes (`_unit_axes`), or one of static sizes: the element at the
    same position of the row-major order."""
    inner = _unit_axes_dropped(expr, expr.args[0], index)
    if inner is None:
        out, into = dims_of(expr), dims_of(expr.args[0])
        if out is None or into is None or not all(isinstance(d, tirx.IntImm) for d in (*out, *into)):
            return None
        flat = sum((i * int(np.prod([d.value for d in out[k + 1:]], dtype=np.int64)) for k, i in enumerate(index)),
                   tirx.IntImm("int64", 0))
        strides = [int(np.prod([d.value for d in into[k + 1:]], dtype=np.int64)) for k in range(len(into))]
        inner = [tvm.sym.Analyzer().simplify(tirx.floormod(tirx.floordiv(flat, stride), d.value))
                 for stride, d in zip(strides, into)]
    return rule(expr.args[0], inner, var2val)


def _permute_dims(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    """Output axis k is the input's axis axes[k]."""
    axes = expr.attrs.axes
    axes = list(range(len(index)))[::-1] if axes is None else [int(a) for a in axes]
    inner = [None] * len(index)
    for k, a in enumerate(axes):
        inner[a] = index[k]
    return rule(expr.args[0], inner, var2val)


def _negative(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    a = rule(expr.args[0], index, var2val)
    return None if a is None else -a


def _concat(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    """The part the index falls in, at the index less the sizes of the parts before it."""
    parts = var2val.get(expr.args[0], expr.args[0])
    dims = [dims_of(p) for p in getattr(parts, "fields", [])]
    if not dims or any(d is None for d in dims):
        return None
    axis = int(expr.attrs.axis) % len(index)
    starts = [sum((d[axis] for d in dims[:k]), tirx.IntImm("int64", 0)) for k in range(len(dims))]
    known = tvm.sym.Analyzer().simplify(index[axis])
    if isinstance(known, tirx.IntImm) and all(isinstance(s, tirx.IntImm) for s in starts):  # one part: it alone
        if known.value < 0:
            return None
        k = max(k for k, s in enumerate(starts) if s.value <= known.value)
        return rule(parts.fields[k], index[:axis] + [known - starts[k]] + index[axis + 1:], var2val)
    values = [rule(p, index[:axis] + [index[axis] - at] + index[axis + 1:], var2val)
              for p, at in zip(parts.fields, starts)]
    if any(v is None for v in values):
        return None
    value = values[-1]
    for at, v in zip(reversed(starts[1:]), reversed(values[:-1])):
        value = _select(index[axis] < at, *_same_type(v, value))
    return value


def _gather_nd(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    """data[indices[..., 0], indices[..., 1], …] (Hugging Face's vmap masks index positions so)."""
    dims = dims_of(expr.args[1])
    if int(expr.attrs.batch_dims) != 0 or dims is None or not isinstance(dims[-1], tirx.IntImm):
        return None
    lead, tail = index[:len(dims) - 1], index[len(dims) - 1:]
    coords = [rule(expr.args[1], lead + [tirx.IntImm("int64", k)], var2val) for k in range(dims[-1].value)]
    if any(c is None or not bounded_below(c).can_prove(c >= 0) for c in coords):
        return None  # a coordinate that may count from the end
    return rule(expr.args[0], coords + tail, var2val)


def _cumsum(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    """A sum of equal terms (a packed-sequence id where positions simply count up): term × count."""
    if expr.attrs.axis is None:
        return None
    axis = int(expr.attrs.axis) % len(index)
    k = tirx.Var("k", "int64")
    term = rule(expr.args[0], index[:axis] + [k] + index[axis + 1:], var2val)
    if term is None:
        return None
    term = bounded_below(term).simplify(term)
    if any(v.same_as(k) for v in tirx.analysis.undefined_vars(term)):
        return None
    return tirx.Cast("int64", term) * (index[axis] + (0 if expr.attrs.exclusive else 1))


def _logical_not(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    a = rule(expr.args[0], index, var2val)
    return None if a is None else tirx.Not(a)


def _where(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    c, a, b = (rule(x, broadcast(index, x), var2val) for x in expr.args)
    return None if c is None or a is None or b is None else _select(c, *_same_type(a, b))


def _unit_axes(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    """expand_dims, broadcast_to, and a reshape that only adds or removes axes of size 1."""
    inner = _unit_axes_dropped(expr, expr.args[0], index)
    return None if inner is None else rule(expr.args[0], inner, var2val)


def _call_tir(expr: relax.Call, index: Index, var2val: dict) -> PrimExpr | None:
    """ONNX Tile, which TVM's importer writes as a call of topi's tile (dyn_tile where the repeats are
    known only at run time): each axis's element i is the input's element i mod its size."""
    callee, args = expr.args[0], getattr(expr.args[1], "fields", [])
    data = args[0] if args else None
    into, out = (dims_of(data) if data is not None else None), dims_of(expr)
    if not isinstance(callee, tvm.ir.GlobalVar) or not TILE_FUNCTION.fullmatch(callee.name_hint) or into is None \
            or out is None or not len(into) == len(out) == len(index):
        return None
    analyzer = tvm.sym.Analyzer()  # (an axis the tile repeats once keeps its index: i < its size)
    return rule(data, [i if analyzer.can_prove_equal(d, e) else tirx.floormod(*_same_type(i, d))
                       for i, d, e in zip(index, into, out)], var2val)


_RULES: dict[str, Callable[[relax.Call, Index, dict], PrimExpr | None]] = {
    "relax.arange": _arange, "relax.shape_to_tensor": _shape_to_tensor, "relax.astype": _astype,
    "relax.strided_slice": _strided_slice, "relax.concat": _concat, "relax.gather_nd": _gather_nd,
    "relax.cumsum": _cumsum, "relax.logical_not": _logical_not, "relax.where": _where,
    "relax.broadcast_to": _unit_axes, "relax.reshape": _reshape, "relax.expand_dims": _unit_axes,
    "relax.call_tir": _call_tir, "relax.permute_dims": _permute_dims, "relax.negative": _negative,
}


def key_rule(keep: PrimExpr, index: list[tirx.Var], n: PrimExpr, n_kv: PrimExpr) -> dict | None:
    """The spec's position rule that the bool rule ``keep`` of the scores' ``index`` (…, query i, key j)
    is for every i < n, j < n_kv and size ≥ 0: causal, top-left (j ≤ i) or bottom-right (j ≤ i + n_kv
    − n), optionally with a sliding window of W keys (j > i + offset − W); else None. ``keep`` must be
    one such upper bound and at most one lower bound, each linear in the key and query with
    coefficients ±1 (any for the query when n is 1), depending on nothing else."""
    analyzer = bounded_below(keep)
    bounds = [_key_bound(c, index, n, analyzer) for c in _conjuncts(analyzer.simplify(keep))]
    upper = [offset for side, offset in filter(None, bounds) if side == "upper"]
    lower = [offset for side, offset in filter(None, bounds) if side == "lower"]
    if None in bounds or len(upper) != 1 or len(lower) > 1:
        return None
    if analyzer.can_prove_equal(upper[0], 0):
        rule = {"causal": True, "causal_align": "top_left"}
    elif analyzer.can_prove_equal(upper[0], n_kv - n):
        rule = {"causal": True, "causal_align": "bottom_right"}
    else:
        return None
    if lower:  # j ≥ i + l  is  j > i + u − W  with  W = u − l + 1
        window = analyzer.simplify(upper[0] - lower[0] + 1)
        if not isinstance(window, tirx.IntImm) or window.value < 1:
            return None
        rule["window"] = int(window.value)
    return rule


def _conjuncts(rule: PrimExpr) -> list[PrimExpr]:
    return _conjuncts(rule.a) + _conjuncts(rule.b) if isinstance(rule, tirx.And) else [rule]


def _key_bound(comparison: PrimExpr, index: list[tirx.Var], n: PrimExpr,
               analyzer: tvm.sym.Analyzer) -> tuple[str, PrimExpr] | None:
    """("upper", u) for j ≤ i + u, ("lower", l) for j ≥ i + l (u, l free of every index: the same rule
    for each batch and head), or None for any other rule."""
    query, key = index[-2], index[-1]
    # as E ≤ 0 with E = ±(a − b); a strict comparison of integers moves the bound by one
    forms = {tirx.LE: (1, 0), tirx.LT: (1, 1), tirx.GE: (-1, 0), tirx.GT: (-1, 1)}
    form = next((f for t, f in forms.items() if isinstance(comparison, t)), None)
    if form is None:
        return None
    sign, strict = form
    linear = tvm.sym.detect_linear_equation(sign * (comparison.a - comparison.b) + strict, [key, query])
    if len(linear) != 3:
        return None
    a_key, a_query, rest = (analyzer.simplify(c) for c in linear)
    if any(v.same_as(i) for v in tirx.analysis.undefined_vars(rest) for i in index):
        return None
    one_query = _is(n, 1)  # i is 0: its coefficient is moot
    if _is(a_key, 1) and (_is(a_query, -1) or one_query):  # j − i + r ≤ 0
        return "upper", analyzer.simplify(-rest)
    if _is(a_key, -1) and (_is(a_query, 1) or one_query):  # i − j + r ≤ 0
        return "lower", rest
    return None


def dtype(value: PrimExpr) -> str:
    return str(value.ty)  # TVM 0.27: a Var's .dtype is its buffer's


def _is(value: PrimExpr, number: int) -> bool:
    return isinstance(value, tirx.IntImm) and value.value == number


def _is_call(expr: relax.Expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == name


def _prims(arg) -> list[PrimExpr] | None:
    """An op's tuple attribute (axes, begins, strides) as PrimExprs; None where it is not one."""
    if arg is None:
        return None
    values = list(arg.values) if isinstance(arg, relax.ShapeExpr) else list(getattr(arg, "fields", arg))
    return values if all(tvm.ir.is_prim_expr(v) or isinstance(v, (int, tirx.IntImm)) for v in values) else None


def _select(cond: PrimExpr, a: PrimExpr, b: PrimExpr) -> PrimExpr:
    """Select(cond, a, b), as the one branch it is where that is provable (the index normalisation
    where(i < 0, i + n, i) of an index i ≥ 0; a concat whose parts agree at their seam)."""
    analyzer = bounded_below(tirx.Select(cond, a, b))
    if analyzer.can_prove(cond):
        return a
    if analyzer.can_prove(tirx.Not(cond)):
        return b
    with analyzer.constraint_scope(cond):
        if analyzer.can_prove_equal(a, b):
            return b
    return tirx.Select(cond, a, b)


def _same_type(a: PrimExpr, b: PrimExpr) -> tuple[PrimExpr, PrimExpr]:
    """Both operands in one dtype (ONNX's operands already agree; TIR's constants may not)."""
    if dtype(a) == dtype(b):
        return a, b
    wide = "int64" if "int" in dtype(a) and "int" in dtype(b) else "float64"
    return tirx.Cast(wide, a), tirx.Cast(wide, b)


def dims_of(expr: relax.Expr) -> list[PrimExpr] | None:
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def broadcast(index: Index, operand: relax.Expr) -> Index | None:
    """The index into a broadcast operand: the trailing axes, 0 along its axes of size 1."""
    dims = dims_of(operand)
    if dims is None or len(dims) > len(index):
        return None
    return [tirx.IntImm("int64", 0) if _is(d, 1) else i for d, i in zip(dims, index[len(index) - len(dims):])]


def _unit_axes_dropped(expr: relax.Expr, data: relax.Expr, index: Index) -> Index | None:
    """The index into ``data`` of an op that only adds or removes axes of size 1 or broadcasts them
    (expand_dims, a reshape that keeps the other sizes in order, broadcast_to): None else."""
    out, into = dims_of(expr), dims_of(data)
    if out is None or into is None:
        return None
    kept = [(d, i) for d, i in zip(out, index) if not _is(d, 1)]
    if getattr(expr.op, "name", "") == "relax.broadcast_to":
        return broadcast(index, data)
    analyzer = tvm.sym.Analyzer()
    wanted = [d for d in into if not _is(d, 1)]
    if len(wanted) != len(kept) or not all(analyzer.can_prove_equal(a, b) for a, (b, _) in zip(wanted, kept)):
        return None
    picked = iter(i for _, i in kept)
    return [tirx.IntImm("int64", 0) if _is(d, 1) else next(picked) for d in into]
