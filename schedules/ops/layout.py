"""Layout changes that change nothing, removed in Relax before legalisation: transpositions that undo
each other, reshapes to the shape a tensor has, a concatenation of one tensor or of what another
concatenation already joined.

A convolution rewritten as a GEMM (`conv`) hands back its output channels-first, (B, C, T), as ONNX
has it; an export that normalises over channels (Wav2Vec2's feature extractor, Whisper's) transposes
it straight back to (B, T, C) for its LayerNorm, often through a reshape to the shape it already has.
Each such pair copied the whole activation twice (Wav2Vec2's first layer: 26 MB each way, 6 % of the
model). ``permute_dims(permute_dims(x, p), q)`` is ``permute_dims(x, p∘q)``, or ``x`` where that is
the identity; a reshape to its input's own shape is its input; and ``permute_dims(reshape(permute_dims(x,
p), S), q)`` that leaves every element where it was is a reshape of x (tokens viewed as an image for a
depthwise convolution computed channels last, `conv`, and flattened back to tokens by the model).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from tvmattn.schedules.ops.rewrite import rewrite_functions


@tvm.transform.module_pass(opt_level=0, name="tvmattn.CancelTransposes")
def cancel_transposes(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    return _CancelTransposes(mod).run()


@tvm.transform.module_pass(opt_level=0, name="tvmattn.SameConcats")
def same_concats(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Each concatenation of the same tensors computed once: the attention rewrite re-emits a kernel's
    K and V from the graph's expressions, and a decode step's cache concat ran twice, for the kernel
    and for the `present` output (the whole cache copied again). Concatenations only: Relax's
    common-subexpression pass also merged the cheap elementwise twins fusion recomputes inside each
    consumer, and materialised them (DeBERTa 1×512: 5 % slower)."""
    return relax.transform.DeadCodeElimination()(_SameConcats(mod).run())


@relax.expr_functor.mutator
class _SameConcats(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod_ = mod
        self.seen: list[tuple[relax.Call, relax.Var]] = []

    def run(self) -> tvm.IRModule:
        return rewrite_functions(self, self.mod_)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.concat":
            twin = next((var for call, var in self.seen if tvm_ffi.structural_equal(call, value)), None)
            if twin is not None:
                self.set_var_remap(binding.var, twin)
                return
            self.seen.append((value, binding.var))
        self.builder_.emit_normalized(relax.VarBinding(binding.var, value))


@relax.expr_functor.mutator
class _CancelTransposes(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod_ = mod

    def run(self) -> tvm.IRModule:
        return relax.transform.DeadCodeElimination()(rewrite_functions(self, self.mod_))

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = getattr(call.op, "name", "")
        if name == "relax.reshape" and same_shape(call.args[0], call.args[1]):
            return call.args[0]
        if name == "relax.concat" and isinstance(call.args[0], relax.Tuple) and len(call.args[0].fields) == 1:
            return call.args[0].fields[0]  # GPT-2's cat((past,)): a copy of the cache
        if name != "relax.permute_dims":
            return call
        inner = self._producer(call.args[0])
        if inner is None:
            return self._through_reshape(call)
        x, first = inner
        axes = [first[a] for a in _axes(call)]  # out axis j is inner's axis q[j], x's axis p[q[j]]
        if axes == list(range(len(axes))):
            return x
        return relax.op.permute_dims(x, axes)

    def _producer(self, var: relax.Expr) -> tuple[relax.Expr, list[int]] | None:
        """(x, p) where ``var`` is ``permute_dims(x, p)``, seen through reshapes to the same shape (one, or two
        that end where they began)."""
        while isinstance(var, relax.Var):
            value = self.lookup_binding(var)
            if isinstance(value, relax.Var):  # an alias (a reshape this pass removed)
                var = value
                continue
            if not isinstance(value, relax.Call):
                return None
            name = getattr(value.op, "name", "")
            before = self.lookup_binding(value.args[0]) if name == "relax.reshape" \
                and isinstance(value.args[0], relax.Var) else None
            if name == "relax.reshape" and same_shape(value.args[0], value.args[1]):
                var = value.args[0]
            elif isinstance(before, relax.Call) and getattr(before.op, "name", "") == "relax.reshape" \
                    and same_shape(before.args[0], value.args[1]):  # two reshapes that end where they began
                var = before.args[0]  # (SqueezeBERT's grouped convolution's heads merged, then viewed again)
            elif name == "relax.permute_dims":
                return value.args[0], _axes(value)
            else:
                return None
        return None

    def _through_reshape(self, call: relax.Call) -> relax.Expr:
        """``permute_dims(reshape(permute_dims(x, p), S), q)`` as ``reshape(x, …)`` where the three leave
        x's elements in their order: a depthwise convolution computed channels last and handed back
        channels-first (`conv`), flattened to (B, C, H·W) and transposed to tokens by the model."""
        bound = self.lookup_binding(call.args[0]) if isinstance(call.args[0], relax.Var) else None
        if not isinstance(bound, relax.Call) or getattr(bound.op, "name", "") != "relax.reshape":
            return call
        inner = self._producer(bound.args[0])
        if inner is None:
            return call
        x, first = inner
        have = [d for d in x.ty.shape.values] if isinstance(getattr(x.ty, "shape", None), relax.ShapeExpr) else None
        shaped = bound.ty.shape.values if isinstance(getattr(bound.ty, "shape", None), relax.ShapeExpr) else None
        if have is None or shaped is None:
            return call
        order = _element_order(have, first, list(shaped), _axes(call))
        if order is None or order != sorted(order):
            return call
        return relax.op.reshape(x, relax.ShapeExpr([shaped[a] for a in _axes(call)]))


def _element_order(dims: list, first: list[int], shape: list, second: list[int]) -> list[int] | None:
    """Where x's pieces end up after permute_dims(reshape(permute_dims(x, first), shape), second): x's
    dims (``dims``) and the reshape's split into common pieces (each axis of either a run of
    consecutive pieces; sizes of 1 dropped), numbered in x's order; the pieces' numbers in the result's
    order, or None where the reshape is no such regrouping (or a symbolic size is split)."""
    analyzer = tvm.sym.Analyzer()
    moved = [dims[a] for a in first]  # the reshape's input
    pieces_in: list[list[int]] = [[] for _ in moved]
    pieces_out: list[list[int]] = [[] for _ in shape]
    a = [(i, d) for i, d in enumerate(moved) if not (isinstance(d, tvm.tirx.IntImm) and d.value == 1)]
    b = [(j, d) for j, d in enumerate(shape) if not (isinstance(d, tvm.tirx.IntImm) and d.value == 1)]
    i = j = piece = 0
    left_a = a[0][1] if a else None
    left_b = b[0][1] if b else None
    while i < len(a) and j < len(b):
        if analyzer.can_prove_equal(left_a, left_b):
            size_a = size_b = None
        elif all(isinstance(d, tvm.tirx.IntImm) for d in (left_a, left_b)) and left_b.value % left_a.value == 0:
            size_a, size_b = None, tvm.tirx.IntImm("int64", left_b.value // left_a.value)
        elif all(isinstance(d, tvm.tirx.IntImm) for d in (left_a, left_b)) and left_a.value % left_b.value == 0:
            size_a, size_b = tvm.tirx.IntImm("int64", left_a.value // left_b.value), None
        else:
            return None
        pieces_in[a[i][0]].append(piece)
        pieces_out[b[j][0]].append(piece)
        piece += 1
        if size_a is None:
            i += 1
            left_a = a[i][1] if i < len(a) else None
        else:
            left_a = size_a
        if size_b is None:
            j += 1
            left_b = b[j][1] if j < len(b) else None
        else:
            left_b = size_b
    if i < len(a) or j < len(b):
        return None
    # x's axis k is the reshape input's axis first.index(k): number the pieces in x's order
    number = {p: n for n, p in enumerate(p for k in range(len(dims)) for p in pieces_in[first.index(k)])}
    return [number[p] for axis in second for p in pieces_out[axis]]


def _axes(call: relax.Call) -> list[int]:
    ndim = len(call.args[0].ty.shape)
    axes = call.attrs.axes
    return list(range(ndim))[::-1] if axes is None else [int(a) % ndim for a in axes]


def same_shape(x: relax.Expr, shape: relax.Expr) -> bool:
    """Whether reshaping ``x`` to ``shape`` leaves it as it is (every dimension provably equal)."""
    have = getattr(x.ty, "shape", None)
    want = shape.values if isinstance(shape, relax.ShapeExpr) else getattr(shape.ty, "values", None)
    if have is None or want is None or not hasattr(have, "values") or len(have.values) != len(want):
        return False
    analyzer = tvm.sym.Analyzer()
    return all(analyzer.can_prove_equal(a, b) for a, b in zip(have.values, want))
