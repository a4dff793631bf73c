"""An imported model's matrix products in 16 bits: `import_onnx(..., dtype="bfloat16")` (or "float16").

Each matmul by a constant weight (a projection, an MLP, a convolution's GEMM, the LM head) reads its
weight converted once, at compile time, and its activations converted as they are produced (the cast
fuses into the producer's epilogue: a LayerNorm, a GELU), and accumulates in fp32: the `matmul` rule
then runs it on the bf16 dot products where the CPU has them, and a one-token step streams half the
bytes. Everything else stays in fp32: norms' statistics, softmax, residual sums, the elementwise
chains (as OpenVINO keeps them: its bf16 inference precision applies to convolutions and matmuls).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tvm
from tvm import relax

from tvmattn.schedules.ops.rewrite import rewrite_functions

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def matmuls_in(dtype: str) -> tvm.transform.Pass:
    """The pass converting a module's constant-weight matmuls to ``dtype`` operands, fp32 results."""

    @tvm.transform.module_pass(opt_level=0, name=f"tvmattn.MatmulsIn_{dtype}")
    def transform(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return _Matmuls(mod, dtype).run()

    return transform


@relax.expr_functor.mutator
class _Matmuls(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, dtype: str) -> None:
        super().__init__(mod)
        self.mod_, self.dtype = mod, dtype
        self.casts: dict = {}  # an activation → its one cast (Q, K and V read one normed x)

    def run(self) -> tvm.IRModule:
        return rewrite_functions(self, self.mod_)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") != "relax.matmul":
            return call
        x, w = call.args
        if not isinstance(w, tvm.ir.GenericConst) or str(w.value.dtype) != "float32" or w.value.ndim < 2 \
                or str(getattr(x.ty, "dtype", "")) != "float32":
            return call
        weight = relax.const(w.value.numpy().astype(DTYPES[self.dtype]), self.dtype)
        if x not in self.casts:
            self.casts[x] = self.builder_.emit(relax.op.astype(x, self.dtype))
        return relax.op.matmul(self.casts[x], weight, out_dtype="float32")
