"""Einsums of two operands as batched matmuls, rewritten in Relax before legalisation.

TVM legalises ``einsum`` to one reduction block (`topi.einsum`) that no GEMM rule takes: LongT5's local
attention, ``...qhd,...khd->...hqk`` then ``...hqk,...khd->...qhd`` over blocks of tokens, ran on the
`reduce` rule at 4 GFLOP/s, half of that model's run. Where every index of a two-operand einsum is

    a batch index       in both operands and the output
    contracted          in both operands, not in the output
    free                in one operand and the output

(none repeated within an operand, each the same size wherever it appears, an ellipsis the same axes in
both operands) the einsum is

    A (batch, free_A, contracted) · B (batch, contracted, free_B)    each permuted, then reshaped to 3-D
    → (batch, free_A, free_B)                                          permuted to the output's order

the same products and sums, on the `matmul` rule. Other einsums (a diagonal, an index summed in one
operand only, broadcasting) stay TVM's.
"""

from __future__ import annotations

import functools
import string

import tvm
from tvm import relax

from tvmattn.schedules.ops.rewrite import dims, rewrite_functions


@tvm.transform.module_pass(opt_level=0, name="tvmattn.EinsumAsMatmul")
def einsum_as_matmul(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """The pass rewriting two-operand einsums of batch, contracted and free indices as matmuls."""
    return _Einsums(mod).run()


@relax.expr_functor.mutator
class _Einsums(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod_ = mod

    def run(self) -> tvm.IRModule:
        return rewrite_functions(self, self.mod_)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") != "relax.einsum":
            return call
        operands = call.args[0]
        operands = self.lookup_binding(operands) if isinstance(operands, relax.Var) else operands
        if not isinstance(operands, relax.Tuple) or len(operands.fields) != 2:
            return call
        a, b = operands.fields
        shapes = [dims(x) for x in (a, b)]
        if None in shapes or str(a.ty.dtype) != str(b.ty.dtype):
            return call
        plan = _plan(str(call.attrs.subscripts), *shapes)
        return call if plan is None else self._matmul(a, b, *plan)

    def _matmul(self, a: relax.Expr, b: relax.Expr, spec_a: str, spec_b: str, out: str, size: dict) -> relax.Expr:
        batch = [i for i in out if i in spec_a and i in spec_b]
        contracted = [i for i in spec_a if i in spec_b and i not in out]
        free_a = [i for i in spec_a if i not in spec_b]
        free_b = [i for i in spec_b if i not in spec_a]
        lead = [_product(size, batch)] if batch else []
        # A (batch, free_A, contracted) and B (batch, contracted, free_B), each as one matrix per batch
        x = self._arrange(a, spec_a, batch + free_a + contracted,
                          [*lead, _product(size, free_a), _product(size, contracted)])
        y = self._arrange(b, spec_b, batch + contracted + free_b,
                          [*lead, _product(size, contracted), _product(size, free_b)])
        product = self.builder_.emit(relax.op.matmul(x, y))
        order = batch + free_a + free_b
        product = self.builder_.emit(relax.op.reshape(product, [size[i] for i in order]))
        axes = [order.index(i) for i in out]
        return product if axes == sorted(axes) else relax.op.permute_dims(product, axes)

    def _arrange(self, x: relax.Expr, spec: str, order: list[str], shape: list) -> relax.Expr:
        axes = [spec.index(i) for i in order]
        if axes != list(range(len(axes))):
            x = self.builder_.emit(relax.op.permute_dims(x, axes))
        return self.builder_.emit(relax.op.reshape(x, shape))


def _plan(subscripts: str, shape_a: list, shape_b: list) -> tuple[str, str, str, dict] | None:
    """(A's indices, B's, the output's, each index's size) of an einsum ``subscripts`` over operands of
    these shapes, an ellipsis spelled out as letters of its own; None where it is no batched matmul."""
    if "->" not in subscripts or subscripts.count(",") != 1:
        return None
    inputs, out = subscripts.replace(" ", "").split("->")
    specs = inputs.split(",")
    if any(not set(s.replace("...", "")) <= set(string.ascii_letters) for s in (*specs, out)):
        return None
    spare = [c for c in string.ascii_letters if c not in subscripts]
    ellipses = {len(shape) - len(s.replace("...", "")) for s, shape in zip(specs, (shape_a, shape_b)) if "..." in s}
    if len(ellipses) > 1 or ("..." in out) != bool(ellipses) or any(n < 0 for n in ellipses):
        return None  # (an ellipsis of different ranks broadcasts)
    dots = "".join(spare[:next(iter(ellipses), 0)])
    spec_a, spec_b, out = (s.replace("...", dots) for s in (*specs, out))
    if any(len(set(s)) != len(s) for s in (spec_a, spec_b, out)) or not set(out) <= set(spec_a) | set(spec_b) \
            or any(len(s) != len(shape) for s, shape in ((spec_a, shape_a), (spec_b, shape_b))):
        return None
    if (set(spec_a) ^ set(spec_b)) - set(out):
        return None  # an index summed in one operand alone
    size: dict = {}
    analyzer = tvm.sym.Analyzer()
    for spec, shape in ((spec_a, shape_a), (spec_b, shape_b)):
        for index, dim in zip(spec, shape):
            if index in size and not analyzer.can_prove_equal(size[index], dim):
                return None  # (broadcast: a size 1 against another)
            size.setdefault(index, dim)
    return spec_a, spec_b, out, size


def _product(size: dict, indices: list[str]):
    return functools.reduce(lambda p, i: p * size[i], indices, tvm.tirx.IntImm("int64", 1))
