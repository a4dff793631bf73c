"""Exporters' spellings of a plain operation, rewritten to that operation before the attention patterns
run (`patterns.rewrite`), so that one pattern reads them all.

- A transpose of the last two axes through merged leading axes: ``reshape(permute_dims(reshape(x,
  (a·b, m, n)), (0, 2, 1)), (a, b, n, m))`` is ``permute_dims(x, (0, 1, 3, 2))``. torch's exporters
  write Kᵀ so when attention runs on (B·h, n, d) batches (``torch.bmm``; the SDPA export of a GQA
  model), and the pattern then saw a kᵀ that was no transpose of the keys.
- A reshape undone: ``reshape(reshape(x, s), shape of x)`` is ``x`` (XGLM reshapes its weights to
  (B, h, n, n_kv) and back between the softmax and P·V).
- A softmax after a reshape that keeps the last axis: ``softmax(reshape(x, s))`` is
  ``reshape(softmax(x), s)``. XGLM (and fairseq-style attention) splits its (B·h, n, n_kv) scores into
  heads for the mask and merges them again before the softmax.
- A clamp at the dtype's lowest value: ``maximum(scores + mask, finfo.min)`` is ``scores + mask`` where
  the scores are a product of matrices and the mask is built from finite constants (XGLM's:
  ``where(causal, 0, finfo.min)``): the sum is then finite and at least finfo.min. (Over a mask of -inf
  the clamp would matter: a row that sees no key would average V; that spelling is left as it is.)
- A mask blended in by arithmetic: ``s·b + (1 − b)·c`` (or ``s·b − (1 − b)·c'``) is ``where(b, s, c)``
  where b holds only zeros and ones (a window of a constant 0/1 buffer: GPT-1's ``w·b − 1e4·(1 − b)``)
  and s is a product of matrices: exactly, for finite s (s·1 + 0·c = s, s·0 + c = c).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvmattn.compiler.onnx import run_checks
from tvmattn.compiler.onnx.kernels import shape_of


def canonical(mod: tvm.IRModule, provenance: dict) -> tvm.IRModule:
    """``mod`` with the spellings above rewritten; ``provenance`` (value → ONNX node) follows the
    bindings whose values changed."""
    old = mod["main"]
    new = _Canonical(mod, provenance).run()
    before = {b.var: b.value for block in old.body.blocks for b in block.bindings}
    for block in new["main"].body.blocks:
        for b in block.bindings:
            was = before.get(b.var)
            if was is not None and not was.same_as(b.value) and was in provenance:
                provenance.setdefault(b.value, provenance[was])
    return new


@relax.expr_functor.mutator
class _Canonical(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, provenance: dict) -> None:
        super().__init__(mod)
        self.mod_, self.provenance = mod, provenance
        self.var2val = relax.analysis.get_var2val(mod["main"])

    def run(self) -> tvm.IRModule:
        gvar = self.mod_.get_global_var("main")
        self.builder_.update_func(gvar, self.visit_expr(self.mod_["main"]))
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        original = call
        call = super().visit_call_(call)
        # (what the helpers find through var2val is the original function's: visit_expr gives its var here)
        x = _merged_transpose(call, self.var2val)
        if x is not None:
            rank = len(shape_of(x, "a transposed tensor"))
            return relax.op.permute_dims(self.visit_expr(x), [*range(rank - 2), rank - 1, rank - 2])
        back = _round_trip(call, self.var2val)
        if back is not None:
            return self.visit_expr(back)
        if getattr(call.op, "name", "") != "relax.nn.softmax":
            return call
        src = call.args[0]
        x, reshaped = src, None
        inner = _op(src, "reshape", self.var2val)
        if inner is not None and _keeps_last_axis(inner, call.attrs.axis):
            x, reshaped = inner.args[0], inner
        x = _unclamped(x, self.var2val)
        blend = _blended(x, self.var2val)
        if blend is not None:
            x = self._selected(*blend)
        elif reshaped is None and x.same_as(src):  # (same_as: each `args[0]` is a new Python object)
            return call
        # over the axis it was (a clamp keeps the shape), or the last one, which the reshape keeps
        probs = relax.op.nn.softmax(self.visit_expr(x), -1 if reshaped is not None else call.attrs.axis)
        if reshaped is None:
            return probs
        moved = self.builder_.emit(probs)  # a binding of its own: the report names its ONNX node
        if original in self.provenance:
            self.provenance.setdefault(self.builder_.lookup_binding(moved), self.provenance[original])
        return relax.op.reshape(moved, reshaped.args[1])

    def _selected(self, keep: relax.Expr, s: relax.Expr, fill: float) -> relax.Expr:
        """where(keep ≠ 0, s, fill) for `_blended`'s terms, each a binding of its own (the patterns read a
        constant keep as one, and a window of a 0/1 buffer through its cast, `causal_masks.sliced`)."""
        value = self.var2val.get(keep, keep)
        if isinstance(value, tvm.ir.GenericConst):
            keep = relax.const(value.value.numpy() != 0)
        else:
            keep = self.builder_.emit(relax.op.astype(self.visit_expr(keep), "bool"))
        return self.builder_.emit(relax.op.where(keep, self.visit_expr(s), relax.const(fill, str(s.ty.dtype))))


def _op(expr: relax.Expr, name: str, var2val: dict) -> relax.Call | None:
    expr = var2val.get(expr, expr)
    return expr if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == f"relax.{name}" else None


def _merged_transpose(call: relax.Call, var2val: dict) -> relax.Expr | None:
    """x where ``call`` is reshape(permute_dims(reshape(x, (∏lead, m, n)), (0, 2, 1)), (…lead, n, m))."""
    if getattr(call.op, "name", "") != "relax.reshape":
        return None
    permute = _op(call.args[0], "permute_dims", var2val)
    if permute is None or permute.attrs.axes is None or [int(a) for a in permute.attrs.axes] != [0, 2, 1]:
        return None
    merge = _op(permute.args[0], "reshape", var2val)
    if merge is None:
        return None
    x = merge.args[0]
    try:
        src, merged, out = (shape_of(e, "a reshape") for e in (x, merge, call))
    except Exception:  # noqa: BLE001 (TvmAttnError or an unknown shape: not this spelling)
        return None
    if len(src) < 3 or len(merged) != 3 or len(out) != len(src):
        return None
    lead = src[:-2]
    product = lead[0]
    for d in lead[1:]:
        product = product * d
    analyzer = tvm.sym.Analyzer()
    same = analyzer.can_prove_equal
    if not (same(merged[0], product) and same(merged[1], src[-2]) and same(merged[2], src[-1])
            and all(same(a, b) for a, b in zip(out[:-2], lead)) and same(out[-2], src[-1])
            and same(out[-1], src[-2])):
        return None
    return x


def _round_trip(call: relax.Call, var2val: dict) -> relax.Expr | None:
    """x for ``reshape(reshape(x, s), shape of x)``."""
    if getattr(call.op, "name", "") != "relax.reshape":
        return None
    inner = _op(call.args[0], "reshape", var2val)
    if inner is None:
        return None
    try:
        src, out = shape_of(inner.args[0], "a reshape"), shape_of(call, "a reshape")
    except Exception:  # noqa: BLE001 (an unknown shape: not this spelling)
        return None
    same = tvm.sym.Analyzer().can_prove_equal
    return inner.args[0] if len(src) == len(out) and all(same(a, b) for a, b in zip(src, out)) else None


def _keeps_last_axis(reshape: relax.Call, axis: int) -> bool:
    """A softmax over the last axis of ``reshape``'s result, which that axis leaves as it was."""
    try:
        src, out = shape_of(reshape.args[0], "a reshape"), shape_of(reshape, "a reshape")
    except Exception:  # noqa: BLE001 (an unknown shape: not this spelling)
        return False
    return int(axis) in (-1, len(out) - 1) and tvm.sym.Analyzer().can_prove_equal(src[-1], out[-1])


def _unclamped(x: relax.Expr, var2val: dict) -> relax.Expr:
    """s + m for ``maximum(s + m, c)`` (either order) with c a scalar at or below its dtype's lowest
    value, s a product of matrices (`_scores`) and m built from finite constants only (`_finite`): the
    clamp then changes nothing; else ``x``."""
    pair = _maximum_of_two(x, var2val)
    if pair is None:
        return x
    for total, low in (pair, pair[::-1]):
        if not isinstance(low, tvm.ir.GenericConst) or low.value.numpy().size != 1:
            continue
        lowest = float(np.finfo(np.float32 if str(low.ty.dtype) == "bfloat16" else str(low.ty.dtype)).min)
        add = _op(total, "add", var2val)
        if float(low.value.numpy().reshape(())) <= lowest and add is not None and any(
                _scores(a, var2val) and _finite(m, var2val) for a, m in (add.args, add.args[::-1])):
            return total
    return x


def _blended(x: relax.Expr, var2val: dict) -> tuple[relax.Expr, relax.Expr, float] | None:
    """(b, s, c) where ``x`` is s·b + (1 − b)·c or s·b − (1 − b)·c' (c = −c'), the products in either
    order, s a product of matrices (`_scores`: finite), b of zeros and ones only (`_zero_one`), c a finite
    scalar constant: x is then where(b, s, c) exactly."""
    add, sub = _op(x, "add", var2val), _op(x, "subtract", var2val)
    if add is None and sub is None:
        return None
    a, b = (add if add is not None else sub).args
    for kept, hidden, sign in ((a, b, 1.0), (b, a, 1.0)) if add is not None else ((a, b, -1.0),):
        for s, keep in _factors(kept, var2val):
            if not (_scores(s, var2val) and _zero_one(keep, var2val)):
                continue
            for rest, fill in _factors(hidden, var2val):
                one_minus = _op(rest, "subtract", var2val)
                if (one_minus is not None and _constant(one_minus.args[0]) == 1.0
                        and one_minus.args[1].same_as(keep) and _constant(fill) is not None):
                    return keep, s, sign * _constant(fill)
            fill = _folded_fill(keep, hidden, var2val)  # (a static import folds (1 − b)·c into one constant)
            if fill is not None:
                return keep, s, sign * fill
    return None


def _folded_fill(keep: relax.Expr, hidden: relax.Expr, var2val: dict) -> float | None:
    """c where ``keep`` and ``hidden`` are constants B and (1 − B)·c: 0 where B is 1, one finite c where it
    is 0."""
    keep, hidden = var2val.get(keep, keep), var2val.get(hidden, hidden)
    if not (isinstance(keep, tvm.ir.GenericConst) and isinstance(hidden, tvm.ir.GenericConst)):
        return None
    try:
        b, h = np.broadcast_arrays(keep.value.numpy().astype(np.float64), hidden.value.numpy().astype(np.float64))
    except ValueError:
        return None
    fills = np.unique(h[b == 0])
    if b.shape != keep.value.numpy().shape or np.any(h[b == 1] != 0) or fills.size != 1 \
            or not np.isfinite(fills[0]):
        return None
    return float(fills[0])


def _factors(x: relax.Expr, var2val: dict) -> tuple[tuple[relax.Expr, relax.Expr], ...]:
    """(p, q) and (q, p) where ``x`` is p·q; none otherwise."""
    mul = _op(x, "multiply", var2val)
    return ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])) if mul is not None else ()


def _constant(c: relax.Expr) -> float | None:
    """The value of a finite scalar constant; else None."""
    if not isinstance(c, tvm.ir.GenericConst) or c.value.numpy().size != 1:
        return None
    value = float(c.value.numpy().reshape(()).astype(np.float64))
    return value if np.isfinite(value) else None


def _zero_one(b: relax.Expr, var2val: dict, depth: int = 0) -> bool:
    """Whether ``b`` holds zeros and ones only, by construction: a constant that does, moved by the
    layout operators of `_FINITE_THROUGH` (a checked slice read through its check), or a cast of a bool."""
    b = run_checks.unchecked(var2val.get(b, b), var2val)
    if isinstance(b, tvm.ir.GenericConst):
        return bool(np.isin(b.value.numpy().astype(np.float64), (0.0, 1.0)).all())
    if depth > 16 or not isinstance(b, relax.Call):
        return False
    name = getattr(b.op, "name", "").removeprefix("relax.")
    if name == "astype" and str(b.args[0].ty.dtype) == "bool":
        return True
    return name in _FINITE_THROUGH and _zero_one(b.args[0], var2val, depth + 1)


def _maximum_of_two(x: relax.Expr, var2val: dict) -> tuple[relax.Expr, relax.Expr] | None:
    """(a, b) for ``maximum(a, b)``, or for TVM's import of ONNX's variadic Max of two:
    ``max(stack((broadcast_to(a, s), broadcast_to(b, s))), axis=0)``."""
    call = _op(x, "maximum", var2val)
    if call is not None:
        return call.args[0], call.args[1]
    call = _op(x, "max", var2val)
    stack = _op(call.args[0], "stack", var2val) if call is not None else None
    if stack is None or call.attrs.keepdims or [int(a) for a in call.attrs.axis or []] != [0] \
            or int(stack.attrs.axis) != 0 or len(stack.args[0].fields) != 2:
        return None
    wide = [_op(f, "broadcast_to", var2val) for f in stack.args[0].fields]
    return tuple(w.args[0] if w is not None else f for w, f in zip(wide, stack.args[0].fields))


def _scores(s: relax.Expr, var2val: dict, depth: int = 0) -> bool:
    """Whether ``s`` is a matmul's product (finite for finite operands), reshaped, cast or scaled."""
    s = var2val.get(s, s)
    if depth > 16 or not isinstance(s, relax.Call):
        return False
    name = getattr(s.op, "name", "").removeprefix("relax.")
    if name == "matmul":
        return True
    if name in ("multiply", "divide"):
        return any(isinstance(c, tvm.ir.GenericConst) for c in s.args) and any(
            _scores(a, var2val, depth + 1) for a in s.args)
    return name in ("reshape", "astype", "permute_dims") and _scores(s.args[0], var2val, depth + 1)


_FINITE_THROUGH = ("astype", "reshape", "broadcast_to", "expand_dims", "permute_dims", "strided_slice", "squeeze")


def _finite(m: relax.Expr, var2val: dict, depth: int = 0) -> bool:
    """Whether ``m`` holds finite values only, by construction: constants that are, chosen by where,
    moved by the layout operators of `_FINITE_THROUGH`."""
    m = var2val.get(m, m)
    if isinstance(m, tvm.ir.GenericConst):
        return bool(np.isfinite(m.value.numpy().astype(np.float64)).all())
    if depth > 16 or not isinstance(m, relax.Call):
        return False
    name = getattr(m.op, "name", "").removeprefix("relax.")
    if name == "where":
        return all(_finite(b, var2val, depth + 1) for b in m.args[1:])
    return name in _FINITE_THROUGH and _finite(m.args[0], var2val, depth + 1)
