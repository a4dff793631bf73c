"""x ** 2 as x·x, and RMSNorm's mean of squares as one reduction, rewritten in Relax before legalisation.

RMSNorm's x² arrives as ``power(x, const)`` with the exponent a 0-d tensor: a broadcasting op, which
ran as a function of its own, a scalar ``powf`` call per element that nothing vectorised (a Llama
export's x² at 0.7 GB/s, 5 % of the model). As ``x·x`` it is elementwise, but Relax's fusion fuses
nothing into a reduction that reads it: x·x still wrote a tensor of its own for the mean to read
back. ``mean(x·x)`` over the last axis is therefore one reduction of squares (`_mean_of_squares`, the
mean's own sum-then-divide with x·x inside), into which the norm's epilogue fuses as into the mean.
Higher powers stay: tanh-GELU's x³ already fuses into its GEMM's epilogue, where
`passes.polynomial_math` multiplies it out, and as products Relax's fusion split that epilogue off the GEMM.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx

from tvmattn.schedules.ops.rewrite import rewrite_functions


@tvm.transform.module_pass(opt_level=0, name="tvmattn.SmallPowers")
def small_powers(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    return _SmallPowers(mod).run()


@relax.expr_functor.mutator
class _SmallPowers(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod_ = mod

    def run(self) -> tvm.IRModule:
        return relax.transform.DeadCodeElimination()(rewrite_functions(self, self.mod_))

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") == "relax.mean":
            fused = self._mean_of_squares(call)
            return call if fused is None else fused
        if getattr(call.op, "name", "") != "relax.power" or not isinstance(call.args[1], tvm.ir.GenericConst):
            return call
        k = call.args[1].value.numpy()
        if k.size != 1 or k.item() != 2 or not np.issubdtype(k.dtype, np.floating) \
                or k.ndim > len(call.args[0].ty.shape):  # (a broadcast that adds axes: not elementwise)
            return call
        return relax.op.multiply(call.args[0], call.args[0])

    def _mean_of_squares(self, mean: relax.Call) -> relax.Expr | None:
        """``mean(x·x)`` over x's last axis as one reduction, else None."""
        square = self.lookup_binding(mean.args[0]) if isinstance(mean.args[0], relax.Var) else None
        if not (isinstance(square, relax.Call) and getattr(square.op, "name", "") == "relax.multiply"
                and square.args[0].same_as(square.args[1])):
            return None
        x = square.args[0]
        rank = len(x.ty.shape)
        axes = [int(a) % rank for a in mean.attrs.axis] if mean.attrs.axis is not None else list(range(rank))
        if axes != [rank - 1]:
            return None
        return self.builder_.call_te(_mean_of_squares, x, bool(mean.attrs.keepdims),
                                     primfunc_name_hint="mean_of_squares")


def _mean_of_squares(x: te.Tensor, keepdims: bool) -> te.Tensor:
    """mean(x·x) over the last axis, as TOPI's mean computes it: the sum (of x·x, in x's dtype), then
    divided by the axis' length."""
    *lead, n = x.shape
    k = te.reduce_axis((0, n), name="k")
    shape = (*lead, 1) if keepdims else tuple(lead)
    sums = te.compute(shape, lambda *i: te.sum(x[(*i[:len(lead)], k)] * x[(*i[:len(lead)], k)], axis=k),
                      name="x_red")
    return te.compute(shape, lambda *i: sums(*i) / tirx.Cast(x.dtype, n), name="T_divide")
