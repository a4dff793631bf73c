"""Exporters' spellings of a plain operation, rewritten to that operation before the attention patterns
run (`patterns.rewrite`), so that one pattern reads them all.

- A transpose of the last two axes through merged leading axes: ``reshape(permute_dims(reshape(x,
  (a·b, m, n)), (0, 2, 1)), (a, b, n, m))`` is ``permute_dims(x, (0, 1, 3, 2))``. torch's exporters
  write Kᵀ so when attention runs on (B·h, n, d) batches (``torch.bmm``; the SDPA export of a GQA
  model), and the pattern then saw a kᵀ that was no transpose of the keys.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvmattn.compiler.onnx.kernels import shape_of


def canonical(mod: tvm.IRModule, provenance: dict) -> tvm.IRModule:
    """``mod`` with the spellings above rewritten; ``provenance`` (value → ONNX node) follows the
    bindings whose values changed."""
    old = mod["main"]
    new = _Canonical(mod).run()
    before = {b.var: b.value for block in old.body.blocks for b in block.bindings}
    for block in new["main"].body.blocks:
        for b in block.bindings:
            was = before.get(b.var)
            if was is not None and not was.same_as(b.value) and was in provenance:
                provenance.setdefault(b.value, provenance[was])
    return new


@relax.expr_functor.mutator
class _Canonical(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod_ = mod
        self.var2val = relax.analysis.get_var2val(mod["main"])

    def run(self) -> tvm.IRModule:
        gvar = self.mod_.get_global_var("main")
        self.builder_.update_func(gvar, self.visit_expr(self.mod_["main"]))
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        x = _merged_transpose(call, self.var2val)
        if x is None:
            return call
        rank = len(shape_of(x, "a transposed tensor"))
        return relax.op.permute_dims(x, [*range(rank - 2), rank - 1, rank - 2])


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
