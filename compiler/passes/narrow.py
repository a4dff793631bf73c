"""fp32 vectors rounded to bf16 by the instruction set's own conversion (`narrow_bf16`)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Call
from tvm.ir.expr import Expr as PrimExpr
from tvm.ir.prim.expr import BitwiseAnd, RShift
from tvm.tirx import PrimFunc

from tvmattn.compiler.target import isa_of

_REINTERPRET = tvm.ir.Op.get("tirx.reinterpret")


def narrow_bf16() -> tvm.transform.Pass:
    """TVM rounds fp32 to bf16 with integer operations (its storage legalisation, a vector of 16 lanes
    at a time: ``u = bits(x); (u + ((u >> 16) & 1) + 0x7FFF) >> 16``, narrowed): six instructions where
    AVX512-BF16 has one, ``vcvtneps2bf16`` (to nearest even as well; NaN stays NaN, and an fp32 denormal
    input is 0). Every such vector of the record's `Isa.narrow` lane counts becomes a call of its
    conversion, whose LLVM IR the function then imports. Run after TVM's pipeline (the rounding is
    written by its last passes); a function without one is left as it is."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.NarrowBf16")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        target = func.attrs.get("target") if func.attrs is not None else None
        isa = isa_of(target) if target is not None else None
        narrow = isa.narrow if isa is not None else None
        if narrow is None:
            return func
        functions = dict(narrow.functions)
        found = []

        def on_cast(cast: tirx.Cast):
            lanes = cast.ty.dtype.lanes
            x = _rounded(cast) if str(cast.ty.dtype) == f"uint16x{lanes}" and lanes in functions else None
            if x is None:
                return cast
            found.append(lanes)
            return tirx.call_pure_extern(f"uint16x{lanes}", functions[lanes], x)

        body = tvm_ffi.structural_map(func.body, [(tirx.Cast, on_cast)])
        if not found:
            return func
        return func.with_body(tirx.AttrStmt(tvm.ir.StringImm("narrow"), "pragma_import_llvm",
                                            tvm.ir.StringImm(narrow.llvm), body))

    return transform


def _rounded(cast: tirx.Cast) -> PrimExpr | None:
    """x where ``cast`` is TVM's rounding of the fp32 vector x to bf16 bits, else None."""
    shifted = cast.value
    if not isinstance(shifted, RShift) or not _const(shifted.b, 16) or not isinstance(shifted.a, tirx.Add):
        return None
    bits, bias = shifted.a.a, shifted.a.b
    if not isinstance(bias, tirx.Add) or not _const(bias.b, 0x7FFF) or not isinstance(bias.a, BitwiseAnd) \
            or not _const(bias.a.b, 1) or not isinstance(bias.a.a, RShift) or not _const(bias.a.a.b, 16):
        return None
    if not (_is(bits, _REINTERPRET) and tvm_ffi.structural_equal(bits, bias.a.a.a)):
        return None
    x = bits.args[0]
    return x if str(x.ty.dtype) == f"float32x{cast.ty.dtype.lanes}" else None


def _is(expr, op) -> bool:
    return isinstance(expr, Call) and expr.op.same_as(op)


def _const(expr, value: int) -> bool:
    """``expr`` is ``value`` (a constant, or a vector of it)."""
    if isinstance(expr, tirx.Broadcast):
        expr = expr.value
    return isinstance(expr, tirx.IntImm) and expr.value == value
