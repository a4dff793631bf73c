"""Elementwise operators moved before the reshape that feeds them, in Relax before legalisation.

An exporter that runs a projection on 2-D rows (GPT-2's Conv1D: ``addmm`` on ``x.view(-1, d)``) hands
its output back as (B, n, m) through a reshape, and the activation after it (tanh-GELU) reads that
reshape. A reshape stays a view here (not legalised), and Relax's fusion does not fuse through it, so
the activation ran as a function of its own: the GEMM wrote its fp32 output, the activation read it
back. ``f(reshape(x, S), c)`` is ``reshape(f(x, c), S)`` where ``f`` is elementwise, the reshape
keeps the last axis, and every other operand is a scalar or a vector along that axis (it broadcasts
the same against either shape), another reshape of a tensor of x's shape to S, or a tensor of shape S
(a residual: read reshaped to x's shape, a view). Applied as the bindings come, a chain of such
operators moves whole, and the GEMM with its bias, activation and residual becomes one fused function.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from tvmattn.schedules.ops.layout import same_shape
from tvmattn.schedules.ops.rewrite import rewrite_functions

ELEMENTWISE = {f"relax.{name}" for name in (
    "add", "subtract", "multiply", "divide", "power", "maximum", "minimum",
    "tanh", "exp", "sigmoid", "erf", "sqrt", "rsqrt", "negative", "abs", "astype",
    "nn.gelu", "nn.gelu_tanh", "nn.silu", "nn.relu")}


@tvm.transform.module_pass(opt_level=0, name="tvmattn.ElementwiseBeforeReshapes")
def elementwise_before_reshapes(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    return relax.transform.DeadCodeElimination()(_Before(mod).run())


@relax.expr_functor.mutator
class _Before(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod_ = mod

    def run(self) -> tvm.IRModule:
        return rewrite_functions(self, self.mod_)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        moved = self._moved(value) if isinstance(value, relax.Call) else None
        if moved is None:
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
            return
        self.set_var_remap(binding.var, self.builder_.emit(moved))

    def _moved(self, call: relax.Call) -> relax.Expr | None:
        """``reshape(f(x, …), S)`` for ``call`` = ``f(reshape(x, S), …)``, or None."""
        if getattr(call.op, "name", "") not in ELEMENTWISE:
            return None
        sources, target, args = [], None, []
        for arg in call.args:
            reshaped = self._reshape_of(arg)
            if reshaped is None:
                args.append(None)  # (decided once the reshape is known)
                continue
            x, shape = reshaped
            if target is not None and not tvm_ffi.structural_equal(shape, target):
                return None
            target = shape
            sources.append(x)
            args.append(x)
        if not sources or any(not same_shape(x, sources[0].ty.shape) for x in sources[1:]):
            return None
        source_shape = sources[0].ty.shape
        for i, (arg, original) in enumerate(zip(args, call.args)):
            if arg is not None:
                continue
            if _along_last_axis(original, source_shape.values[-1]):
                args[i] = original
            elif same_shape(original, target):  # a tensor of the reshape's shape (a residual): a view
                args[i] = self.builder_.emit(relax.op.reshape(original, source_shape))
            else:
                return None
        inner = self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args))
        return relax.op.reshape(inner, target)

    def _reshape_of(self, expr: relax.Expr) -> tuple[relax.Expr, relax.Expr] | None:
        """(x, S) where ``expr`` is ``reshape(x, S)`` keeping x's last axis, x a tensor of known shape."""
        if not isinstance(expr, relax.Var):
            return None
        value = self.lookup_binding(expr)
        if not isinstance(value, relax.Call) or getattr(value.op, "name", "") != "relax.reshape":
            return None
        x, shape = value.args
        have = getattr(x.ty, "shape", None)
        want = shape.values if isinstance(shape, relax.ShapeExpr) else None
        if have is None or want is None or not hasattr(have, "values") or not have.values or not want:
            return None
        if not tvm.sym.Analyzer().can_prove_equal(have.values[-1], want[-1]):
            return None
        return x, shape


def _along_last_axis(arg: relax.Expr, last) -> bool:
    """A scalar, or a vector of ``last`` elements: it broadcasts along the last axis alone."""
    ty = arg.ty
    if not isinstance(ty, relax.TensorType) or ty.ndim == 0:
        return isinstance(ty, relax.TensorType)
    dims = getattr(ty.shape, "values", None)
    return ty.ndim == 1 and dims is not None and tvm.sym.Analyzer().can_prove_equal(dims[0], last)
