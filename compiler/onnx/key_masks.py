"""A mask built from positions AND a per-key tensor, split into the spec's position rule and a key mask.

Hugging Face decoders given an ``attention_mask`` build ``keep = causal(i, j) & attention_mask[b, j]``
as a (B, 1, n, n_kv) tensor (then ``where(keep, 0, finfo.min)``), and the kernel read all of it. Split,
the causal part is the spec's rule (its key tiles skipped) and the rest a (B, 1, 1, n_kv) mask the
kernel reads once per key: `split` finds the parts.

A row that sees no key (left padding's first rows) differs between the two: under finfo.min every
logit of such a row is finfo.min, so the model averages V over *every* key; the kernel hides the keys
the causal rule hides and averages the rest. `average_empty_rows` gives those rows the model's value
(the mean of V over all keys), so the replacement stays exact. With a fill of -inf (a bool mask) both
give such a row no weights at all (NaN in the model, zeros from the kernel, zeros after the exporter's
isnan guard: `patterns._check_guard`).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, tirx

from tvmattn.compiler.onnx import positions
from tvmattn.compiler.onnx.kernels import shape_of


@dataclass
class Split:
    rule: dict  # the spec's position fields (causal, causal_align, window); empty: the keys alone
    keys: list[relax.Expr]  # the per-key conjuncts (as the original function names them), each (…, 1, n_kv)


def split(keep: relax.Expr, values: dict, index: list[tirx.Var], n, n_kv) -> Split | None:
    """``keep`` (a bool tensor broadcasting to the scores, as an expression of the original function)
    as a conjunction of a causal position rule and tensors constant along the query axis; None where
    it is not one (no position part, no key part, or any other conjunct)."""
    rules, keys = [], []
    for term in _conjuncts(keep, values):
        dims = shape_of(term, "a mask term")
        if len(dims) >= 2 and _is_one(dims[-2]):  # the same for every query: read per key
            keys.append(term)
            continue
        rule = positions.rule(term, positions.broadcast(index, term), values)
        if rule is None or positions.dtype(rule) != "bool":
            return None
        rules.append(rule)
    if not rules or not keys:
        return None
    combined = rules[0]
    for r in rules[1:]:
        combined = tirx.And(combined, r)
    if _always(combined, index, n, n_kv):  # (an encoder's "query ≥ 0"): the keys alone
        return Split({}, keys)
    rule = positions.key_rule(combined, index, n, n_kv)
    return Split(rule, keys) if rule else None


def _always(rule, index: list[tirx.Var], n, n_kv) -> bool:
    """Whether ``rule`` holds for every query i < n and key j < n_kv."""
    analyzer = tvm.sym.Analyzer()
    for var, extent in zip(index[-2:], (n, n_kv)):
        analyzer.bind(var, tvm.ir.Range(tirx.IntImm("int64", 0), extent))
    for var in index[:-2]:
        analyzer.update(var, tvm.sym.ConstIntBound(0, tvm.sym.ConstIntBound.POS_INF))
    value = analyzer.simplify(rule)
    return isinstance(value, tirx.IntImm) and bool(value.value)


def average_empty_rows(bb: relax.BlockBuilder, out: relax.Expr, v: relax.Expr, key_keep: relax.Expr,
                       rule: dict, layout: str, group: int) -> relax.Expr:
    """``out`` (the kernel's (B, h, n, d_v), or (B, n, h, d_v) for BSHD) with every row that sees no key
    (no j ≤ i + offset with ``key_keep`` (…, n_kv) True) replaced by the mean of V over all keys, as
    the model computes it under a finite mask fill. ``v`` is the kernel's V operand (h/``group``
    heads)."""
    h_axis, s_axis = (2, 1) if layout == "BSHD" else (1, 2)
    shape = shape_of(out, "the attention output")
    n_kv, n = shape_of(v, "v")[s_axis], shape[s_axis]
    batch = shape_of(key_keep, "a key mask")[0]
    keys = bb.emit(relax.op.astype(relax.op.reshape(key_keep, [batch, n_kv]), "int32"))  # (B|1, n_kv)
    # the first key a row may see: argmax finds the first kept key, or the appended n_kv-th if none is
    ones = bb.emit(relax.op.ones([batch, 1], "int32"))
    first = bb.emit(relax.op.argmax(relax.op.concat([keys, ones], axis=1), axis=1))  # (B|1,)
    offset = n_kv - n if rule.get("causal_align") == "bottom_right" else tirx.IntImm("int64", 0)
    last_seen = bb.emit(relax.op.arange(offset, offset + n, 1, "int64"))  # (n,): the last key each row may see
    empty = bb.emit(relax.op.less(relax.op.expand_dims(last_seen, 0),
                                  relax.op.expand_dims(relax.op.astype(first, "int64"), 1)))  # (B|1, n)
    empty = bb.emit(relax.op.reshape(empty, [batch, 1, n, 1] if layout == "BHSD" else [batch, n, 1, 1]))
    mean = bb.emit(relax.op.mean(v, axis=[s_axis], keepdims=True))  # (B, h_kv, 1, d) or (B, 1, h_kv, d)
    if group > 1:  # query head i reads KV head i // group
        mean = bb.emit(relax.op.repeat(mean, group, axis=h_axis))
    return bb.emit(relax.op.where(empty, mean, out))


def _conjuncts(expr: relax.Expr, values: dict) -> list[relax.Expr]:
    value = values.get(expr, expr)
    name = getattr(value.op, "name", "") if isinstance(value, relax.Call) else ""
    if name == "relax.logical_and":
        return _conjuncts(value.args[0], values) + _conjuncts(value.args[1], values)
    if name == "relax.broadcast_to":  # (each term broadcasts to the scores on its own)
        return _conjuncts(value.args[0], values)
    if isinstance(value, tvm.ir.GenericConst) and value.value.numpy().size == 1 and value.value.numpy().item() is True:
        return []  # `True & x` (HF's mask functions start from True)
    return [expr]


def _is_one(d) -> bool:
    return isinstance(d, tirx.IntImm) and d.value == 1


# elementwise ops a mask is computed with: rebuilt on narrowed operands by `per_key`
_ELEMENTWISE = {f"relax.{op}": getattr(relax.op, op) for op in (
    "add", "subtract", "multiply", "divide", "where", "logical_not", "logical_and", "logical_or", "equal",
    "not_equal", "less", "less_equal", "greater", "greater_equal", "negative", "maximum", "minimum")}


def per_key(bb: relax.BlockBuilder, mask: relax.Expr, values: dict, visit) -> relax.Expr | None:
    """``mask`` (as the original function writes it; (…, n, n_kv) after broadcasting) computed without
    its broadcast along the queries, where nothing in it varies by query: an encoder's padding mask
    (1 - m[:, None, None, :]) · finfo.min that the export expanded to (B, 1, n, n_kv) before the
    arithmetic, read by the kernel once per key instead of per (query, key). None where it varies by
    query. ``visit`` gives an original expression's value in the function being built."""
    dims = shape_of(mask, "a mask")
    if len(dims) < 2 or _is_one(dims[-2]):
        return visit(mask)
    value = values.get(mask, mask)
    if not isinstance(value, relax.Call):
        return None
    name = getattr(value.op, "name", "")
    if name == "relax.broadcast_to":
        return per_key(bb, value.args[0], values, visit)
    if name == "relax.astype":
        inner = per_key(bb, value.args[0], values, visit)
        return None if inner is None else bb.emit(relax.op.astype(inner, str(value.attrs.dtype)))
    op = _ELEMENTWISE.get(name)
    if op is None:
        return None
    args = []
    for a in value.args:
        if isinstance(a, tvm.ir.GenericConst):  # (a static import's all-True (…, n, 1) folds to one)
            constant = a.value.numpy()
            if constant.ndim >= 2 and not (constant == constant[..., :1, :]).all():
                return None
            args.append(a if constant.ndim < 2 else relax.const(constant[..., :1, :]))
            continue
        narrowed = per_key(bb, a, values, visit) if isinstance(a, relax.Expr) and hasattr(a, "ty") else None
        if narrowed is None:
            return None
        args.append(narrowed)
    return bb.emit(op(*args))
