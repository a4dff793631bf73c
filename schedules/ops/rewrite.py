"""The Relax rewrites before legalisation (`conv`, `powers`, `precision`, `tiles`) run their mutator over
every Relax function of a module the same way: this is that loop, once; and the count of a function's
readers of each variable, which two of them ask."""

from __future__ import annotations

import collections

import tvm
from tvm import relax


def rewrite_functions(mutator: relax.PyExprMutator, mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each Relax function replaced by ``mutator``'s visit of it (PrimFuncs kept)."""
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()


def readers(func: relax.Function) -> collections.Counter:
    """Each variable of ``func`` → how many of its bindings (and its result) read it."""
    count: collections.Counter = collections.Counter()
    if isinstance(func.body, relax.SeqExpr):
        for block in func.body.blocks:
            for binding in block.bindings:
                count.update(relax.analysis.used_vars(binding.value))
        count.update(relax.analysis.used_vars(func.body.body))
    return count


def dims(x: relax.Expr) -> list | None:
    """The sizes of a tensor expression of a known rank (PrimExprs), else None."""
    shape = getattr(getattr(x, "ty", None), "shape", None)
    return list(shape.values) if isinstance(shape, relax.ShapeExpr) else None
