"""A function's composite sizes as size variables of their own, before a rule schedules it.

After fusion a function's buffers can be sized by expressions of the model's sizes: a convolution
chain's ``(seq - 400) // 320 + 1`` frames, its padding's ``L + 64 + 64 - 127``. TVM's arithmetic
cannot prove such an expression non-negative (it may be, for a short input), so a loop split over it
gets guarded, non-constant extents; the GEMM rule's register tiles then could not be unrolled and
Wav2Vec2 did not compile. A buffer dimension is never negative: named by a variable that the
function binds from the buffer's shape at run time, each such expression (and every loop extent
provably equal to it) is the plain symbolic length every rule takes.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from tvmattn.compiler.passes import substitute

_COMPOSITE = (tirx.Add, tirx.Sub, tirx.Mul, tirx.FloorDiv, tirx.FloorMod, tirx.Div, tirx.Mod, tirx.Min, tirx.Max)


def named_sizes(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with each composite dimension of its parameters' buffers a variable of its own."""
    analyzer = tvm.sym.Analyzer()
    names: list[tuple[tirx.PrimExpr, tirx.Var]] = []

    def name(dim):
        if not isinstance(dim, _COMPOSITE) or "int" not in str(dim.ty):
            return dim
        for value, var in names:
            if analyzer.can_prove_equal(dim, value):
                return var
        var = tirx.Var(f"size_{len(names)}", str(dim.ty))
        names.append((dim, var))
        return var

    params = [p for p in func.params if hasattr(p.ty, "shape")]
    for p in params:
        for d in p.ty.shape:
            name(d)
    if not names:
        return func

    def replace(node):  # children first: a parent may read ``size_0 - 1 + 1`` by now, so compare its value
        if "int" not in str(node.ty):
            return node
        whole = substitute(node, {var: value for value, var in names})
        return next((var for value, var in names if analyzer.can_prove_equal(whole, value)), node)

    return tvm_ffi.structural_map(func, [(_COMPOSITE, replace)])
