"""TIR passes tvmattn runs on scheduled PrimFuncs (attention kernels, model functions) before TVM lowers them.

skip_masked_key_tiles  Tighten every key loop to the keys its queries can see (causal, window,
                       padding), so fully masked key tiles are never computed. TE reductions have fixed
                       extents and no schedule primitive can make a loop's extent depend on an outer
                       loop; this pass does it on the scheduled TIR, reading the mask from the spec.
pad_query_tiles        Drop the query-tail predicates (``s < n``) of the stages computed inside a query
                       tile: the tail tile computes all its rows (the padding rows are never stored), so
                       the register tiles and per-row loops vectorise also when n is symbolic.
clamp_row_tails        For a register tile of a GEMM with a row tail (``row < M``, M symbolic): the tile's
                       compute tests only its first row and reads row min(row, M - 1) of its inputs; the
                       store of the tile keeps the full test.
peel_key_tails         In a loop of symbolic extent whose blocks test a tail (``t < n_kv``, from a split by
                       a constant factor), run the iterations before the tail without the tests.
element_aligned_arguments
                       Declare the arguments aligned to their elements, not to TVM's 64 bytes: NumPy
                       arrays (16-byte aligned) and views at any element offset then cross without a
                       copy; the code generator emits unaligned vector moves, as fast on aligned data.
one_parallel_launch    Start a statement list's consecutive parallel loops in one launch of TVM's thread
                       pool, a barrier between them (each launch wakes the pool's sleeping workers).
polynomial_math        Replace fp32 ``exp``, ``sigmoid``, ``tanh``, ``erf`` and small integer powers by
                       vectorisable polynomials (LLVM would otherwise call scalar libm per lane).
vector_exp2            After vectorisation: fp32 ``exp2`` as a polynomial, on AVX-512 vectors with
                       ``vreduceps``/``vscalefps`` (no clamps, no NaN test).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.ir.expr import Expr as PrimExpr
from tvm.s_tir import SBlock, SBlockRealize
from tvm.sym import Analyzer, IntervalSet
from tvm.sym.pattern import detect_linear_equation
from tvm.tirx import For, ForKind, PrimFunc

from tvmattn.compiler import variant
from tvmattn.compiler.annotations import KEY_BLOCKS, KEY_STAGE, PADDED_AXES  # noqa: F401 (read from here too)
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import has_feature

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

        _visit_blocks(stmt, on_block)
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
        extent, value = iters[name]
        if f > 1:
            offset = tirx.Var(f"{axis}_in_block", "int32")
            within[offset] = IntervalSet(0, f - 1)
            extent, value = extent * f, value * f + offset
        out[f"v_{axis}"] = (extent, value)
    return out, within


def _key_block(func: PrimFunc) -> int:
    """The largest block of keys a `KEY_BLOCKS` stage of ``func`` reads at once (1: none)."""
    sizes = [1]

    def on_block(node: SBlockRealize, _loops) -> None:
        if KEY_BLOCKS in node.block.annotations:
            sizes.append(_key_blocks(node.block.annotations[KEY_BLOCKS]).get("t", ("", 1))[1])

    _visit_blocks(func.body, on_block)
    return max(sizes)


def _visit_blocks(stmt, on_block) -> None:
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


def uses(expr, var: tirx.Var) -> bool:
    """Whether ``expr`` (any IR node) refers to ``var``."""
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
            for cond in _conjuncts(substitute(stmts[at].value, defined)):
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


def one_parallel_launch() -> tvm.transform.Pass:
    """Consecutive parallel loops of a statement list (a layer's projections and attention, a
    kernel's packing pass and its query tiles) run in one launch of the thread pool, with a barrier
    after each loop but the last, instead of one launch each. Every launch wakes the pool's workers,
    and TVM's workers sleep between launches when they do not spin (``TVM_THREAD_POOL_SPIN_COUNT=0``,
    as beside torch or ONNX Runtime): merged, a (1, 8, 128, 64) bf16 kernel of two loops went from
    0.152 to 0.124 ms, a one-token fp32 GPT-2 layer of 13 from 0.214 to 0.143 ms (0.97–1.11× from
    128 tokens, within this VM's noise). Each loop keeps its static split over the threads;
    the statements allowed between merged loops are `tirx.Bind`s (every thread evaluates them) and
    an LLVM import around a loop (it moves outside). Run after TVM's pipeline: the pragmas are read
    by TVM's CPU code generator only (TVM's thread pool: OpenMP's has no such barrier)."""

    def merged(stmts: list) -> list:
        out, i = [], 0
        while i < len(stmts):
            if _parallel_loop(stmts[i]) is None:
                out.append(stmts[i])
                i += 1
                continue
            j = i  # the run: loops, and bindings between them
            while j + 1 < len(stmts) and (_parallel_loop(stmts[j + 1]) is not None
                                          or isinstance(stmts[j + 1], tirx.Bind)):
                j += 1
            while _parallel_loop(stmts[j]) is None:
                j -= 1
            run, rest = stmts[i:j + 1], stmts[j + 1:]
            bound = [st.var for st in run if isinstance(st, tirx.Bind)]  # (a thread's own, inside the launch)
            loops = [st for st in run if _parallel_loop(st) is not None]
            if len(loops) < 2 or any(uses(later, var) for later in rest for var in bound):
                out.extend(run)
            else:
                body = [_parallel_loop(st) or st for st in run]
                body = [tirx.AttrStmt(_ONE, "pragma_parallel_barrier_when_finish", _ONE, st)
                        if isinstance(st, For) and k < len(body) - 1 else st for k, st in enumerate(body)]
                launch = tirx.AttrStmt(_ONE, "pragma_parallel_launch_point", _ONE, tirx.SeqStmt(body))
                for st in run:  # an LLVM import links its IR into the module, wherever it stands
                    if isinstance(st, tirx.AttrStmt):
                        launch = tirx.AttrStmt(st.node, st.attr_key, st.value, launch)
                out.append(launch)
            i = j + 1
        return out

    def on_seq(seq: tirx.SeqStmt):
        stmts = merged(list(seq.seq))
        return tirx.SeqStmt(stmts) if len(stmts) != len(seq.seq) else seq

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.OneParallelLaunch")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.SeqStmt, on_seq)]))

    return transform


_ONE = tirx.IntImm("int32", 1)


def _parallel_loop(stmt) -> For | None:
    """``stmt`` as a parallel loop: itself, or the loop an LLVM import wraps."""
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "pragma_import_llvm":
        stmt = stmt.body
    return stmt if isinstance(stmt, For) and stmt.kind == ForKind.PARALLEL else None


def substitute(expr, values: dict):
    """``expr`` with each variable of ``values`` (var → expression) replaced."""
    if not values:
        return expr
    return tvm_ffi.structural_map(expr, [(tirx.Var, lambda v: next((x for k, x in values.items() if k.same_as(v)), v))])


def _range_bound(cond, var: tirx.Var):
    """("lo", x) for x <= var, ("hi", x) for var < x (and the <, <= variants); else None."""
    if isinstance(cond, (tirx.LT, tirx.LE)):
        if cond.a.same_as(var):
            return "hi", cond.b if isinstance(cond, tirx.LT) else cond.b + 1
        if cond.b.same_as(var):
            return "lo", cond.a if isinstance(cond, tirx.LE) else cond.a + 1
    return None


# ---- query tiles computed whole ------------------------------------------------------------------
def pad_query_tiles() -> tvm.transform.Pass:
    """A PrimFunc pass that lets the last query tile compute all its rows.

    Splitting the query axis by the tile leaves a predicate ``s < n`` on every block computed in the
    task (from the split, and from laying tile buffers out as (tile, …, s % q_tile)); inside the
    vectorised loops over queries it is a per-lane condition, so TVM scalarises each micro-kernel
    (per element branches, no register tiles). For a symbolic n every tile pays it, for a static n
    the tail tile does. The rows past n only feed rows past n, and every stage is row-wise, so a
    block may compute them if each buffer it accesses at a query index is task-local (read and
    written only inside the same outermost loop, not a parameter, so sized by the tile): the packed queries, the
    score, probability and accumulator tiles. Blocks reading parameters or global intermediates by
    query (the query pack, an attn_mask, q_proj) and the stores of the output or of an intermediate
    that a later loop reads (attn before W_O) keep their predicate.
    """

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.PadQueryTiles")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        params = list(func.params)
        users: list = []  # (buffer, outermost loop of a block reading or writing it)
        tops: dict = {}  # block -> its outermost loop

        def on_block(node: SBlockRealize, loops: list[For]) -> None:
            top = loops[0].loop_var if loops else None
            tops[node.block] = top
            users.extend((region.source, top) for region in list(node.block.reads) + list(node.block.writes))

        _visit_blocks(func.body, on_block)
        analyzer = Analyzer()

        def local(buffer, top) -> bool:
            tops_of = [t for b, t in users if b.same_as(buffer)]
            return (top is not None and not any(buffer.same_as(p) for p in params)
                    and bool(tops_of) and all(t is not None and t.same_as(top) for t in tops_of))

        def on_realize_map(node: SBlockRealize):
            block = node.block
            s_iter = next((i for i, iv in enumerate(block.iter_vars) if iv.var.name == "v_s"), None)
            if s_iter is None or isinstance(node.predicate, tirx.IntImm):
                return node
            s_var, s_value = block.iter_vars[s_iter].var, node.iter_values[s_iter]
            top = next((t for b, t in tops.items() if b.same_as(block) or b.name_hint == block.name_hint), None)
            for region in list(block.reads) + list(block.writes):
                by_query = any(uses(r.min, s_var) or uses(r.extent, s_var) for r in region.region)
                if by_query and not local(region.source, top):
                    return node
            kept = [c for c in _conjuncts(node.predicate) if not _bounds(analyzer, c, s_value)]
            predicate = tirx.all(*kept) if kept else tirx.const(True, "bool")
            return SBlockRealize(node.iter_values, predicate, block, node.span)

        return func.with_body(tvm_ffi.structural_map(func.body, [(SBlockRealize, on_realize_map)]))

    return transform


def clamp_row_tails() -> tvm.transform.Pass:
    """A PrimFunc pass for row tails in blocks that only write local (register) buffers.

    Splitting rows by a register tile leaves ``row < M`` on every block of the tile; inside the
    unrolled, vectorised micro-kernel that is a branch per FMA. A block writing only local buffers may
    compute the tail's missing rows (nothing outside the tile sees them), so its test becomes one on
    the tile's first row (the unrolled and vector loops at 0) and its reads of other buffers take row
    min(row, M - 1): in bounds, and never stored. The store of the tile keeps the test. An iterator
    the block's ``PADDED_AXES`` annotation names (columns of a weight zero-padded to whole tiles) keeps
    only the tile's test, unclamped: the tile's padding columns are in the weight.
    """

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.ClampRowTails")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        analyzer = Analyzer()
        in_tile: dict[str, dict] = {}  # block name -> the loop variables of its register tile, at 0

        def on_block(node: SBlockRealize, loops: list[For]) -> None:
            in_tile[node.block.name_hint] = {lp.loop_var: tirx.const(0, lp.loop_var.ty.dtype) for lp in loops
                                             if lp.kind in (ForKind.UNROLLED, ForKind.VECTORIZED)}

        _visit_blocks(func.body, on_block)

        def on_realize(node: SBlockRealize):
            block = node.block
            if isinstance(node.predicate, tirx.IntImm) or not block.writes or \
                    any(w.source.scope() != "local" for w in block.writes):
                return node
            conjuncts = _conjuncts(node.predicate)
            kept, clamp = [], {}
            padded = [int(i) for i in block.annotations.get(PADDED_AXES, [])]
            for cond in conjuncts:
                at = next((i for i, v in enumerate(node.iter_values) if isinstance(cond, tirx.LT)
                           and block.iter_vars[i].iter_type == tirx.IterVar.DataPar
                           and analyzer.can_prove_equal(cond.a, v)), None)
                if at is None:
                    kept.append(cond)
                    continue
                if at not in padded:
                    var = block.iter_vars[at].var
                    clamp[var] = tirx.min(var, cond.b - 1)
                kept.append(analyzer.simplify(substitute(cond, in_tile.get(block.name_hint, {}))))

            if not clamp and all(k.same_as(c) for k, c in zip(kept, conjuncts)):
                return node

            def on_load(load):
                if load.source.scope() == "local":
                    return load
                return tirx.BufferLoad(load.source, [substitute(i, clamp) for i in load.indices])

            body = tvm_ffi.structural_map(block.body, [(TensorLoad, on_load)])
            reads = [r if r.source.scope() == "local" else tirx.BufferRegion(
                r.source, [tvm.ir.Range.from_min_extent(substitute(x.min, clamp), x.extent) for x in r.region])
                for r in block.reads]
            new = SBlock(block.iter_vars, reads, block.writes, block.name_hint, body, block.init,
                         block.alloc_buffers, block.match_buffers, block.annotations)
            predicate = tirx.all(*kept) if kept else tirx.const(True, "bool")
            return SBlockRealize(node.iter_values, predicate, new, node.span)

        return func.with_body(tvm_ffi.structural_map(func.body, [(SBlockRealize, on_realize)]))

    return transform


def _conjuncts(expr) -> list:
    return _conjuncts(expr.a) + _conjuncts(expr.b) if isinstance(expr, tirx.And) else [expr]


def _bounds(analyzer: Analyzer, cond, value) -> bool:
    """Whether ``cond`` is an upper bound on ``value`` (value < x or value <= x)."""
    return isinstance(cond, (tirx.LT, tirx.LE)) and analyzer.can_prove_equal(cond.a, value)


# ---- tails peeled off symbolic loops ------------------------------------------------------------
def peel_key_tails() -> tvm.transform.Pass:
    """A PrimFunc pass: in a serial loop ``L`` of symbolic extent whose blocks carry a predicate
    ``c·L + r < B`` (B fixed while L runs; r over the loops inside L), the iterations where every
    such test holds (all but the tail) run a copy of the body without the tests.

    The split of a symbolic key axis by a register tile (qk_keys keys; a vector of keys for one
    query) guards every key of the tile by ``t < n_kv``; inside the micro-kernels those are branches
    per FMA, or a per-lane condition that makes TVM scalarise a vector loop. With a static length the
    same loop has no tail or a constant one, so it is left as it is.
    """

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.PeelKeyTails")
    def transform(func: PrimFunc, mod, _ctx) -> PrimFunc:
        analyzer = Analyzer()

        def on_for(node: For):
            if node.kind != ForKind.SERIAL or isinstance(node.extent, tirx.IntImm):
                return node
            inner: list[For] = []
            realizes: list[SBlockRealize] = []
            tvm_ffi.structural_walk(node.body, [(For, inner.append), (SBlockRealize, realizes.append)])
            relax = {lp.loop_var: IntervalSet(lp.min, lp.min + lp.extent - 1) for lp in inner}
            tests, cuts = [], []
            for realize in realizes:
                for cond in _conjuncts(realize.predicate):
                    cut = _holds_below(analyzer, cond, node.loop_var, inner, relax)
                    if cut is not None:
                        tests.append(cond)
                        cuts.append(cut)
            if not tests:
                return node
            # One loop, the test per iteration: a buffer used only inside the loop's body (a register
            # tile) keeps its per-iteration size; two sibling loops would share it and compaction
            # would size it by both.
            def peeled(body):
                return tirx.IfThenElse(node.loop_var < _min_of(cuts), _drop_conjuncts(body, tests), body)

            stmts = list(node.body.seq) if isinstance(node.body, tirx.SeqStmt) else []
            if (len(stmts) == 2 and isinstance(stmts[0], tirx.Bind) and stmts[0].var.name == GUARD_NAME
                    and isinstance(stmts[1], tirx.IfThenElse) and stmts[1].else_case is None):
                # inside the guard of `skip_masked_key_tiles`, which `tighten_guarded_loops` reads
                guarded = tirx.IfThenElse(stmts[1].condition, peeled(stmts[1].then_case), None)
                body = tirx.SeqStmt([stmts[0], guarded])
            else:
                body = peeled(node.body)
            return For(node.loop_var, node.min, node.extent, node.kind, body, node.thread_binding, node.annotations)

        body = tvm_ffi.structural_map(func.body, [(For, on_for)])
        if body.same_as(func.body):
            return func
        # the tail repeats the loop's body: give its variables fresh definitions
        fresh = tvm.tirx.transform.ConvertSSA()(tvm.IRModule({"main": func.with_body(body)}))
        return fresh["main"]

    return transform


def _holds_below(analyzer: Analyzer, cond, var: tirx.Var, inner: list[For], relax: dict):
    """For ``cond`` = ``c·var + r < B`` (or <=): the bound below which it holds for every r, else None."""
    if not isinstance(cond, (tirx.LT, tirx.LE)):
        return None
    bound = cond.b
    if uses(bound, var) or any(uses(bound, lp.loop_var) for lp in inner):
        return None
    coeffs = detect_linear_equation(cond.a, [var])
    if len(coeffs) != 2 or not isinstance(coeffs[0], tirx.IntImm) or coeffs[0].value <= 0:
        return None
    c = coeffs[0].value
    r_max = analyzer.int_set(coeffs[1], relax).max_value
    if isinstance(r_max, tirx.Var) and r_max.name in ("pos_inf", "neg_inf"):
        return None
    if isinstance(cond, tirx.LT):  # c·var + r_max < B  ⇔  var < ceil((B - r_max) / c)
        return tirx.floordiv(bound - r_max + (c - 1), c)
    return tirx.floordiv(bound - r_max, c) + 1


def _min_of(exprs: list):
    out = exprs[0]
    for e in exprs[1:]:
        out = tirx.min(out, e)
    return out


def _drop_conjuncts(body, tests: list):
    def on_realize(node: SBlockRealize):
        kept = [c for c in _conjuncts(node.predicate)
                if not any(tvm_ffi.structural_equal(c, t) for t in tests)]
        if len(kept) == len(_conjuncts(node.predicate)):
            return node
        predicate = tirx.all(*kept) if kept else tirx.const(True, "bool")
        return SBlockRealize(node.iter_values, predicate, node.block, node.span)

    return tvm_ffi.structural_map(body, [(SBlockRealize, on_realize)])


# ---- polynomial exp --------------------------------------------------------------------------------
_EXP, _EXP2, _SIGMOID, _TANH, _ERF, _POW = (tvm.ir.Op.get(f"tirx.{name}")
                                             for name in ("exp", "exp2", "sigmoid", "tanh", "erf", "pow"))
SMALL_POWER = 4  # x**k by multiplication up to this k (GPT-2's GELU cubes its input)


def exact_widenings() -> tvm.transform.Pass:
    """Cast(fp32, Cast(h, B[i])) → B[i] where every store to B (or to a tensorized block's view of
    it: `x86_panels`) is Cast(fp32, x) with x of the 16-bit dtype h: the fp32 panels the CPU schedule
    widens fp16/bf16 operands into once (`unsafe_set_dtype` leaves its readers narrowing back) hold
    values h represents exactly."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.ExactWidenings")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        widened: list[tuple[tirx.Buffer, str | None]] = []  # buffer, the 16-bit dtype of all its stores
        views: list[tuple[tirx.Buffer, tirx.Buffer]] = []  # a tensorized block's match buffer, its source

        def on_block(block: SBlock, visitor) -> None:
            views.extend((m.buffer, m.source.source) for m in block.match_buffers)
            visitor.default_visit(block)

        def on_store(store: tirx.BufferStore, visitor) -> None:
            v = store.value  # a scalar or a vector store (`x86_panels`): its element types
            narrow = _element(v.value) if isinstance(v, tirx.Cast) and _element(v) == "float32" \
                and _element(v.value) in ("float16", "bfloat16") else None
            target = next((source for view, source in views if view.same_as(store.buffer)), store.buffer)
            for i, (buf, dtype) in enumerate(widened):
                if buf.same_as(target):
                    widened[i] = (buf, dtype if dtype == narrow else None)
                    break
            else:
                widened.append((target, narrow))
            visitor.default_visit(store)

        tvm_ffi.structural_visit(func.body, [(SBlock, on_block)])
        tvm_ffi.structural_visit(func.body, [(tirx.BufferStore, on_store)])
        if not any(dtype for _, dtype in widened):
            return func

        def on_cast(cast: tirx.Cast):
            inner = cast.value
            if str(cast.ty.dtype) == "float32" and isinstance(inner, tirx.Cast) \
                    and isinstance(inner.value, TensorLoad):
                narrow = next((d for b, d in widened if b.same_as(inner.value.source)), None)
                if narrow is not None and narrow == str(inner.ty.dtype):
                    return inner.value
            return cast

        return tvm_ffi.structural_map(func, [(tirx.Cast, on_cast)])

    return transform


def _element(value: PrimExpr) -> str:
    """The element dtype of a scalar or vector ``value`` (float16x16 → float16)."""
    dtype = tvm.DataType(str(value.ty.dtype))
    return str(dtype.with_lanes(1)) if dtype.lanes > 1 else str(dtype)


def element_aligned_arguments() -> tvm.transform.Pass:
    """Each argument buffer declared with an alignment of one element (see the module's docstring)."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.ElementAlignedArguments")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        relaxed = {}
        for p in func.params:
            t = p.ty
            element = isinstance(t, tirx.BufferType) and max(tvm.DataType(t.dtype.dtype).bits // 8, 1)
            if element and t.data_alignment > element:
                relaxed[p] = tirx.Var(p.name, tirx.BufferType(t.dtype, t.storage_scope, t.shape, t.strides,
                                                              t.elem_offset, element, t.offset_factor,
                                                              t.layout, t.allocated_addr))
        if not relaxed:
            return func
        body = tvm_ffi.structural_map(func.body, [(tirx.Var, lambda v: next(
            (new for old, new in relaxed.items() if old.same_as(v)), v))])
        return PrimFunc([relaxed.get(p, p) for p in func.params], body, func.ret_type, func.attrs)

    return transform


# 2^r on [0, 1), fitted to the relative error (Remez), highest power first: degree 5, 1.6e-7 in fp32;
# degree 3, 7.5e-5, for bf16 kernels: they round every result to 8 significant bits (half an ulp is
# 2e-3), P for P·V as well, so two fewer FMAs per vector cost nothing visible (3–5 % of a kernel).
EXP2_P = (1.8775766751932426e-3, 8.989340090486452e-3, 5.58263180533071e-2, 0.24015361704436922,
          0.6931530732001702, 0.9999999250635262)
EXP2_P_BF16 = (7.802452264047931e-2, 0.22606715542748335, 0.6958335404947529, 0.9999252185627155)
EXP2_COEFFICIENTS = "tvmattn.exp2_coefficients"  # function attribute: `polynomial_math`'s p, for `vector_exp2`


def polynomial_math(exp2_coefficients: tuple[float, ...] = EXP2_P) -> tvm.transform.Pass:
    """fp32 exp, sigmoid, tanh and erf as vectorisable polynomials, and x**k for a small integer k as
    products: LLVM would otherwise call scalar libm (``expf``, ``tanhf``, ``erff``, ``powf``) per lane.
    exp2 is left for `vector_exp2`, after vectorisation, with ``exp2_coefficients`` (a shorter p where
    the result is rounded coarser, `EXP2_P_BF16`) recorded on the function.

    exp(x) = 2^n · p(r), n = round(x·log2 e), r = x - n·ln 2 (Cody–Waite), p of degree 6: relative
    error about 2e-7 on [-87, 88]; larger inputs are clamped to 88, smaller ones give 0 (a logit of
    -inf has weight 0, not exp(-87) ≈ 1.6e-38), and NaN stays NaN (the clamp's min/max would turn it
    into a number: a NaN input must show in the output). sigmoid(x) = 1 / (1 + exp(-x)). tanh and erf
    are the odd rational approximations Eigen and TVM's ``fast_tanh``/``fast_erf`` use (a few ulp).
    """

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.PolynomialMath")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        def on_call(call):
            if str(getattr(call.ty, "dtype", "")) != "float32":  # (a pointer, an AMX tile's address, has none)
                return call
            if call.op.same_as(_EXP):
                return _exp_f32(call.args[0])
            if call.op.same_as(_SIGMOID):
                return tirx.const(1.0, "float32") / (tirx.const(1.0, "float32") + _exp_f32(-call.args[0]))
            if call.op.same_as(_TANH):
                return _odd_rational(call.args[0], 9.0, TANH_P, TANH_Q)
            if call.op.same_as(_ERF):
                return _odd_rational(call.args[0], 4.0, ERF_P, ERF_Q)
            if call.op.same_as(_POW) and isinstance(call.args[1], tirx.FloatImm):
                k = call.args[1].value
                if k == int(k) and 1 <= k <= SMALL_POWER:
                    out = call.args[0]
                    for _ in range(int(k) - 1):
                        out = out * call.args[0]
                    return out
            return call

        func = tvm_ffi.structural_map(func, [(Call, on_call)])
        return func.with_attr(EXP2_COEFFICIENTS, [float(c) for c in exp2_coefficients])

    return transform


def vector_exp2() -> tvm.transform.Pass:
    """fp32 exp2, after vectorisation (in the CPU pipeline, `build._cpu_pipeline`), as
    2^x = 2^⌊x⌋ · p(x − ⌊x⌋), p of `polynomial_math`'s coefficients on [0, 1).

    With AVX-512, a 16-lane vector is five instructions and a polynomial: ``vreduceps`` gives x − ⌊x⌋
    and ``vscalefps`` multiplies by 2^⌊x⌋, both exact at the edges, so that -inf gives 0, +inf gives
    +inf and NaN stays NaN with no clamp or test of their own (a third of the softmax's instructions
    in the attention kernels). Elsewhere 2^⌊x⌋ is written into the exponent field of x clamped to
    [-127, 128] (0 from -127: no denormals; +inf from 128), and NaN is passed by a select."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.VectorExp2")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        coefficients = tuple(float(c) for c in func.attrs.get(EXP2_COEFFICIENTS, EXP2_P)) \
            if func.attrs is not None else EXP2_P
        target = func.attrs.get("target") if func.attrs is not None else None
        avx512 = target is not None and has_feature(target, "avx512f")

        def on_call(call):
            if not call.op.same_as(_EXP2) or _element(call) != "float32":
                return call
            if avx512 and call.ty.dtype.lanes == AVX512_LANES:
                return _exp2_avx512(call.args[0], coefficients)
            return _exp2_f32(call.args[0], coefficients)

        return tvm_ffi.structural_map(func, [(Call, on_call)])

    return transform


# tanh(x) ≈ x·P(x²)/Q(x²) on [-9, 9] (±1 to fp32 beyond); erf(x) likewise on [-4, 4]. Highest power first.
TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
          1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)
TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)
ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
         -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
         -1.42647390514189e-02)


def _odd_rational(arg: PrimExpr, limit: float, p: tuple, q: tuple) -> PrimExpr:
    f = lambda v: tirx.const(v, "float32")  # noqa: E731
    x = tirx.min(tirx.max(arg, f(-limit)), f(limit))
    x2 = x * x
    num, den = f(p[0]), f(q[0])
    for c in p[1:]:
        num = num * x2 + f(c)
    for c in q[1:]:
        den = den * x2 + f(c)
    return tirx.Select(tirx.isnan(arg), arg, x * num / den)


def _exp2_f32(arg: PrimExpr, coefficients: tuple[float, ...]) -> PrimExpr:
    f = _constant_like(arg)
    # 2^-127 has a zero exponent field: exactly 0, so -inf needs no test of its own (exp's does); 2^128,
    # all ones: +inf
    x = tirx.min(tirx.max(arg, f(-127.0)), f(128.0))
    n = tirx.floor(x)
    r = x - n  # exact
    p = f(coefficients[0])
    for coeff in coefficients[1:]:
        p = p * r + f(coeff)
    return tirx.Select(tirx.isnan(arg), arg, p * _two_to(n))


AVX512_LANES = 16
_REDUCE_FLOOR = 0b1001  # vreduceps imm8: no fraction bits kept, round down, precision exception suppressed
_CURRENT_ROUNDING = 4  # the intrinsics' rounding argument: MXCSR's, no embedded rounding
_ALL_LANES = -1  # the intrinsics' write mask, i16


def _exp2_avx512(x: PrimExpr, coefficients: tuple[float, ...]) -> PrimExpr:
    """2^x for a float32x16 ``x``: vscalefps(p(vreduceps(x)), x) (see `vector_exp2`)."""
    f = _constant_like(x)
    dtype = str(x.ty.dtype)
    mask, rounding = tirx.const(_ALL_LANES, "int16"), tirx.const(_CURRENT_ROUNDING, "int32")
    r = tirx.call_llvm_pure_intrin(dtype, "llvm.x86.avx512.mask.reduce.ps.512", x,
                                   tirx.const(_REDUCE_FLOOR, "int32"), x, mask, rounding)  # x − ⌊x⌋ ∈ [0, 1)
    p = f(coefficients[0])
    for coeff in coefficients[1:]:
        p = p * r + f(coeff)
    return tirx.call_llvm_pure_intrin(dtype, "llvm.x86.avx512.mask.scalef.ps.512", p, x, p, mask, rounding)


def _constant_like(x: PrimExpr):
    """fp32 constants of ``x``'s lane count (a Broadcast for a vector)."""
    lanes = x.ty.dtype.lanes
    return lambda v: tirx.const(v, "float32") if lanes == 1 else tirx.Broadcast(tirx.const(v, "float32"), lanes)


def _two_to(n: PrimExpr) -> PrimExpr:
    """2^n for an integral fp32 n in [-127, 128]: n + 127 written into the exponent field."""
    lanes = n.ty.dtype.lanes
    typed = lambda t: t if lanes == 1 else f"{t}x{lanes}"  # noqa: E731
    word = lambda c: tirx.const(c, "int32") if lanes == 1 else tirx.Broadcast(tirx.const(c, "int32"), lanes)  # noqa: E731
    return tirx.reinterpret(typed("float32"), tirx.shift_left(tirx.Cast(typed("int32"), n) + word(127), word(23)))


def _exp_f32(arg: PrimExpr) -> PrimExpr:
    f = lambda v: tirx.const(v, "float32")  # noqa: E731
    x = tirx.min(tirx.max(arg, f(-87.0)), f(88.0))
    n = tirx.floor(x * f(1.44269504088896341) + f(0.5))
    r = x - n * f(0.693359375) + n * f(2.12194440e-4)  # ln 2 split in two for exactness
    p = f(1.9875691500e-4)
    for coeff in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(coeff)
    p = p * r * r + r + f(1.0)
    return tirx.Select(arg < f(-87.0), f(0.0), tirx.Select(tirx.isnan(arg), arg, p * _two_to(n)))
