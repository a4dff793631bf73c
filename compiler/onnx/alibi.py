"""ALiBi in an imported graph: a bias on the scores proved to be a per-head slope times the key's position,
put on the kernel's variant (`AttentionSpec.alibi`), so that the kernel reads h slopes and no bias.

BLOOM (and Falcon with ALiBi) writes it as ``slopes[:, None, None] · arange(n_kv)``, a constant per head
times the key index as a float, tiled over the batch to the (B·h, 1, n_kv) batches it adds to the
scores with ``baddbmm``; MPT adds ``slopes · (arange(n_kv) − n_kv + 1)`` to the (B, h, n, n_kv) scores.
`slopes` reads the bias at each head h (a symbolic batch, query i and key j; `positions.rule`) and proves
it s_h·float(j + r) + r' with r, r' free of j: it differs from the kernel's s_h·(j − pos(i)) by a
constant per row, which the softmax does not see (the patterns match no sink and no logits output).
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.expr import Expr as PrimExpr

from tvmattn.compiler.onnx import positions
from tvmattn.compiler.onnx.kernels import shape_of


def slopes(bias: relax.Expr, heads: int, batched: bool, values: dict) -> np.ndarray | None:
    """Each head's slope (h,) float32 if ``bias`` is ALiBi's, else None. ``batched``: the bias is on
    (B·h, n, n_kv) scores (head h of sequence b at b·h + h), else on (B, h, n, n_kv) ones; either may
    broadcast."""
    value = values.get(bias, bias)
    if isinstance(value, tvm.ir.GenericConst):  # (static shapes: folded when the model was read)
        return _constant_slopes(value.value.numpy(), heads, batched)
    table = _table(value, values, keys=True)
    found = None if table is None else _constant_slopes(table, heads, batched)
    if found is not None:  # a constant table's keys from a symbolic start: ALiBi's if the whole table is
        return found
    b, i, j = (tirx.Var(name, "int64") for name in ("b", "i", "j"))
    dims = shape_of(bias, "a bias")
    if batched and isinstance(dims[0], tirx.IntImm) and dims[0].value == heads:
        b = tirx.IntImm("int64", 0)  # one sequence: its batches are its heads
    found = []
    for head in range(heads):
        at = tirx.IntImm("int64", head)
        index = [b * heads + at, i, j] if batched else [b, at, i, j]
        value = positions.rule(bias, positions.broadcast(index, bias), values)
        if value is not None:  # (a tile of one repeat along the keys wrote its index as j mod n_kv)
            value = _within(tvm.sym.Analyzer().simplify(value), j, dims[-1])
        slope = None if value is None else _slope(value, j)
        if slope is None:
            return None
        found.append(slope)
    return np.array(found, np.float32) if any(found) else None  # (a bias of zeros is no mask, not ALiBi)


def _table(value: relax.Expr, values: dict, keys: bool = False) -> np.ndarray | None:
    """The constant a chain of unit-step slices reads: with constant bounds, what they keep; the first
    (with ``keys``) may slice the last axis from a symbolic start (MPT's (h, 1, 1024) table at symbolic
    sizes, its keys from max(0, 1024 - n)), and then the whole axis is returned."""
    value = values.get(value, value)
    if isinstance(value, tvm.ir.GenericConst):
        return value.value.numpy()
    if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.strided_slice"):
        return None
    data = _table(value.args[0], values)
    bounds = [list(a) for a in value.args[1:]]
    if data is None or len(value.args) != 5 or any(not (isinstance(s, tirx.IntImm) and s.value == 1)
                                                   for s in bounds[3]):
        return None
    whole = [slice(None)] * data.ndim
    for axis, begin, end in zip(*bounds[:3]):
        axis = int(axis) % data.ndim
        if isinstance(begin, tirx.IntImm) and isinstance(end, tirx.IntImm):
            whole[axis] = slice(int(begin), int(end))
        elif not (keys and axis == data.ndim - 1):
            return None
    return data[tuple(whole)]


def _within(value: PrimExpr, j: tirx.Var, extent: PrimExpr) -> PrimExpr:
    """``value`` with j mod ``extent`` as j: the key index is below the keys' count."""
    analyzer = tvm.sym.Analyzer()

    def on_mod(node: tirx.FloorMod) -> PrimExpr:
        return j if node.a.same_as(j) and analyzer.can_prove_equal(node.b, extent) else node

    return tvm_ffi.structural_map(value, [(tirx.FloorMod, on_mod)])


def _slope(value: PrimExpr, j: tirx.Var) -> float | None:
    """s where ``value`` is s·float(j + r) + r' (r, r' free of j); None for any other form."""
    if not _uses(value, j):
        return 0.0
    if isinstance(value, (tirx.Add, tirx.Sub)):
        a, b = _slope(value.a, j), _slope(value.b, j)
        return None if a is None or b is None else a + (b if isinstance(value, tirx.Add) else -b)
    if isinstance(value, tirx.Mul):
        for c, x in ((value.a, value.b), (value.b, value.a)):
            if isinstance(c, tirx.FloatImm) and _is_key(x, j):
                return float(c.value)
    return 1.0 if _is_key(value, j) else None


def _is_key(x: PrimExpr, j: tirx.Var) -> bool:
    """Whether ``x`` is float(j + r), r an integer free of j (the key's position, exactly in fp32)."""
    if not (isinstance(x, tirx.Cast) and "float" in str(x.ty)):
        return False
    inner = x.value
    while isinstance(inner, tirx.Cast) and "int" in str(inner.ty):
        inner = inner.value
    if "int" not in str(inner.ty):
        return False
    coeffs = tvm.sym.detect_linear_equation(inner, [j])
    return len(coeffs) == 2 and isinstance(coeffs[0], tirx.IntImm) and coeffs[0].value == 1 \
        and not _uses(coeffs[1], j)


def _uses(x: PrimExpr, var: tirx.Var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(x))


def _constant_slopes(bias: np.ndarray, heads: int, batched: bool) -> np.ndarray | None:
    """`slopes` of a constant bias: each head's rows s_h·j plus a constant each, to fp32's rounding."""
    bias = bias.astype(np.float64)
    if batched:  # (B·h | 1, n | 1, n_kv) → (B | 1, h | 1, n | 1, n_kv)
        lead = (1, 1) if bias.shape[0] == 1 else (-1, heads)
        bias = bias.reshape(lead + bias.shape[1:]) if bias.ndim == 3 and bias.shape[0] % heads in (0, 1) else None
    elif bias.ndim <= 4:
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    if bias is None or bias.ndim != 4 or bias.shape[1] not in (1, heads) or bias.shape[-1] < 2 \
            or not (np.abs(bias) < 1e30).all():  # (a mask's fill, -inf or finfo.min, is no distance)
        return None
    j = np.arange(bias.shape[-1])
    slope = (bias[..., -1] - bias[..., 0]) / (bias.shape[-1] - 1)  # (B, h, n)
    residual = bias - slope[..., None] * j - bias[..., :1]
    if np.abs(residual).max() > 1e-6 * max(np.abs(bias).max(), 1.0) or np.ptp(slope, axis=(0, 2)).max() > 0 \
            or not slope.any():  # (a bias of zeros is no mask at all, not ALiBi)
        return None
    return np.broadcast_to(slope[0, :, 0], (heads,)).astype(np.float32)
