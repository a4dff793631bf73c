"""Elementwise operators moved before the reshape that feeds them, in Relax before legalisation.

An exporter that runs a projection on 2-D rows (GPT-2's Conv1D: ``addmm`` on ``x.view(-1, d)``) hands
its output back as (B, n, m) through a reshape, and the activation after it (tanh-GELU) reads that
reshape. A reshape stays a view here (not legalised), and Relax's fusion does not fuse through it, so
the activation ran as a function of its own: the GEMM wrote its fp32 output, the activation read it
back. ``f(reshape(x, S), c)`` is ``reshape(f(x, c), S)`` where ``f`` is elementwise and every other
operand is a scalar, a vector along the last axis where the reshape keeps that axis (it broadcasts
the same against either shape), another reshape of a tensor of x's shape to S, a tensor of shape S
(a residual: read reshaped to x's shape, a view), or a constant along axes of S that merge static axes
of x (a grouped convolution's bias a channel, its channels the groups' merged: split back at import,
`_through_reshape`; SqueezeBERT's Q, K and V then leave their GEMM as heads, its transpositions cancel).
A lone operand moves through any reshape: a BERT export's Q, K and V projections, split into heads and
cast to bf16 for the attention kernel, store bf16 from their GEMM's epilogue rather than fp32 for a
cast of their own. Applied as the bindings come, a chain of such operators moves whole, and the GEMM
with its bias, activation and residual becomes one fused function.

The same for a transposition: ``f(permute_dims(x, p), c)`` is ``permute_dims(f(x, c'), p)`` where every
other operand is a scalar, the same transposition of a tensor, or a constant (c' its values broadcast
to x's rank and transposed back, at import). A convolution hands its output back channels-first
(`conv`), and Whisper's bias and GELU ran there, between it and the transposition back that the next
convolution's or LayerNorm's channels-last input needs: moved before it, they join the GEMM's
epilogue and the two transpositions cancel (`layout.cancel_transposes`, after this pass).
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx

from tvmattn.compiler.annotations import INJECTIVE, OP_PATTERN, OUT_ELEMWISE_FUSABLE
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
        """``reshape(f(x, …), S)`` for ``call`` = ``f(reshape(x, S), …)`` (or the same through a
        transposition, `_transposed`), or None."""
        if getattr(call.op, "name", "") not in ELEMENTWISE:
            return None
        if any(self._permute_of(arg) is not None for arg in call.args):
            return self._transposed(call)
        sources, target, args, keeps_last = [], None, [], True
        for arg in call.args:
            reshaped = None if self._constant(arg) is not None else self._reshape_of(arg)  # (a bias: below)
            if reshaped is None:
                args.append(None)  # (decided once the reshape is known)
                continue
            x, shape, last = reshaped
            keeps_last = keeps_last and last
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
            if _along_last_axis(original, source_shape.values[-1] if keeps_last else None):
                args[i] = original
                continue
            if same_shape(original, target):  # a tensor of the reshape's shape (a residual): a view
                args[i] = self.builder_.emit(relax.op.reshape(original, source_shape))
                continue
            constant = self._constant(original)  # along merged axes (a grouped convolution's bias a channel)
            back = None if constant is None else _through_reshape(constant, source_shape.values, target.values)
            if back is None:
                return None
            args[i] = relax.const(back, str(constant.dtype))
        inner = relax.Call(call.op, args, call.attrs, call.ty_args)
        # through a transposition under the reshape (a grouped convolution's output); not `_moved`, whose
        # reshape path would move it back through the view of a residual emitted above, without end
        again = self._transposed(inner) if any(self._permute_of(a) is not None for a in args) else None
        inner = self.builder_.emit(inner if again is None else again)
        return relax.op.reshape(inner, target)

    def _transposed(self, call: relax.Call) -> relax.Expr | None:
        """``permute_dims(f(x, …), p)`` for ``call`` = ``f(permute_dims(x, p), …)``, or None."""
        axes, args = None, []
        for arg in call.args:
            permuted = self._permute_of(arg)
            if permuted is not None:
                x, p = permuted
                if axes is not None and p != axes or not self._joins_producer(x):
                    return None
                axes = p
                args.append(x)
                continue
            ty = arg.ty
            if isinstance(ty, relax.TensorType) and ty.ndim == 0:
                args.append(arg)
                continue
            value = self._constant(arg)
            if value is None:
                return None
            args.append(value)  # (transposed back once the axes are known)
        inverse = list(np.argsort(axes))
        for i, arg in enumerate(args):
            if isinstance(arg, np.ndarray):
                if arg.ndim > len(axes):
                    return None
                full = arg.reshape((1,) * (len(axes) - arg.ndim) + arg.shape)
                args[i] = relax.const(np.ascontiguousarray(full.transpose(inverse)), str(arg.dtype))
        inner = relax.Call(call.op, args, call.attrs, call.ty_args)
        # x itself transposed (Whisper's GELU back to channels-last, then the position embedding added):
        # moved again, so that the two transpositions meet and cancel
        again = self._moved(inner)
        inner = self.builder_.emit(inner if again is None else again)
        return relax.op.permute_dims(inner, axes)

    def _joins_producer(self, x: relax.Expr) -> bool:
        """Whether ``x`` comes from a function whose epilogue an operator moved before the transposition
        joins: a GEMM (a convolution's, or its slice of padded rows, `conv`) or a norm, through
        elementwise operators or those this pass moved. Wav2Vec2's feature extractor normalises
        channels-last between its convolutions, then transposes, applies GELU, and the next convolution
        transposes back: moved, the GELU (and the 16-bit conversion, `conv`) runs once per element in
        the LayerNorm, not per tap in the next convolution's copy, and that copy moves 16-bit values."""
        value = self._bound(x)
        if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir":
            # a function of TE's making (a depthwise convolution, `conv`: no pattern until legalisation
            # annotates it), not a kernel (opaque)
            func = self.mod_[value.args[0]]
            return int((func.attrs or {}).get(OP_PATTERN, INJECTIVE)) <= OUT_ELEMWISE_FUSABLE
        return isinstance(value, relax.Call) and getattr(value.op, "name", "") in (
            ELEMENTWISE | {"relax.matmul", "relax.permute_dims", "relax.strided_slice", "relax.nn.layer_norm",
                           "relax.nn.rms_norm"})

    def _permute_of(self, expr: relax.Expr) -> tuple[relax.Expr, list[int]] | None:
        """(x, p) where ``expr`` is ``permute_dims(x, p)`` with its axes given, through aliases."""
        value = self._bound(expr)
        if not isinstance(value, relax.Call) or getattr(value.op, "name", "") != "relax.permute_dims" \
                or value.attrs.axes is None:
            return None
        return value.args[0], [int(a) for a in value.attrs.axes]

    def _constant(self, expr: relax.Expr) -> np.ndarray | None:
        """The values of a constant, or of a reshape of one (an ONNX bias shaped to broadcast)."""
        if isinstance(expr, tvm.ir.GenericConst):
            return expr.value.numpy()
        value = self._bound(expr)
        if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.reshape" \
                and isinstance(value.args[0], tvm.ir.GenericConst) and isinstance(value.args[1], relax.ShapeExpr):
            return value.args[0].value.numpy().reshape([int(d) for d in value.args[1].values])
        return None

    def _bound(self, expr: relax.Expr):
        """What a variable is bound to, through bindings of one variable to another."""
        seen = 0
        while isinstance(expr, relax.Var) and seen < 16:
            value = self.lookup_binding(expr)
            if not isinstance(value, relax.Var):
                return value
            expr, seen = value, seen + 1
        return None

    def _reshape_of(self, expr: relax.Expr) -> tuple[relax.Expr, relax.Expr, bool] | None:
        """(x, S, whether S keeps x's last axis) where ``expr`` is ``reshape(x, S)``, x a tensor of known
        shape."""
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
        return x, shape, tvm.sym.Analyzer().can_prove_equal(have.values[-1], want[-1])


def _through_reshape(c: np.ndarray, source: list, target: list) -> np.ndarray | None:
    """``c`` (broadcasting against ``target``) as it broadcasts against ``source`` where each of ``target``'s
    axes is one of ``source``'s or merges a run of its static ones: an axis c has whole is split into the
    run's sizes, one it broadcasts is 1s over the run; None where the shapes are no such regrouping."""
    if c.ndim > len(target):
        return None
    c = c.reshape((1,) * (len(target) - c.ndim) + c.shape)
    analyzer, out, i = tvm.sym.Analyzer(), [], 0
    for j, want in enumerate(target):
        if i < len(source) and analyzer.can_prove_equal(source[i], want):
            run, i = [source[i]], i + 1
        else:
            run, size = [], 1
            while i < len(source) and isinstance(source[i], tirx.IntImm) and isinstance(want, tirx.IntImm) \
                    and size < int(want.value):
                run, size, i = run + [source[i]], size * int(source[i].value), i + 1
            if not run or not isinstance(want, tirx.IntImm) or size != int(want.value):
                return None
        if c.shape[j] == 1:
            out += [1] * len(run)
        elif all(isinstance(d, tirx.IntImm) for d in run) and int(np.prod([int(d.value) for d in run])) == c.shape[j]:
            out += [int(d.value) for d in run]
        else:
            return None
    return np.ascontiguousarray(c.reshape(out)) if i == len(source) else None


def _along_last_axis(arg: relax.Expr, last) -> bool:
    """A scalar, or a vector of ``last`` elements (None: a reshape that splits the last axis, which no
    vector broadcasts along the same way on both sides): it broadcasts along the last axis alone."""
    ty = arg.ty
    if not isinstance(ty, relax.TensorType) or ty.ndim == 0:
        return isinstance(ty, relax.TensorType)
    dims = getattr(ty.shape, "values", None)
    return (ty.ndim == 1 and last is not None and dims is not None
            and tvm.sym.Analyzer().can_prove_equal(dims[0], last))
