"""Tail predicates kept off the micro-kernels: query tiles computed whole (`pad_query_tiles`), a GEMM's
row tail clamped (`clamp_row_tails`), symbolic loops' tails peeled (`peel_key_tails`), clamped reads
along a vector unclamped where the vector is whole (`unclamp_whole_vectors`)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir import SBlock, SBlockRealize
from tvm.sym import Analyzer, IntervalSet
from tvm.sym.pattern import detect_linear_equation
from tvm.tirx import For, ForKind, PrimFunc

from tvmattn.compiler.annotations import PADDED_AXES, QUERY_AXIS, STACK_TILES
from tvmattn.compiler.passes.ir import conjuncts, substitute, uses, visit_blocks
from tvmattn.compiler.passes.key_tiles import GUARD_NAME


# ---- query tiles computed whole ------------------------------------------------------------------
def pad_query_tiles() -> tvm.transform.Pass:
    """A PrimFunc pass that lets the last query tile compute all its rows.

    Splitting the query axis by the tile leaves a predicate ``s < n`` on every block computed in the
    task (from the split, and from laying tile buffers out as (tile, …, s % q_tile)); inside the
    vectorised loops over queries it is a per-lane condition, so TVM scalarises each micro-kernel
    (per element branches, no register tiles). For a symbolic n every tile pays it, for a static n
    the tail tile does. The rows past n only feed rows past n, and every stage is row-wise, so a
    block may compute them if each buffer it writes at a query index is task-local (read and
    written only inside the same outermost loop, not a parameter, so sized by the tile): the packed
    queries, the score, probability and accumulator tiles. A copy into such a tile that its schedule
    marks (`QUERY_AXIS`: an attn_mask's tile) reads row n - 1 of its source for the rows past n;
    other blocks reading a parameter or a global intermediate by query (the query pack, q_proj) and
    the stores of the output or of an intermediate that a later loop reads (attn before W_O) keep
    their predicate.
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

        visit_blocks(func.body, on_block)
        analyzer = Analyzer()

        def local(buffer, top) -> bool:
            tops_of = [t for b, t in users if b.same_as(buffer)]
            return (top is not None and not any(buffer.same_as(p) for p in params)
                    and bool(tops_of) and all(t is not None and t.same_as(top) for t in tops_of))

        def on_realize_map(node: SBlockRealize):
            block = node.block
            s_iter = next((i for i, iv in enumerate(block.iter_vars) if iv.var.name == "v_s"),
                          None if QUERY_AXIS not in block.annotations else int(block.annotations[QUERY_AXIS]))
            if s_iter is None or isinstance(node.predicate, tirx.IntImm):
                return node
            s_var, s_value = block.iter_vars[s_iter].var, node.iter_values[s_iter]
            top = next((t for b, t in tops.items() if b.same_as(block) or b.name_hint == block.name_hint), None)
            by_query = lambda region: any(uses(r.min, s_var) or uses(r.extent, s_var)  # noqa: E731
                                          for r in region.region)
            if any(by_query(w) and not local(w.source, top) for w in block.writes):
                return node
            outside = [r.source for r in block.reads if by_query(r) and not local(r.source, top)]
            bounds = [c for c in conjuncts(node.predicate) if _bounds(analyzer, c, s_value)]
            copy = QUERY_AXIS in block.annotations  # (a copy into the tile, marked by its schedule)
            if outside and not (copy and len(bounds) == 1 and isinstance(bounds[0], tirx.LT)):
                return node
            kept = [c for c in conjuncts(node.predicate) if not _bounds(analyzer, c, s_value)]
            predicate = tirx.all(*kept) if kept else tirx.const(True, "bool")
            if outside:  # (a copy into the tile: its rows past n read row n - 1)
                block = _rows_clamped(block, outside, {s_var: tirx.min(s_var, bounds[0].b - 1)})
            return SBlockRealize(node.iter_values, predicate, block, node.span)

        return func.with_body(tvm_ffi.structural_map(func.body, [(SBlockRealize, on_realize_map)]))

    return transform


def _rows_clamped(block: SBlock, buffers: list, clamp: dict) -> SBlock:
    """``block`` reading ``buffers`` at the ``clamp``ed indices."""
    body, reads = _reads_clamped(block, clamp, lambda buffer: any(buffer.same_as(b) for b in buffers))
    return SBlock(block.iter_vars, reads, block.writes, block.name_hint, body, block.init, block.alloc_buffers,
                  block.match_buffers, block.annotations)


def _reads_clamped(block: SBlock, clamp: dict, chosen) -> tuple:
    """(body, reads) of ``block`` with its loads of the buffers ``chosen(buffer)`` picks at the ``clamp``ed
    indices."""

    def on_load(load):
        if not chosen(load.source):
            return load
        return tirx.BufferLoad(load.source, [substitute(i, clamp) for i in load.indices])

    return tvm_ffi.structural_map(block.body, [(TensorLoad, on_load)]), _regions_clamped(block.reads, clamp, chosen)


def _regions_clamped(regions, clamp: dict, chosen) -> list:
    return [tirx.BufferRegion(r.source, [tvm.ir.Range.from_min_extent(substitute(x.min, clamp), x.extent)
                                         for x in r.region]) if chosen(r.source) else r for r in regions]


def clamp_row_tails() -> tvm.transform.Pass:
    """A PrimFunc pass for row tails in blocks that only write local (register) buffers.

    Splitting rows by a register tile leaves ``row < M`` on every block of the tile; inside the
    unrolled, vectorised micro-kernel that is a branch per FMA. A block writing only local buffers may
    compute the tail's missing rows (nothing outside the tile sees them), so its test becomes one on
    the tile's first row (the unrolled and vector loops at 0) and its reads of other buffers take row
    min(row, M - 1): in bounds, and equal to row M - 1's. An iterator the block's ``PADDED_AXES``
    annotation names (columns of a weight zero-padded to whole tiles) keeps only the tile's test,
    unclamped: the tile's padding columns are in the weight.

    Where M is symbolic, the tile's store (a block reading such a tile, writing a parameter) is treated
    the same way: its rows past M write row M - 1 again, with row M - 1's value (its inputs were
    clamped alike), so it needs no test per row. Per-row tests there made LLVM keep the accumulators in
    memory (the tile's workspace) and copy them out row by row: Wav2Vec2's first convolution (K = 10)
    at 92 GFLOP/s symbolic, 138 static. Such a tile is named in the function's ``STACK_TILES`` for
    `stack_tiles`: in TVM's workspace LLVM still stores it before each tile's store. A static row count
    keeps the test: it has at most one tail tile.
    """

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.ClampRowTails")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        analyzer = Analyzer()
        in_tile: dict[str, dict] = {}  # block name -> the loop variables of its register tile, at 0

        def on_block(node: SBlockRealize, loops: list[For]) -> None:
            in_tile[node.block.name_hint] = {lp.loop_var: tirx.const(0, lp.loop_var.ty.dtype) for lp in loops
                                             if lp.kind in (ForKind.UNROLLED, ForKind.VECTORIZED)}

        visit_blocks(func.body, on_block)
        tiles = []  # the local buffers the register tiles accumulate in
        stacked: list[str] = []  # those whose store was clamped

        def on_realize(node: SBlockRealize):
            block = node.block
            if isinstance(node.predicate, tirx.IntImm) or not block.writes:
                return node
            if any(w.source.scope() != "local" for w in block.writes):
                return _clamped_store(node)
            terms = conjuncts(node.predicate)
            kept, clamp = [], {}
            padded = [int(i) for i in block.annotations.get(PADDED_AXES, [])]
            for cond in terms:
                at = _row_test(cond, node)
                if at is None:
                    kept.append(cond)
                    continue
                if at not in padded:
                    var = block.iter_vars[at].var
                    clamp[var] = tirx.min(var, cond.b - 1)
                kept.append(analyzer.simplify(substitute(cond, in_tile.get(block.name_hint, {}))))

            if not clamp and all(k.same_as(c) for k, c in zip(kept, terms)):
                return node
            tiles.extend(w.source for w in block.writes)
            return _with(node, kept, clamp)

        def _row_test(cond, node: SBlockRealize) -> int | None:
            """The iterator ``cond`` bounds (``v < M``, v a spatial iterator's value), else None."""
            return next((i for i, v in enumerate(node.iter_values) if isinstance(cond, tirx.LT)
                         and node.block.iter_vars[i].iter_type == tirx.IterVar.DataPar
                         and analyzer.can_prove_equal(cond.a, v)), None)

        def _clamped_store(node: SBlockRealize):
            """The store of a clamped tile: rows past a symbolic M write row M - 1 (see above)."""
            block = node.block
            if not any(r.source.same_as(t) for r in block.reads for t in tiles) or len(block.writes) != 1 or \
                    not isinstance(block.body, tirx.BufferStore):
                return node
            terms = conjuncts(node.predicate)
            rows = [(at, cond) for cond in terms if (at := _row_test(cond, node)) is not None
                    and not isinstance(cond.b, tirx.IntImm)]
            if len(rows) != 1:
                return node
            at, row_cond = rows[0]
            var = block.iter_vars[at].var
            # the loops of the tile the row runs over, at 0: the tests become the tile's first row's
            row_loops = {v: z for v, z in in_tile.get(block.name_hint, {}).items() if uses(node.iter_values[at], v)}
            kept = [analyzer.simplify(substitute(c, row_loops)) for c in terms]
            stacked.extend(r.source.name for r in block.reads if r.source.scope() == "local")
            return _with(node, kept, {var: tirx.min(var, row_cond.b - 1)}, store=True)

        def _with(node: SBlockRealize, kept: list, clamp: dict, store: bool = False) -> SBlockRealize:
            """``node`` under the predicate ``kept``, its non-local accesses (and, for a ``store``, its
            write) at the ``clamp``ed indices."""
            block = node.block
            outside = lambda buffer: buffer.scope() != "local"  # noqa: E731
            body, reads = _reads_clamped(block, clamp, outside)
            writes = block.writes
            if store:
                body = tirx.BufferStore(body.buffer, body.value, [substitute(i, clamp) for i in body.indices])
                writes = _regions_clamped(writes, clamp, outside)
            new = SBlock(block.iter_vars, reads, writes, block.name_hint, body, block.init,
                         block.alloc_buffers, block.match_buffers, block.annotations)
            predicate = tirx.all(*kept) if kept else tirx.const(True, "bool")
            return SBlockRealize(node.iter_values, predicate, new, node.span)

        func = func.with_body(tvm_ffi.structural_map(func.body, [(SBlockRealize, on_realize)]))
        return func.with_attr(STACK_TILES, sorted(set(stacked))) if stacked else func

    return transform


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
            if any(r.block.match_buffers for r in realizes):
                # (a copy would share a tensorized block's match buffers, whose offsets TVM binds once:
                # over the original's loop variables, not the copy's, which `ConvertSSA` renames)
                return node
            relax = {lp.loop_var: IntervalSet(lp.min, lp.min + lp.extent - 1) for lp in inner}
            tests, cuts = [], []
            for realize in realizes:
                for cond in conjuncts(realize.predicate):
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
        kept = [c for c in conjuncts(node.predicate)
                if not any(tvm_ffi.structural_equal(c, t) for t in tests)]
        if len(kept) == len(conjuncts(node.predicate)):
            return node
        predicate = tirx.all(*kept) if kept else tirx.const(True, "bool")
        return SBlockRealize(node.iter_values, predicate, node.block, node.span)

    return tvm_ffi.structural_map(body, [(SBlockRealize, on_realize)])


# ---- clamped reads along a vector ------------------------------------------------------------------
def unclamp_whole_vectors() -> tvm.transform.Pass:
    """A PrimFunc pass: a vectorised loop whose blocks read at a clamped index ``min(x, B)`` with x
    running along the vector (a padded copy of a symbolic length: `te_attention._core`'s mask_rows)
    runs, where every lane has x <= B, a copy of itself without the clamp. LLVM makes a clamp along a
    vector a gather per vector (vgatherdps: 15 % of a symbolic bf16 kernel with a (b, h, s, t) mask);
    the copy's loads are plain vector loads, and only a length's last vector keeps the gather."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.UnclampWholeVectors")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        analyzer = Analyzer()

        def on_for(node: For):
            if node.kind != ForKind.VECTORIZED or not isinstance(node.extent, tirx.IntImm):
                return node
            loops: list[For] = [node]
            realizes: list[SBlockRealize] = []
            tvm_ffi.structural_walk(node.body, [(For, loops.append), (SBlockRealize, realizes.append)])
            relax = {lp.loop_var: IntervalSet(lp.min, lp.min + lp.extent - 1) for lp in loops}
            clamps, tests = [], []
            for realize in realizes:
                binding = {iv.var: v for iv, v in zip(realize.block.iter_vars, realize.iter_values)}
                for clamp in _clamped_indices(realize.block.body):
                    x, bound = substitute(clamp.a, binding), substitute(clamp.b, binding)
                    if not uses(x, node.loop_var) or any(uses(bound, lp.loop_var) for lp in loops):
                        continue
                    top = analyzer.int_set(x, relax).max_value
                    if isinstance(top, tirx.Var) and top.name in ("pos_inf", "neg_inf"):
                        continue
                    clamps.append(clamp)
                    tests.append(analyzer.simplify(top <= bound))

            if not clamps:
                return node

            def unclamped(expr):
                return expr.a if any(tvm_ffi.structural_equal(expr, c) for c in clamps) else expr

            whole = tvm_ffi.structural_map(node, [(SBlock, lambda b: tvm_ffi.structural_map(
                b, [(tirx.Min, unclamped)]))])
            return tirx.IfThenElse(tirx.all(*tests), whole, node)

        body = tvm_ffi.structural_map(func.body, [(For, on_for)])
        if body.same_as(func.body):
            return func
        fresh = tvm.tirx.transform.ConvertSSA()(tvm.IRModule({"main": func.with_body(body)}))  # (two copies)
        return fresh["main"]

    return transform


def _clamped_indices(body) -> list:
    """The ``min(x, B)`` of ``body``'s loads' indices."""
    found: list = []

    def on_load(load):
        for index in load.indices:
            tvm_ffi.structural_walk(index, [(tirx.Min, found.append)])

    tvm_ffi.structural_walk(body, [(TensorLoad, on_load)])
    return found
