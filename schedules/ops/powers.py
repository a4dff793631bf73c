"""x ** 2 as x·x, rewritten in Relax before legalisation.

RMSNorm's x² arrives as ``power(x, const)`` with the exponent a 0-d tensor: a broadcasting op, which
Relax's fusion keeps out of the mean that reads it, so it ran as a function of its own, a scalar
``powf`` call per element that nothing vectorised (a Llama export's x² at 0.7 GB/s, 5 % of the
model). As ``x·x`` it is elementwise and fuses into the reduction. Higher powers stay: tanh-GELU's x³
already fuses into its GEMM's epilogue, where `passes.polynomial_math` multiplies it out, and as
products Relax's fusion split that epilogue off the GEMM.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

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
        return rewrite_functions(self, self.mod_)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") != "relax.power" or not isinstance(call.args[1], tvm.ir.GenericConst):
            return call
        k = call.args[1].value.numpy()
        if k.size != 1 or k.item() != 2 or not np.issubdtype(k.dtype, np.floating) \
                or k.ndim > len(call.args[0].ty.shape):  # (a broadcast that adds axes: not elementwise)
            return call
        return relax.op.multiply(call.args[0], call.args[0])
