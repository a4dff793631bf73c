"""IR helpers the passes share: walking blocks with their loops, and looking into expressions."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Expr as PrimExpr
from tvm.s_tir import SBlockRealize
from tvm.tirx import For


def visit_blocks(stmt, on_block) -> None:
    """Call ``on_block(realize, loops)`` for every block of ``stmt``, with the loops around it, outermost first."""
    loops: list[For] = []

    def on_for(node, visitor):
        loops.append(node)
        visitor.default_visit(node)
        loops.pop()

    def on_realize(node, visitor):
        on_block(node, loops)
        visitor.default_visit(node)

    tvm_ffi.structural_visit(stmt, [(For, on_for), (SBlockRealize, on_realize)])


def uses(expr, var: tirx.Var) -> bool:
    """Whether ``expr`` (any IR node) refers to ``var``."""
    found = []
    tvm_ffi.structural_walk(expr, [(tirx.Var, lambda v: found.append(True) if v.same_as(var) else None)])
    return bool(found)


def substitute(expr, values: dict):
    """``expr`` with each variable of ``values`` (var → expression) replaced."""
    if not values:
        return expr
    return tvm_ffi.structural_map(expr, [(tirx.Var, lambda v: next((x for k, x in values.items() if k.same_as(v)), v))])


def conjuncts(expr) -> list:
    return conjuncts(expr.a) + conjuncts(expr.b) if isinstance(expr, tirx.And) else [expr]


def element_dtype(value: PrimExpr) -> str:
    """The element dtype of a scalar or vector ``value`` (float16x16 → float16)."""
    dtype = tvm.DataType(str(value.ty.dtype))
    return str(dtype.with_lanes(1)) if dtype.lanes > 1 else str(dtype)
