"""An imported model's matrix products in 16 bits: `import_onnx(..., dtype="bfloat16")` (or "float16").

Each matmul by a constant weight (a projection, an MLP, a convolution's GEMM, the LM head) reads its
weight converted once, at compile time, and its activations converted as they are produced (the cast
fuses into the producer's epilogue: a LayerNorm, a GELU), and accumulates in fp32: the `matmul` rule
then runs it on the bf16 dot products where the CPU has them, and a one-token step streams half the
bytes. Everything else stays in fp32: norms' statistics, softmax, residual sums, the elementwise
chains (as OpenVINO keeps them: its bf16 inference precision applies to convolutions and matmuls). A
product that only a LayerNorm reads is stored in bf16 for it (`_NormInputs`; not fp16, whose range is not fp32's).
"""

from __future__ import annotations

import collections

import ml_dtypes
import numpy as np
import tvm
from tvm import relax, te, topi

from tvmattn.compiler.annotations import OP_PATTERN, OUT_ELEMWISE_FUSABLE
from tvmattn.compiler.isa.record import Tiles
from tvmattn.schedules.cpu.plan import MIN_PAIR_ROWS
from tvmattn.schedules.ops.rewrite import readers, rewrite_functions

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def matmuls_in(dtype: str, dot_lanes: int | None = None, tiles: Tiles | None = None) -> tvm.transform.Pass:
    """The pass converting a module's constant-weight matmuls to ``dtype`` operands, fp32 results; and,
    in bf16 on a target with a bf16 dot product of ``dot_lanes`` lanes, activation × activation ones
    the `matmul_bf16` rule takes (`_dot_shaped`). With ``tiles`` (bf16), a reduction that is not whole
    tile steps is padded to them (`_Matmuls._padded`)."""

    @tvm.transform.module_pass(opt_level=0, name=f"tvmattn.MatmulsIn_{dtype}")
    def transform(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        bf16 = dtype == "bfloat16"
        mod = _Matmuls(mod, dtype, dot_lanes if bf16 else None, tiles if bf16 and dot_lanes else None).run()
        return _NormInputs(mod, dtype).run() if bf16 else mod  # (fp16's range would overflow where fp32's does not)

    return transform


def _dot_shaped(x: relax.Expr, y: relax.Expr, lanes: int) -> bool:
    """x (…, s, c) · y (…, c, m) with c even, m whole vectors of ``lanes`` and s symbolic or at least
    `MIN_PAIR_ROWS`: the bf16 dot product's shape (DeBERTa's query × positional keys). Elsewhere a
    bf16 product would be widened back to fp32 FMAs: the rounding without the speed."""
    dims = [getattr(getattr(e.ty, "shape", None), "values", None) for e in (x, y)]
    if any(d is None or len(d) < 2 for d in dims) or str(getattr(y.ty, "dtype", "")) != "float32":
        return False
    (s, c), (c2, m) = dims[0][-2:], dims[1][-2:]
    static = all(isinstance(d, tvm.tirx.IntImm) for d in (c, c2, m))
    return static and int(c) % 2 == 0 and int(m) % lanes == 0 and \
        not (isinstance(s, tvm.tirx.IntImm) and int(s) < MIN_PAIR_ROWS)


@relax.expr_functor.mutator
class _Matmuls(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, dtype: str, dot_lanes: int | None, tiles: Tiles | None = None) -> None:
        super().__init__(mod)
        self.mod_, self.dtype, self.dot_lanes, self.tiles = mod, dtype, dot_lanes, tiles
        self.casts: dict = {}  # an activation → its one cast (Q, K and V read one normed x)

    def run(self) -> tvm.IRModule:
        return rewrite_functions(self, self.mod_)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") == "relax.astype":
            return self._round_trip(call)
        if getattr(call.op, "name", "") != "relax.matmul":
            return call
        x, w = call.args
        value = self._constant(w)
        if value is None and self.dot_lanes and str(getattr(x.ty, "dtype", "")) == "float32" \
                and _dot_shaped(x, w, self.dot_lanes):
            return relax.op.matmul(self._cast(x), self._cast(w), out_dtype="float32")
        if value is None or value.dtype != np.float32 or value.ndim < 2 \
                or str(getattr(x.ty, "dtype", "")) != "float32":
            return call
        x, value = self._padded(self._cast(x), value)
        width = value.shape[-1]
        value = self._widened(x, value)
        y = relax.op.matmul(x, relax.const(value.astype(DTYPES[self.dtype]), self.dtype), out_dtype="float32")
        if value.shape[-1] == width:
            return y
        y = self.builder_.emit(y)
        return relax.op.strided_slice(y, axes=[len(y.ty.shape) - 1], begin=[0], end=[width])

    def _padded(self, x: relax.Expr, w: np.ndarray) -> tuple[relax.Expr, np.ndarray]:
        """x (…, s, c) and w (c, m) with c padded by zeros to whole tile steps, where the rest of the
        product is the tiles' shape (m whole blocks, s not a decode step's few rows) and c is not:
        Whisper's first convolution (c = 3·80 mel bins = 240) ran on the dot products at a sixth of
        the tiles' rate. The zero columns of x are written by x's producer, which the pad joins."""
        c, m = w.shape[-2:]
        dims = getattr(getattr(x.ty, "shape", None), "values", None)
        if self.tiles is None or w.ndim != 2 or dims is None or len(dims) < 2 or c % self.tiles.step == 0 \
                or c % 2 or m % self.tiles.block or c < self.tiles.step:
            return x, w
        s = dims[-2]
        if isinstance(s, tvm.tirx.IntImm) and int(s) < MIN_PAIR_ROWS:
            return x, w
        pad = -c % self.tiles.step
        x = self.builder_.emit(relax.op.nn.pad(x, [0] * (2 * len(dims) - 1) + [pad]))
        return x, np.concatenate([w, np.zeros((pad, m), w.dtype)])

    def _widened(self, x: relax.Expr, w: np.ndarray) -> np.ndarray:
        """w (…, c, m) with m padded by zero columns to whole tile blocks, where the rest of the product
        is the tiles' shape (c whole steps, s not a decode step's few rows) and m is not, by a half at
        most: the tiles compute the zero columns too, at 4–5 times `vdpbf16ps`'s rate (Wav2Vec2's
        positional convolution, 16 groups of 16 columns: 2.0 → 1.45 ms in the run), and the caller slices them
        off (a view its consumer reads, or a copy of the output)."""
        c, m = w.shape[-2:]
        dims = getattr(getattr(x.ty, "shape", None), "values", None)
        if self.tiles is None or dims is None or len(dims) < 2 or c % self.tiles.step or m % self.dot_lanes:
            return w
        wide = -(-m // self.tiles.block) * self.tiles.block
        s = dims[-2]
        if wide == m or 2 * m < wide or isinstance(s, tvm.tirx.IntImm) and int(s) < MIN_PAIR_ROWS:
            return w
        return np.concatenate([w, np.zeros((*w.shape[:-1], wide - m), w.dtype)], axis=-1)

    def _constant(self, w: relax.Expr) -> np.ndarray | None:
        """The weight's values: a constant, or one transposed (ONNX ``Gemm`` with ``transB``: OPT's
        and other 2-D exports' MLPs) — folded here, before constant folding would."""
        if isinstance(w, tvm.ir.GenericConst):
            return w.value.numpy()
        bound = self.lookup_binding(w) if isinstance(w, relax.Var) else None
        if isinstance(bound, relax.Call) and getattr(bound.op, "name", "") == "relax.permute_dims" \
                and isinstance(bound.args[0], tvm.ir.GenericConst):
            value = bound.args[0].value.numpy()
            axes = bound.attrs.axes
            return np.ascontiguousarray(value.transpose(None if axes is None else [int(a) for a in axes]))
        return None

    def _cast(self, x: relax.Expr) -> relax.Expr:
        """``x`` in 16 bits, cast before the reshapes that lead to it: a reshape is a view, not a
        function, and a cast behind one ran as a kernel of its own instead of in its producer's
        epilogue (a decode step's LayerNorm → (1, 1, d) → (1, d) → cast: 13 more kernels a step); or
        the 16-bit values that ``x`` widens."""
        if x not in self.casts:
            value = self.lookup_binding(x) if isinstance(x, relax.Var) else None
            op = getattr(value.op, "name", "") if isinstance(value, relax.Call) else ""
            if op == "relax.reshape" and str(getattr(value.args[0].ty, "dtype", "")) == "float32":
                self.casts[x] = self.builder_.emit(relax.op.reshape(self._cast(value.args[0]), value.args[1]))
            elif op == "relax.astype" and str(getattr(value.args[0].ty, "dtype", "")) == self.dtype:
                self.casts[x] = value.args[0]  # a widening of ``dtype`` values (`conv`'s copy): exact both ways
            else:
                self.casts[x] = self.builder_.emit(relax.op.astype(x, self.dtype))
        return self.casts[x]

    def _round_trip(self, call: relax.Call) -> relax.Expr:
        """astype(astype(z, float32), dtype) of a ``dtype`` z is z (exact), through any reshapes between
        them (views): a 16-bit KV cache the graph reads widened (`onnx.cache16`), reshaped by the
        exporter (BLOOM's (h, n, d) ↔ (1, h, n, d)), and the 16-bit attention kernel narrows again."""
        x, shape = call.args[0], None
        inner = self.lookup_binding(x) if isinstance(x, relax.Var) else None
        while isinstance(inner, relax.Call) and getattr(inner.op, "name", "") == "relax.reshape":
            shape = shape or inner.args[1]  # the last reshape's is the one the cast's result has
            x = inner.args[0]
            inner = self.lookup_binding(x) if isinstance(x, relax.Var) else None
        if isinstance(inner, relax.Call) and getattr(inner.op, "name", "") == "relax.astype" \
                and str(call.ty.dtype) == self.dtype == str(inner.args[0].ty.dtype) \
                and str(x.ty.dtype) == "float32":
            z = inner.args[0]
            return z if shape is None else self.builder_.emit(relax.op.reshape(z, shape))
        return call


@relax.expr_functor.mutator
class _NormInputs(relax.PyExprMutator):
    """A LayerNorm whose input is a bf16 product's fp32 result that nothing else reads (a convolution
    front end's: Wav2Vec2's seven, each GEMM → LayerNorm → GELU) reads it rounded to bf16: the
    product stores half the bytes and the norm reads half, its statistics still summed in fp32 (as
    OpenVINO's convolutions hand MVN bf16). A norm of a residual sum keeps fp32 (its input is an add)."""

    def __init__(self, mod: tvm.IRModule, dtype: str) -> None:
        super().__init__(mod)
        self.mod_, self.dtype, self.uses = mod, dtype, collections.Counter()

    def run(self) -> tvm.IRModule:
        for func in self.mod_.functions.values():
            if isinstance(func, relax.Function):
                self.uses.update(readers(func))
        return rewrite_functions(self, self.mod_)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if getattr(call.op, "name", "") != "relax.nn.layer_norm" or not call.attrs.center or not call.attrs.scale:
            return super().visit_call_(call)
        x, gamma, beta = call.args
        chain = self._product_alone(x)
        if chain is None or any(str(getattr(e.ty, "dtype", "")) != "float32" for e in (gamma, beta)):
            return super().visit_call_(call)
        product, *slices = chain
        narrow = self.builder_.emit(relax.op.astype(self.visit_expr(product), self.dtype))
        for sliced in slices:  # the cast before the slice: it joins the GEMM's epilogue, a slice's consumer did not
            narrow = self.builder_.emit(relax.Call(sliced.op, [narrow, *sliced.args[1:]], sliced.attrs))
        norm = self.builder_.call_te(_layer_norm_widened, narrow, self.visit_expr(gamma), self.visit_expr(beta),
                                     [int(a) for a in call.attrs.axes], float(call.attrs.epsilon),
                                     primfunc_name_hint="layer_norm")
        gvar = norm.args[0]  # TOPI's LayerNorm's pattern: its GELU fuses in (not bound to a var of its own,
        self.builder_.update_func(gvar, self.builder_.get()[gvar].with_attr(OP_PATTERN, OUT_ELEMWISE_FUSABLE))
        return norm  # which FuseOps does not see through)

    def _product_alone(self, x: relax.Expr) -> list | None:
        """[the fp32 result of a 16-bit matmul, the row slices after it] where ``x`` is that product (or
        a slice of it: padded rows off) and nothing else reads it; else None."""
        slices = []
        while isinstance(x, relax.Var) and self.uses[x] == 1:
            bound = self.lookup_binding(x)
            op = getattr(bound.op, "name", "") if isinstance(bound, relax.Call) else ""
            if isinstance(bound, relax.Var) or op == "relax.strided_slice":
                x = bound if isinstance(bound, relax.Var) else bound.args[0]
                slices = slices if isinstance(bound, relax.Var) else [bound, *slices]
                continue
            if op == "relax.matmul" and str(bound.ty.dtype) == "float32" \
                    and all(str(a.ty.dtype) == self.dtype for a in bound.args):
                return [x, *slices]
            return None
        return None


def _layer_norm_widened(x: te.Tensor, gamma: te.Tensor, beta: te.Tensor, axes: list[int], epsilon: float) -> te.Tensor:
    """TOPI's LayerNorm of 16-bit x, each element widened to fp32 as it is read."""
    wide = te.compute(x.shape, lambda *i: x(*i).astype("float32"), name="widen")
    return topi.nn.layer_norm(wide, gamma, beta, axis=axes, epsilon=epsilon)
