"""Pad by amounts computed from the model's sizes (TorchScript's ``F.pad(mask, (0, (-n) % block))``: LongT5
pads its tokens to whole blocks; SEW pads back what its pooling dropped): TVM's converter takes only
constant amounts ("Dynamic pads are not supported"). Each amount is read back as an expression of the
sizes (`positions.rule`, element by element of the small pads tensor, through the reshape, reversal and
transposition TorchScript writes it with), and the padding is the data between fills of those sizes
(a concatenation per padded axis: its size an expression of the model's, as ONNX's shapes are). An amount
is ≥ 0 (a negative one would crop) where TVM's analyzer proves it, else asserted at run time
(`run_checks.nonnegative`): SEW's L − 2·(L // 2), written through floor divisions of the samples by 320 and
by 640, is ≥ 0 only where its frames' count L is, a size of a tensor far upstream."""

from __future__ import annotations

import functools

import tvm
from tvm import relax, tirx

from tvmattn.compiler.onnx import positions, run_checks
from tvmattn.compiler.onnx.shape_ops import bounded_below


def pad(inputs: list, attrs: dict) -> relax.Expr | None:
    """The padded data where the amounts are computed and readable (mode constant, every axis), an amount not
    provably ≥ 0 checked at run time; else None: TVM's converter (constant amounts; a clear error for
    computed ones)."""
    data, pads = inputs[0], inputs[1]
    dims = positions.dims_of(data)
    mode = attrs.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    fill = _fill(inputs[2] if len(inputs) > 2 else None, str(getattr(data.ty, "dtype", "")))
    bindings = _Bindings()
    if dims is None or isinstance(pads, tvm.ir.GenericConst) or mode != "constant" or fill is None \
            or (len(inputs) > 3 and inputs[3] is not None) or bindings.bb is None:
        return None  # (an axes input: TVM's converter, or its error)
    amounts = [positions.rule(pads, [tirx.IntImm("int64", i)], bindings) for i in range(2 * len(dims))]
    if any(a is None for a in amounts):
        return None
    amounts = [bounded_below(a).simplify(tirx.Cast("int64", a)) for a in amounts]
    unproven = [a for a in amounts if not bounded_below(a).can_prove(a >= 0)]
    if unproven:  # (a negative amount crops, which no fill does); emitted now: the fills run after the check
        message = ("a Pad's amount computed from the input sizes is negative at these sizes (it would crop): "
                   "the model does not take inputs of these sizes")
        least = functools.reduce(tirx.min, unproven)
        data = bindings.bb.emit(run_checks.nonnegative(bindings.bb, message, data, least))
    out, sizes = data, list(dims)
    for axis in range(len(dims)):
        before, after = amounts[axis], amounts[len(dims) + axis]
        parts = [*_filled(sizes, axis, before, fill), out, *_filled(sizes, axis, after, fill)]
        if len(parts) > 1:
            out = relax.op.concat(parts, axis)
            sizes[axis] = bounded_below(sizes[axis] + before + after).simplify(sizes[axis] + before + after)
    return out


def _filled(sizes: list, axis: int, amount: tirx.PrimExpr, fill: relax.Constant) -> list[relax.Expr]:
    """A tensor of ``fill`` the shape of ``sizes`` but ``amount`` along ``axis``; none for an amount of 0."""
    if isinstance(amount, tirx.IntImm) and amount.value == 0:
        return []
    return [relax.op.full(relax.ShapeExpr([*sizes[:axis], amount, *sizes[axis + 1:]]), fill, str(fill.ty.dtype))]


def _fill(value: relax.Expr | None, dtype: str) -> relax.Constant | None:
    """The constant_value input as a scalar of the data's dtype (0 where absent); None where it is not a
    constant scalar."""
    if value is None:
        return relax.const(0, dtype)
    if not isinstance(value, tvm.ir.GenericConst) or value.value.numpy().size != 1:
        return None
    return relax.const(value.value.numpy().reshape(()).item(), dtype)


class _Bindings:
    """The values bound to variables so far (`positions.rule` reads them as a dict), from the builder the
    importer is converting the graph in."""

    def __init__(self) -> None:
        self.bb = relax.BlockBuilder.current()

    def get(self, var, default=None):
        value = self.bb.lookup_binding(var) if self.bb is not None and isinstance(var, relax.Var) else None
        return default if value is None else value

    def __contains__(self, var) -> bool:
        return self.get(var) is not None

    def __getitem__(self, var):
        value = self.get(var)
        if value is None:
            raise KeyError(var)
        return value
