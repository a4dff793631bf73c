"""The Relax rewrites before legalisation (`conv`, `powers`, `precision`) run their mutator over every
Relax function of a module the same way: this is that loop, once."""

from __future__ import annotations

import tvm
from tvm import relax


def rewrite_functions(mutator: relax.PyExprMutator, mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each Relax function replaced by ``mutator``'s visit of it (PrimFuncs kept)."""
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()
