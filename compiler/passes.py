"""TIR passes tvmattn runs on a scheduled attention PrimFunc before TVM lowers it.

skip_masked_key_tiles  Tighten every key loop to the keys its queries can see (causal, window,
                       padding), so fully masked key tiles are never computed. TE reductions have fixed
                       extents and no schedule primitive can make a loop's extent depend on an outer
                       loop; this pass does it on the scheduled TIR, reading the mask from the spec.
polynomial_exp         Replace fp32 ``exp`` by a vectorisable polynomial (LLVM would otherwise call
                       scalar ``expf`` per lane).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Call
from tvm.ir.expr import Expr as PrimExpr
from tvm.s_tir import SBlockRealize
from tvm.sym import Analyzer, IntervalSet
from tvm.sym.pattern import detect_linear_equation
from tvm.tirx import For, ForKind, PrimFunc

from tvmattn.compiler import variant
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.te_attention import KEY_STAGE


# ---- block skipping ------------------------------------------------------------------------------
def skip_masked_key_tiles(spec: AttentionSpec) -> tvm.transform.Pass:
    """A PrimFunc pass that removes the key-loop iterations the mask of ``spec`` hides.

    For every key stage (blocks marked ``tvmattn.key_stage``; their iterators v_b, v_s, v_t are the
    batch, query and key), with key index ``t = c·L + r`` where L is the outermost loop t depends on:
      1. the queries the block meets inside L: [s_lo, s_hi] (loops inside L relaxed),
      2. the keys those queries see: [t_lo, t_hi) = `variant.key_range`,
      3. L's iterations that reach them: ceil((t_lo - r_max)/c) <= L < ceil((t_hi - r_min)/c).
    A loop shared by several blocks keeps the union of their ranges. Each stage reads only keys its
    producer computed, because a consumer's queries are a subset of its producer's. If any key stage
    cannot be analysed (its key loop is not serial and affine, or a schedule renamed its iterators),
    nothing is skipped: a producer skipping keys that a consumer still reads would be wrong.
    """

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.SkipMaskedKeyTiles")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        if not variant.skips_keys(spec):
            return func
        kv_lens = next((p for p in func.params if p.name == "kv_lens"), None)
        ranges = _KeyLoopRanges(spec, kv_lens)
        if not ranges.visit(func.body) or not ranges.bounds:
            return func
        # A loop-dependent extent makes TVM's buffer compaction size a tile by the extent's constant
        # bound; with a symbolic key length that bound is 2^31. Then the loop keeps its extent and a
        # guard (a bound flag, which compaction does not read) skips the hidden iterations instead.
        guard = isinstance(spec.n_kv, str)
        return func.with_body(_restrict_loops(func.body, ranges.bounds, guard))

    return transform


@dataclass
class _KeyLoopRanges:
    spec: AttentionSpec
    kv_lens: tirx.Buffer | None
    bounds: "_LoopBounds" = field(default_factory=lambda: _LoopBounds())
    analyzer: Analyzer = field(default_factory=Analyzer)

    def visit(self, stmt) -> bool:
        """Collect the new loop ranges; False if some key stage could not be analysed."""
        loops: list[For] = []
        ok = [True]

        def on_for(node, visitor):
            loops.append(node)
            visitor.default_visit(node)
            loops.pop()

        def on_realize(node, visitor):
            if KEY_STAGE in node.block.annotations:
                ok[0] &= self._analyse(node, loops)
            visitor.default_visit(node)

        tvm_ffi.structural_visit(stmt, [(For, on_for), (SBlockRealize, on_realize)])
        return ok[0]

    def _analyse(self, realize: SBlockRealize, loops: list[For]) -> bool:
        iters = {iv.var.name: (iv, value) for iv, value in zip(realize.block.iter_vars, realize.iter_values)}
        if "v_t" not in iters:
            # a reduction's init runs over no key; a key axis split into new iterators (rfactor: vt_0,
            # vt_1) is one this analysis cannot follow
            return not any(name.startswith("vt") for name in iters)
        if "v_s" not in iters or (self.spec.key_padding and "v_b" not in iters):
            return False
        (s_iter, s), (t_iter, t) = iters["v_s"], iters["v_t"]
        depends = [i for i, loop in enumerate(loops) if _uses(t, loop.loop_var)]
        if not depends:
            return True  # a single key: nothing to skip
        key_loop, inside = loops[depends[0]], loops[depends[0]:]
        b = iters["v_b"][1] if "v_b" in iters else None
        if (key_loop.kind != ForKind.SERIAL or _uses(s, key_loop.loop_var)
                or (b is not None and any(_uses(b, lp.loop_var) for lp in inside))):
            return False  # queries (or the batch) would move while the key loop runs
        coeffs = detect_linear_equation(t, [key_loop.loop_var])
        if len(coeffs) != 2 or not isinstance(coeffs[0], tirx.IntImm) or coeffs[0].value <= 0:
            return False
        c, rest = coeffs[0].value, coeffs[1]
        relax = {lp.loop_var: IntervalSet(lp.min, lp.min + lp.extent - 1) for lp in inside}
        s_set = self.analyzer.int_set(s, relax)
        r_set = self.analyzer.int_set(rest, relax)
        kv_len = tirx.BufferLoad(self.kv_lens, [b]) if self.spec.key_padding else t_iter.dom.extent
        t_lo, t_hi = variant.key_range(self.spec, s_set.min_value, s_set.max_value, kv_len, s_iter.dom.extent)
        lo, hi = key_loop.min, key_loop.min + key_loop.extent
        if t_lo is not None:
            lo = tirx.max(lo, tirx.floordiv(t_lo - r_set.max_value + (c - 1), c))
        if t_hi is not None:
            hi = tirx.min(hi, tirx.floordiv(t_hi - r_set.min_value + (c - 1), c))
        self.bounds.add(key_loop.loop_var, self.analyzer.simplify(lo), self.analyzer.simplify(hi))
        return True


class _LoopBounds:
    """New [lo, hi) per loop variable; a loop shared by several blocks keeps the union."""

    def __init__(self) -> None:
        self.items: list[tuple[tirx.Var, PrimExpr, PrimExpr]] = []

    def add(self, var: tirx.Var, lo: PrimExpr, hi: PrimExpr) -> None:
        for i, (v, old_lo, old_hi) in enumerate(self.items):
            if v.same_as(var):
                self.items[i] = (v, tirx.min(old_lo, lo), tirx.max(old_hi, hi))
                return
        self.items.append((var, lo, hi))

    def get(self, var: tirx.Var) -> tuple[PrimExpr, PrimExpr] | None:
        return next(((lo, hi) for v, lo, hi in self.items if v.same_as(var)), None)

    def __bool__(self) -> bool:
        return bool(self.items)


def _uses(expr, var: tirx.Var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, [(tirx.Var, lambda v: found.append(True) if v.same_as(var) else None)])
    return bool(found)


def _restrict_loops(body, bounds: _LoopBounds, guard: bool):
    def on_for(node: For) -> For:
        new = bounds.get(node.loop_var)
        if new is None:
            return node
        lo, hi = new
        if guard:
            seen = tirx.Var("sees_keys", "bool")
            inner = tirx.SeqStmt([tirx.Bind(seen, tirx.all(lo <= node.loop_var, node.loop_var < hi)),
                                  tirx.IfThenElse(seen, node.body, None)])
            return For(node.loop_var, node.min, node.extent, node.kind, inner,
                       node.thread_binding, node.annotations)
        return For(node.loop_var, lo, tirx.max(hi - lo, 0), node.kind, node.body,
                   node.thread_binding, node.annotations)

    return tvm_ffi.structural_map(body, [(For, on_for)])


# ---- polynomial exp --------------------------------------------------------------------------------
_EXP = tvm.ir.Op.get("tirx.exp")


def polynomial_exp() -> tvm.transform.Pass:
    """fp32 exp(x) = 2^n · p(r), n = round(x·log2 e), r = x - n·ln 2 (Cody–Waite), p of degree 6.

    Relative error about 2e-7 on [-87, 88]; larger inputs are clamped to 88, smaller ones give 0 (a
    logit of -inf has weight 0, not exp(-87) ≈ 1.6e-38), and NaN stays NaN (the clamp's min/max would
    turn it into a number: a NaN input must show in the output).
    """

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.PolynomialExp")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        def on_call(call):
            if call.op.same_as(_EXP) and str(call.ty.dtype) == "float32":
                return _exp_f32(call.args[0])
            return call

        return tvm_ffi.structural_map(func, [(Call, on_call)])

    return transform


def _exp_f32(arg: PrimExpr) -> PrimExpr:
    f = lambda v: tirx.const(v, "float32")  # noqa: E731
    x = tirx.min(tirx.max(arg, f(-87.0)), f(88.0))
    n = tirx.floor(x * f(1.44269504088896341) + f(0.5))
    r = x - n * f(0.693359375) + n * f(2.12194440e-4)  # ln 2 split in two for exactness
    p = f(1.9875691500e-4)
    for coeff in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(coeff)
    p = p * r * r + r + f(1.0)
    two_n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
    return tirx.Select(arg < f(-87.0), f(0.0), tirx.Select(tirx.isnan(arg), arg, p * two_n))
