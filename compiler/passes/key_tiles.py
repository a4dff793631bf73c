"""Key tiles the mask hides, removed after scheduling: `skip_masked_key_tiles` and, for symbolic key
lengths, its second half after TVM's buffer compaction, `tighten_guarded_loops`."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Expr as PrimExpr
from tvm.s_tir import SBlockRealize
from tvm.sym import Analyzer, IntervalSet
from tvm.sym.pattern import detect_linear_equation
from tvm.tirx import For, ForKind, PrimFunc

from tvmattn.compiler import variant
from tvmattn.compiler.annotations import KEY_BLOCKS, KEY_STAGE, KEY_STEP
from tvmattn.compiler.passes.ir import conjuncts, substitute, uses, visit_blocks
from tvmattn.compiler.spec import AttentionSpec

GUARD_NAME = "sees_keys"  # the flag `skip_masked_key_tiles` guards a key loop's body with


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
        dims = {x.name: x for buf in func.params for x in buf.shape if isinstance(x, tirx.Var)}
        n, n_kv = (variant.size_expr(x if isinstance(x, int) else dims[x]) for x in (spec.n_q, spec.n_kv))
        ranges = _KeyLoopRanges(spec, kv_lens, n, n_kv, key_block=_key_block(func))
        if not ranges.visit(func.body) or not ranges.bounds:
            return func
        # A loop-dependent extent makes TVM's buffer compaction size a tile by the extent's constant
        # bound; with a symbolic key length that bound is 2^31. Then the loop keeps its extent and a
        # guard (a bound flag, which compaction does not read) skips the hidden iterations instead;
        # `tighten_guarded_loops`, run after compaction, turns the guard into the loop's range.
        guard = isinstance(spec.n_kv, str)
        return func.with_body(_restrict_loops(func.body, ranges.bounds, guard))

    return transform


@dataclass
class _KeyLoopRanges:
    spec: AttentionSpec
    kv_lens: tirx.Buffer | None
    n: PrimExpr  # the lengths: the stages' iterators may run past them (`te_attention._core`'s blocks)
    n_kv: PrimExpr
    key_block: int = 1  # keys computed in whole blocks of this many (`KEY_BLOCKS`)
    bounds: "_LoopBounds" = field(default_factory=lambda: _LoopBounds())
    analyzer: Analyzer = field(default_factory=Analyzer)

    def visit(self, stmt) -> bool:
        """Collect the new loop ranges; False if some key stage could not be analysed."""
        ok = [True]

        def on_block(node: SBlockRealize, loops: list[For]) -> None:
            if KEY_STAGE in node.block.annotations:
                ok[0] &= self._analyse(node, loops)

        visit_blocks(stmt, on_block)
        return ok[0]

    def _analyse(self, realize: SBlockRealize, loops: list[For]) -> bool:
        iters = {iv.var.name: (iv.dom.extent, value) for iv, value in zip(realize.block.iter_vars, realize.iter_values)}
        within: dict[tirx.Var, IntervalSet] = {}  # offsets inside a block of queries or keys
        if KEY_BLOCKS in realize.block.annotations:
            iters, within = _blocked_iters(iters, realize.block.annotations[KEY_BLOCKS])
        if "v_t" not in iters:
            # a reduction's init runs over no key; a key axis split into new iterators (rfactor: vt_0,
            # vt_1) is one this analysis cannot follow
            return not any(name.startswith("vt") for name in iters)
        if "v_s" not in iters or (self.spec.key_padding and "v_b" not in iters):
            return False
        (_, s), (keys, t) = iters["v_s"], iters["v_t"]
        depends = [i for i, loop in enumerate(loops) if uses(t, loop.loop_var)]
        if not depends:
            return True  # a single key: nothing to skip
        key_loop, inside = loops[depends[0]], loops[depends[0]:]
        # a loop of one iteration inside the key loop (a stage computed at it keeps its unit loops)
        # moves nothing: its variable is its start
        unit = {lp.loop_var: lp.min for lp in inside if isinstance(lp.extent, tirx.IntImm) and lp.extent.value == 1}
        b = substitute(iters["v_b"][1], unit) if "v_b" in iters else None
        if (key_loop.kind != ForKind.SERIAL or uses(s, key_loop.loop_var)
                or (b is not None and any(uses(b, lp.loop_var) for lp in inside))):
            return False  # queries (or the batch) would move while the key loop runs
        coeffs = detect_linear_equation(t, [key_loop.loop_var])
        if len(coeffs) != 2 or not isinstance(coeffs[0], tirx.IntImm) or coeffs[0].value <= 0:
            return False
        c, rest = coeffs[0].value, coeffs[1]
        relax = {lp.loop_var: IntervalSet(lp.min, lp.min + lp.extent - 1) for lp in inside} | within
        s_set = self.analyzer.int_set(s, relax)
        r_set = self.analyzer.int_set(rest, relax)
        kv_len = tirx.BufferLoad(self.kv_lens, [b]) if self.spec.key_padding else self.n_kv
        t_lo, t_hi = variant.key_range(self.spec, s_set.min_value, s_set.max_value, kv_len, self.n)
        if self.key_block > 1:  # whole blocks of keys, in every stage (see `KEY_BLOCKS`)
            g = self.key_block
            t_lo = None if t_lo is None else tirx.floordiv(t_lo, g) * g
            t_hi = None if t_hi is None else tirx.min(tirx.floordiv(t_hi + g - 1, g) * g, keys)
        lo, hi = key_loop.min, key_loop.min + key_loop.extent
        if t_lo is not None:
            lo = tirx.max(lo, tirx.floordiv(t_lo - r_set.max_value + (c - 1), c))
        if t_hi is not None:
            hi = tirx.min(hi, tirx.floordiv(t_hi - r_set.min_value + (c - 1), c))
        self.bounds.add(key_loop.loop_var, self.analyzer.simplify(lo), self.analyzer.simplify(hi))
        return True


def _key_blocks(annotation) -> dict[str, tuple[str, int]]:
    """A `KEY_BLOCKS` annotation as {axis: (iterator, block size)}."""
    out = {}
    for item in str(annotation).split(","):
        axis, _, term = item.partition("=")
        name, _, factor = term.partition("*")
        out[axis] = (name, int(factor or 1))
    return out


def _blocked_iters(iters: dict, annotation) -> tuple[dict, dict]:
    """A `KEY_BLOCKS` block's (extent, value) of v_b, v_s, v_t, and the offsets inside its blocks."""
    out, within = {}, {}
    for axis, (name, f) in _key_blocks(annotation).items():
        if name not in iters:  # (a reduction's init, which keeps the annotation: over no key)
            continue
        extent, value = iters[name]
        if f > 1:
            offset = tirx.Var(f"{axis}_in_block", "int32")
            within[offset] = IntervalSet(0, f - 1)
            extent, value = extent * f, value * f + offset
        out[f"v_{axis}"] = (extent, value)
    return out, within


def _key_block(func: PrimFunc) -> int:
    """The largest block of keys a `KEY_BLOCKS` stage of ``func`` reads at once, or a `KEY_STEP`
    stage's loop steps over (1: none)."""
    sizes = [1]

    def on_block(node: SBlockRealize, _loops) -> None:
        if KEY_BLOCKS in node.block.annotations:
            sizes.append(_key_blocks(node.block.annotations[KEY_BLOCKS]).get("t", ("", 1))[1])
        if KEY_STEP in node.block.annotations:
            sizes.append(int(node.block.annotations[KEY_STEP]))

    visit_blocks(func.body, on_block)
    return max(sizes)


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


def _restrict_loops(body, bounds: _LoopBounds, guard: bool):
    def on_for(node: For) -> For:
        new = bounds.get(node.loop_var)
        if new is None:
            return node
        lo, hi = new
        if guard:
            seen = tirx.Var(GUARD_NAME, "bool")
            inner = tirx.SeqStmt([tirx.Bind(seen, tirx.all(lo <= node.loop_var, node.loop_var < hi)),
                                  tirx.IfThenElse(seen, node.body, None)])
            return For(node.loop_var, node.min, node.extent, node.kind, inner,
                       node.thread_binding, node.annotations)
        return For(node.loop_var, lo, tirx.max(hi - lo, 0), node.kind, node.body,
                   node.thread_binding, node.annotations)

    return tvm_ffi.structural_map(body, [(For, on_for)])


def tighten_guarded_loops() -> tvm.transform.Pass:
    """The second half of `skip_masked_key_tiles` for symbolic key lengths, run after TVM's buffer
    compaction (`tvmattn.compiler.build` puts it at the end of the CPU pipeline): a loop whose body
    is ``if sees_keys: …`` with ``sees_keys = lo <= t < hi`` (lo, hi fixed while the loop runs)
    runs over [lo, hi) instead. Skipped iterations cost a branch each, and the branch keeps LLVM
    from treating the key loops as the counted loops of the static kernels (measured: 1.8× on a
    causal 512-query kernel)."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.TightenGuardedLoops")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        analyzer = Analyzer()

        def on_for(node: For):
            if node.kind != ForKind.SERIAL:
                return node
            stmts = list(node.body.seq) if isinstance(node.body, tirx.SeqStmt) else [node.body]
            at = next((i for i, st in enumerate(stmts) if isinstance(st, tirx.Bind) and st.var.name == GUARD_NAME),
                      None)
            if at is None or at + 2 != len(stmts) or not isinstance(stmts[-1], tirx.IfThenElse) \
                    or stmts[-1].else_case is not None:
                return node
            defined = {}  # the body's bindings before the guard (CSE's), to read the bounds outside it
            for st in stmts[:at]:
                if not isinstance(st, tirx.Bind):
                    return node
                defined[st.var] = substitute(st.value, defined)
            lo, hi = node.min, node.min + node.extent
            for cond in conjuncts(substitute(stmts[at].value, defined)):
                bound = _range_bound(cond, node.loop_var)
                if bound is None or any(uses(bound[1], v) for v in list(defined) + [node.loop_var]):
                    return node
                lo, hi = (tirx.max(lo, bound[1]), hi) if bound[0] == "lo" else (lo, tirx.min(hi, bound[1]))
            body = tirx.SeqStmt(stmts[:at] + [stmts[-1].then_case]) if at else stmts[-1].then_case
            # from 0, the bounds bound once outside the loop (LLVM code generation of a loop whose
            # start is an expression fails on LowerIntrin's floordiv lets)
            first, count = tirx.Var("first_key", "int32"), tirx.Var("keys", "int32")
            key = tirx.Var(node.loop_var.name, "int32")
            body = tvm_ffi.structural_map(body, [(tirx.Var, lambda v: key + first if v.same_as(node.loop_var) else v)])
            return tirx.SeqStmt([tirx.Bind(first, analyzer.simplify(lo)),
                                 tirx.Bind(count, analyzer.simplify(tirx.max(hi - first, 0))),
                                 For(key, 0, count, node.kind, body, node.thread_binding, node.annotations)])

        return func.with_body(tvm_ffi.structural_map(func.body, [(For, on_for)]))

    return transform


def _range_bound(cond, var: tirx.Var):
    """("lo", x) for x <= var, ("hi", x) for var < x (and the <, <= variants); else None."""
    if isinstance(cond, (tirx.LT, tirx.LE)):
        if cond.a.same_as(var):
            return "hi", cond.b if isinstance(cond, tirx.LT) else cond.b + 1
        if cond.b.same_as(var):
            return "lo", cond.a if isinstance(cond, tirx.LE) else cond.a + 1
    return None
