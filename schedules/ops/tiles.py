"""A product by a constant repeated along the batch, in Relax before legalisation: the constant once,
broadcast by the matmul, not a copy of it per call.

DeBERTa's disentangled attention multiplies each head's queries by its positional keys repeated per
sequence (``pos_key_layer.repeat(batch, 1, 1)``: ONNX Tile of a constant (h, r, d) by [batch, 1, 1]),
transposed. With the batch known at import the tile is folded; with a symbolic batch TVM's importer
writes a ``dyn_tile`` call that copied (h·batch, r, d) every call, and its transposition and bf16 cast
another pass each (0.6 ms of a 4 ms call at 2 × 128). Since row i of the tile is row i mod h of the
constant,

    matmul(A (k·h, m, d), permute_dims(tile(C (h, r, d), [k, 1, 1]), [0, 2, 1]))
      = reshape(matmul(reshape(A, (k, h, m, d)), Cᵀ (h, d, r)), (k·h, m, r))

with Cᵀ transposed at import: the matmul reads one constant of (h, d, r) for every k.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvmattn.compiler.annotations import TILE_FUNCTION
from tvmattn.schedules.ops.rewrite import readers, rewrite_functions


@tvm.transform.module_pass(opt_level=0, name="tvmattn.ConstantTiles")
def constant_tiles(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    mod = _ConstantTiles(mod).run()
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mod[gvar] = _without_dead_casts(func)
    return mod


def _without_dead_casts(func: relax.Function) -> relax.Function:
    """``func`` after dead-code elimination, without two kinds of match_cast nothing reads, which
    Relax's elimination keeps: a tile's result cast to the graph's sizes (the tile is gone), and a
    shape cast that only names new sizes nothing else uses (the run-time shape arithmetic behind the
    tile's sizes). Any other match_cast (a check of sizes already known) stays."""
    while True:
        func = relax.transform.DeadCodeElimination()(tvm.IRModule({"f": func}))["f"]
        if not isinstance(func.body, relax.SeqExpr):
            return func
        bindings = [b for block in func.body.blocks for b in block.bindings]
        values = {b.var: b.value for b in bindings if isinstance(b, relax.VarBinding)}
        used = readers(func)
        sizes = [set(relax.analysis.tir_vars_in_type(b.var.ty)) for b in bindings]
        known = {v for p in func.params for v in relax.analysis.tir_vars_in_type(p.ty)}
        dead = set()
        for i, b in enumerate(bindings):
            fresh = sizes[i] - known
            known |= sizes[i]
            if not isinstance(b, relax.MatchCast) or b.var in used or any(fresh & later for later in sizes[i + 1:]):
                continue
            tiled = values.get(b.value) if isinstance(b.value, relax.Var) else None
            if _is_tile(tiled) or isinstance(b.var.ty, relax.ShapeType) and fresh == sizes[i]:
                dead.add(b)
        if not dead:
            return func
        blocks = [type(block)([b for b in block.bindings if b not in dead]) for block in func.body.blocks]
        func = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                              func.attrs)


def _is_tile(value) -> bool:
    return isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir" \
        and TILE_FUNCTION.fullmatch(getattr(value.args[0], "name_hint", "")) is not None


@relax.expr_functor.mutator
class _ConstantTiles(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod_ = mod
        self.cast: dict = {}  # a match_cast's var → its value (the builder's table has only plain bindings)

    def run(self) -> tvm.IRModule:
        for func in self.mod_.functions.values():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                self.cast.update({b.var: b.value for block in func.body.blocks for b in block.bindings
                                  if isinstance(b, relax.MatchCast)})
        return rewrite_functions(self, self.mod_)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") != "relax.matmul":
            return call
        a, b = call.args
        found = self._tiled(b)
        dims = getattr(getattr(a.ty, "shape", None), "values", None)
        if found is None or dims is None or len(dims) != 3:
            return call
        constant, transposed = found
        h, r, d = constant.shape
        analyzer = tvm.sym.Analyzer()
        batch = analyzer.simplify(tvm.tirx.floordiv(dims[0], h))
        if not (analyzer.can_prove_equal(batch * h, dims[0]) and analyzer.can_prove_equal(b.ty.shape[0], dims[0])):
            return call
        weight = constant.transpose(0, 2, 1) if transposed else constant  # (h, d, r) or (h, r, d)
        rows = self.builder_.emit(relax.op.reshape(a, [batch, h, dims[1], dims[2]]))
        product = self.builder_.emit(relax.op.matmul(rows, relax.const(np.ascontiguousarray(weight)),
                                                     out_dtype=call.attrs.out_dtype))
        return relax.op.reshape(product, [dims[0], dims[1], weight.shape[-1]])

    def _tiled(self, b: relax.Expr) -> tuple[np.ndarray, bool] | None:
        """(C, transposed) where ``b`` is a tile of the 3-D constant C along its first axis only,
        optionally with its last two axes swapped; else None."""
        transposed = False
        value = self.lookup_binding(b) if isinstance(b, relax.Var) else None
        if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.permute_dims" \
                and [int(x) for x in (value.attrs.axes or [])] == [0, 2, 1]:
            transposed, b = True, value.args[0]
            value = self.lookup_binding(b) if isinstance(b, relax.Var) else None
        if value is None and b in self.cast:  # a match_cast of the tile's result to its shape in the graph's sizes
            value = self.cast[b]
            value = self.lookup_binding(value) if isinstance(value, relax.Var) else value
        if not _is_tile(value):
            return None
        args = value.args[1].fields
        if len(args) != 1 or not isinstance(args[0], tvm.ir.GenericConst):
            return None
        constant = args[0].value.numpy()
        have = getattr(getattr(b.ty, "shape", None), "values", None)
        if constant.ndim != 3 or have is None or len(have) != 3 \
                or any(not isinstance(x, tvm.tirx.IntImm) or int(x) != n for x, n in zip(have[1:], constant.shape[1:])):
            return None
        return constant, transposed
