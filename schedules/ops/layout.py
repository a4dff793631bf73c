"""Layout changes that change nothing, removed in Relax before legalisation: transpositions that undo
each other, reshapes to the shape a tensor has, a concatenation of one tensor or of what another
concatenation already joined.

A convolution rewritten as a GEMM (`conv`) hands back its output channels-first, (B, C, T), as ONNX
has it; an export that normalises over channels (Wav2Vec2's feature extractor, Whisper's) transposes
it straight back to (B, T, C) for its LayerNorm, often through a reshape to the shape it already has.
Each such pair copied the whole activation twice (Wav2Vec2's first layer: 26 MB each way, 6 % of the
model). ``permute_dims(permute_dims(x, p), q)`` is ``permute_dims(x, p∘q)``, or ``x`` where that is
the identity; a reshape to its input's own shape is its input.
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
            return call
        x, first = inner
        axes = [first[a] for a in _axes(call)]  # out axis j is inner's axis q[j], x's axis p[q[j]]
        if axes == list(range(len(axes))):
            return x
        return relax.op.permute_dims(x, axes)

    def _producer(self, var: relax.Expr) -> tuple[relax.Expr, list[int]] | None:
        """(x, p) where ``var`` is ``permute_dims(x, p)``, seen through reshapes to the same shape."""
        while isinstance(var, relax.Var):
            value = self.lookup_binding(var)
            if isinstance(value, relax.Var):  # an alias (a reshape this pass removed)
                var = value
                continue
            if not isinstance(value, relax.Call):
                return None
            name = getattr(value.op, "name", "")
            if name == "relax.reshape" and same_shape(value.args[0], value.args[1]):
                var = value.args[0]
            elif name == "relax.permute_dims":
                return value.args[0], _axes(value)
            else:
                return None
        return None


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
