"""Paged decode and ragged prefill on the CPU (`paged.PagedSpec`): TIR kernels written loop by loop, as
no schedule of the dense tensor expression reads keys through a block table.

    tasks     (chunk, sequence, KV head), the chunk outermost: one parallel loop whose static split
              over the threads gives each thread the same share of every sequence's keys, so a long
              sequence among short ones does not serialise (split-K balanced across a ragged batch)
    a task    the keys [lo + span·c/C, lo + span·(c+1)/C) of its sequence (span: the keys its queries
              can see, `variant.key_range`), in blocks of `BLOCK`: each key's page looked up once
              (clamped into the cache: never a read outside it), its K row read once for the
              n·group query rows of its KV head (GQA), dot products along d in vectors of partial
              sums summed as a tree; then an online softmax in base 2 (`variant.logit`'s hooks:
              softcap, ALiBi, window, causal), and P·V with the rows' accumulators in registers
    combine   per (sequence, query, head): the chunks' partial maxima, sums and outputs merged,
              with the sink's term (`variant.denominator`), 0 for a row that saw no key

    prefill   ragged queries (``q_len=None``): a task per (query tile, sequence, KV heads), the tiles
              of each sequence dealt to the chunks in turn, all keys a tile sees in its task (the same
              block step, `attend`), its rows normalised and stored at once

The plan (`PagedPlan`) makes every choice once: vector lanes, chunks, rows and KV heads per task.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target

from tvmattn.compiler import variant
from tvmattn.compiler.isa.panels import shuffle
from tvmattn.compiler.paged import PagedSpec
from tvmattn.compiler.target import cores_of, isa_of
from tvmattn.compiler.te_attention import LOG2E
from tvmattn.compiler.variant import ACC
from tvmattn.schedules.primitives import lanes_for

CACHE_LINE = 64  # bytes
QUERY_TILE = 4  # ragged prefill: queries per task (with a group of 4, 16 rows share each K/V read)
BLOCK = 16  # keys per online-softmax step: one vector of their logits
# fp32 accumulators (rows · d) of the KV heads one task reads together: as many heads as fit. One
# task's block then requests more rows at once (NHD: a key's row of every head, one contiguous run;
# per head, rows 4 KiB apart each cost a TLB miss): fp32 B=4 2048/37/513/1000, 32/8 heads, d=128,
# page 16, 1 → 8 heads a task, HND 2.31 → 1.90 ms, NHD 2.30 → 1.45 ms (one process, interleaved).
ACCUMULATORS = 8192
LOWEST = -3.0e38  # a running maximum before any key: finite, so exp2(m − m_new) is 1 or 0, never NaN


@dataclass(frozen=True)
class PagedPlan:
    """The decisions of one paged decode kernel."""

    spec: PagedSpec
    lanes: int  # fp32 lanes of the vectors along d
    chunks: int  # key chunks per sequence: the cores (each thread takes whole chunks of every sequence)
    rows: int  # query rows sharing each K/V read: q_len · group
    heads_per_task: int  # KV heads a task reads together (`ACCUMULATORS`)
    prefetch: bool = True  # the next block's K and V rows prefetched
    decode: "PagedPlan | None" = None  # ragged queries: the plan of a batch of one query per sequence

    def describe(self) -> str:
        shared = (f"{self.rows} query rows × {self.heads_per_task} KV heads per K/V read, {self.lanes}-lane dot "
                  f"products along d, {BLOCK}-key softmax blocks")
        if self.spec.ragged:
            return (f"paged prefill: tiles of {QUERY_TILE} queries dealt to {self.chunks} chunks, {shared}; "
                    f"one query per sequence: {self.decode.describe()}")
        return f"paged decode: {self.chunks} key chunks per sequence, {shared}"


def plan_of(spec: PagedSpec, target: Target) -> PagedPlan:
    isa = isa_of(target)
    cores = cores_of(target)
    rows = (spec.q_len or QUERY_TILE) * spec.group
    heads = max(k for k in range(1, spec.h_kv + 1) if spec.h_kv % k == 0 and (k == 1 or k * rows * spec.head_dim
                                                                               <= ACCUMULATORS))
    decode = plan_of(spec.replace(q_len=1), target) if spec.ragged else None
    return PagedPlan(spec, lanes_for(spec.head_dim, isa.lanes if isa else 8), max(cores, 1), rows, heads,
                     decode=decode)


def bodies(plan: PagedPlan):
    """The kernel's body for ``plan`` as a macro: a decode step's (``decode_body``) or, for ragged
    queries, the prefill's (`_prefill_body`), both on the one block step (`attend`) and the variant
    hooks; their callers' arguments reach them through ``query_at``, ``page_at`` and ``length_of``."""
    spec, a = plan.spec, plan.spec.attention
    H, HKV, G, D, P, N = spec.h, spec.h_kv, spec.group, spec.head_dim, spec.page_size, spec.q_len
    R, LANES, C, dt = plan.rows, plan.lanes, plan.chunks, spec.dtype
    KT = plan.heads_per_task
    TASKS = HKV // KT
    QT = R // G  # queries per task
    LOG2P, VECS = P.bit_length() - 1, D // LANES
    STEP = CACHE_LINE // tvm.DataType(dt).bits * 8  # elements of a cache line
    LINES = -(-D // STEP) if plan.prefetch else 0
    nhd = spec.kv_layout == "NHD"

    def cache_at(cache, page, row, kvh, e):
        return cache[page, row, kvh, e] if nhd else cache[page, kvh, row, e]

    def keys(length, s0, count, n_q):
        """(first, end): the keys that queries s0 … s0 + count − 1 of n_q see (`variant.key_range`)."""
        lo, hi = variant.key_range(a, s0, s0 + count - 1, length, n_q)
        return tirx.const(0, "int32") if lo is None else tirx.max(lo, 0), hi

    def span(length, c):
        """The first key of chunk ``c``'s share of the keys a decode step's queries see (c = C: the end),
        on a multiple of `BLOCK` keys: with pages of at least `BLOCK` keys a block then lies in one page."""
        lo, hi = keys(length, tirx.const(0, "int32"), N, tirx.const(N, "int32"))
        count = tirx.max(hi - lo, 0)
        return tirx.Select(c == C, lo + count, lo + count * c // C // BLOCK * BLOCK)

    def logit(slopes, score, r, t, length, kvh, live, s0, n_q):
        """The base-2 logit of row r (query s0 + r // G, head kvh·G + r % G) and key t; −inf where hidden."""
        s, head = s0 + r // G, kvh * G + r % G
        slope = slopes[head] if spec.alibi is not None else None
        x = variant.logit(a, score, s, t, length, n_q, None, slope, LOG2E)
        seen = variant.visible(a, s, t, length, n_q, variant.tir_all)
        return tirx.Select(live if seen is None else tirx.all(live, seen), x, -tirx.infinity(ACC))

    def tree(buf, at, width, op):
        """op over buf[*at, 0:width] (a power of two) in log2(width) vector steps."""
        x = buf.vload([*at, 0], f"float32x{width}")
        while width > 1:
            width //= 2
            x = op(shuffle([x], list(range(width))), shuffle([x], list(range(width, 2 * width))))
        return x

    def denominator(sinks, total, row_max, head):
        return variant.denominator(a, total, row_max, sinks[head] if spec.sinks else None, LOG2E)

    add, biggest = (lambda x, y: x + y), tirx.max  # noqa: E731

    @T.macro
    def attend(K, V, page_at, SLOPES, pages, qs, m, ls, acc, x, part, pg, row, b, first, length, t_begin, t_end,
               s0, queries, n_q):
        """The rows' online softmax over keys [t_begin, t_end) of sequence b: the task's state (qs, m, ls,
        acc) updated; rows of queries from s0 + ``queries`` on are hidden."""
        for blk in range((t_end - t_begin + BLOCK - 1) // BLOCK):
            t0 = t_begin + blk * BLOCK
            live = T.min(BLOCK, t_end - t0)
            for tt in range(live):
                pg[tt] = T.max(T.min(page_at(b, T.shift_right(t0 + tt, LOG2P)), pages - 1), 0)
                row[tt] = T.bitwise_and(t0 + tt, P - 1)
            # The next block's K and V rows requested now, computed on next: its pages lie anywhere
            # in the pool, and the hardware's prefetchers stop at every 4 KiB page.
            for tt in range(T.max(T.min(BLOCK, t_end - t0 - BLOCK), 0)):
                ahead = t0 + BLOCK + tt
                page = T.max(T.min(page_at(b, T.shift_right(ahead, LOG2P)), pages - 1), 0)
                for kv, line in T.grid(KT, LINES):
                    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(cache_at(
                        K, page, T.bitwise_and(ahead, P - 1), first + kv, line * STEP)), 0, 3, 1))
                    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(cache_at(
                        V, page, T.bitwise_and(ahead, P - 1), first + kv, line * STEP)), 0, 3, 1))
            for tt, kv in T.grid(live, KT):
                for r in T.unroll(R):
                    for lane in T.vectorized(LANES):
                        part[r, lane] = T.float32(0)
                for e0 in range(VECS):
                    for r in T.unroll(R):
                        for lane in T.vectorized(LANES):
                            part[r, lane] = part[r, lane] + qs[kv, r, e0 * LANES + lane] * T.Cast(
                                "float32", cache_at(K, pg[tt], row[tt], first + kv, e0 * LANES + lane))
                for r in T.unroll(R):
                    x[kv, r, tt] = tree(part, [r], LANES, add)
            for kv, r in T.grid(KT, R):
                for tt in T.vectorized(BLOCK):
                    x[kv, r, tt] = logit(SLOPES, x[kv, r, tt], r, t0 + tt, length, first + kv,
                                         T.And(tt < live, r // G < queries), s0, n_q)
                m_new = T.max(m[kv, r], tree(x, [kv, r], BLOCK, biggest))
                correction = T.exp2(m[kv, r] - m_new)
                for tt in T.vectorized(BLOCK):
                    x[kv, r, tt] = T.Select(T.And(tt < live, r // G < queries), T.exp2(x[kv, r, tt] - m_new),
                                            T.float32(0))
                ls[kv, r] = ls[kv, r] * correction + tree(x, [kv, r], BLOCK, add)
                m[kv, r] = m_new
                for e in T.vectorized(D):
                    acc[kv, r, e] = acc[kv, r, e] * correction
            for kv, e0 in T.grid(KT, VECS):
                for tt in range(live):
                    for r in T.unroll(R):
                        for lane in T.vectorized(LANES):
                            acc[kv, r, e0 * LANES + lane] = acc[kv, r, e0 * LANES + lane] + x[kv, r, tt] * T.Cast(
                                "float32", cache_at(V, pg[tt], row[tt], first + kv, e0 * LANES + lane))

    @T.macro
    def start(qs, m, ls, acc, query_at, first):
        """A task's rows before any key: queries loaded (``query_at(s, head, e)``), maxima at LOWEST."""
        for kv, r in T.grid(KT, R):
            m[kv, r] = T.float32(LOWEST)
            ls[kv, r] = T.float32(0)
            for e in T.vectorized(D):
                qs[kv, r, e] = T.Cast("float32", query_at(r // G, (first + kv) * G + r % G, e))
                acc[kv, r, e] = T.float32(0)

    @T.macro
    def decode_body(query_at, K, V, page_at, length_of, SINKS, SLOPES, O, LSE, with_lse, batch, pages):
        """The decode step (``N`` queries a sequence): a task per (key chunk, sequence, KV heads), then
        the combine. ``query_at(b, s, head, e)``, ``page_at(b, j)`` (sequence b's page j) and ``length_of(b)``
        (its keys, within its pages) read the caller's arguments; ``with_lse``: each row's log-sum-exp of
        its base-2 logits into LSE[b, s·h + head] (TVM's paged cache merges partial attentions by it)."""
        part_m = T.alloc_buffer((C, batch, N * H), "float32")
        part_l = T.alloc_buffer((C, batch, N * H), "float32")
        part_o = T.alloc_buffer((C, batch, N * H, D), "float32")
        for task in T.parallel(C * batch * TASKS):
            c = task // (batch * TASKS)
            b = task // TASKS % batch
            first = task % TASKS * KT  # the task's first KV head
            length = length_of(b)
            qs = T.alloc_buffer((KT, R, D), "float32", scope="local")
            m = T.alloc_buffer((KT, R), "float32", scope="local")
            ls = T.alloc_buffer((KT, R), "float32", scope="local")
            acc = T.alloc_buffer((KT, R, D), "float32", scope="local")
            x = T.alloc_buffer((KT, R, BLOCK), "float32", scope="local")
            part = T.alloc_buffer((R, LANES), "float32", scope="local")
            pg = T.alloc_buffer((BLOCK,), "int32", scope="local")
            row = T.alloc_buffer((BLOCK,), "int32", scope="local")
            start(qs, m, ls, acc, lambda s, head, e: query_at(b, s, head, e), first)
            attend(K, V, page_at, SLOPES, pages, qs, m, ls, acc, x, part, pg, row, b, first, length,
                   span(length, c), span(length, c + 1), 0, N, N)
            for kv, r in T.grid(KT, R):
                part_m[c, b, r // G * H + (first + kv) * G + r % G] = m[kv, r]
                part_l[c, b, r // G * H + (first + kv) * G + r % G] = ls[kv, r]
                for e in T.vectorized(D):
                    part_o[c, b, r // G * H + (first + kv) * G + r % G, e] = acc[kv, r, e]
        for job in T.parallel(batch * N * H):
            b = job // (N * H)
            sh = job % (N * H)
            top = T.alloc_buffer((1,), "float32", scope="local")
            total = T.alloc_buffer((1,), "float32", scope="local")
            out = T.alloc_buffer((D,), "float32", scope="local")
            top[0] = T.float32(LOWEST)
            total[0] = T.float32(0)
            for e in T.vectorized(D):
                out[e] = T.float32(0)
            for c in range(C):
                top[0] = T.max(top[0], part_m[c, b, sh])
            for c in range(C):
                weight = T.exp2(part_m[c, b, sh] - top[0])
                total[0] = total[0] + part_l[c, b, sh] * weight
                for e in T.vectorized(D):
                    out[e] = out[e] + part_o[c, b, sh, e] * weight
            for e in T.vectorized(D):
                O[b, sh // H, sh % H, e] = T.Cast(dt, variant.normalise(
                    out[e], denominator(SINKS, total[0], top[0], sh % H)))
            if with_lse:
                LSE[b, sh] = T.Select(total[0] > T.float32(0), top[0] + T.log2(total[0]), T.float32(LOWEST))

    if N is None:
        return _prefill_body(locals())
    return decode_body


def paged_kernel(plan: PagedPlan) -> tirx.PrimFunc:
    """The kernel of ``plan``: `paged.PagedSpec`'s call order, then out; sinks and alibi_slopes (h,)
    float32 always taken, read only where the spec has them. A spec with ``q_len=None`` (ragged
    queries) gets the prefill kernel (`_ragged`), whose batches of one query per sequence take the
    decode step's body."""
    spec = plan.spec
    if spec.ragged:
        return _ragged(plan, bodies(plan), bodies(plan.decode))
    H, D, N, P, dt = spec.h, spec.head_dim, spec.q_len, spec.page_size, spec.dtype
    decode_body = bodies(plan)

    @T.prim_func
    def main(q_h: T.handle, k_h: T.handle, v_h: T.handle, bt_h: T.handle, lens_h: T.handle, sinks_h: T.handle,
             slopes_h: T.handle, o_h: T.handle):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        batch = T.int32()
        pages = T.int32()
        width = T.int32()
        Q = T.match_buffer(q_h, (batch, N, H, D), dt)
        K = T.match_buffer(k_h, spec.cache_shape(pages), dt)
        V = T.match_buffer(v_h, spec.cache_shape(pages), dt)
        TABLE = T.match_buffer(bt_h, (batch, width), "int32")
        LENS = T.match_buffer(lens_h, (batch,), "int32")
        SINKS = T.match_buffer(sinks_h, (H,), "float32")
        SLOPES = T.match_buffer(slopes_h, (H,), "float32")
        O = T.match_buffer(o_h, (batch, N, H, D), dt)
        decode_body(lambda b, s, head, e: Q[b, s, head, e], K, V, lambda b, j: TABLE[b, j],
                    lambda b: T.max(T.min(LENS[b], width * P), 0),  # (checked by the caller; clamped all the same)
                    SINKS, SLOPES, O, SINKS, False, batch, pages)

    return main


def _ragged(plan: PagedPlan, prefill, decode_body) -> tirx.PrimFunc:
    """The prefill kernel of ragged queries: q (total_q, h, d), sequence b's queries
    q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]], the last of its keys (bottom-right). A batch of one
    query per sequence (cu_seqlens_q = 0, 1, …, B: every decode step of a server) takes
    ``decode_body`` instead, q read as (B, 1, h, d): its keys split over the threads, whatever the lengths."""
    spec = plan.spec
    H, D, P, dt = spec.h, spec.head_dim, spec.page_size, spec.dtype

    @T.prim_func
    def main(q_h: T.handle, k_h: T.handle, v_h: T.handle, bt_h: T.handle, lens_h: T.handle, cu_h: T.handle,
             sinks_h: T.handle, slopes_h: T.handle, o_h: T.handle):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        batch = T.int32()
        pages = T.int32()
        width = T.int32()
        total_q = T.int32()
        Q = T.match_buffer(q_h, (total_q, H, D), dt)
        K = T.match_buffer(k_h, spec.cache_shape(pages), dt)
        V = T.match_buffer(v_h, spec.cache_shape(pages), dt)
        TABLE = T.match_buffer(bt_h, (batch, width), "int32")
        LENS = T.match_buffer(lens_h, (batch,), "int32")
        CU = T.match_buffer(cu_h, (batch + 1,), "int32")
        SINKS = T.match_buffer(sinks_h, (H,), "float32")
        SLOPES = T.match_buffer(slopes_h, (H,), "float32")
        O = T.match_buffer(o_h, (total_q, H, D), dt)
        single = T.alloc_buffer((1,), "int32", scope="local")
        single[0] = T.Select(total_q == batch, 1, 0)
        for b in range(batch + 1):
            if CU[b] != b:
                single[0] = 0
        if single[0] == 1:
            OD = T.decl_buffer((batch, 1, H, D), dt, data=O.data)
            decode_body(lambda b, s, head, e: Q[b, head, e], K, V, lambda b, j: TABLE[b, j],
                        lambda b: T.max(T.min(LENS[b], width * P), 0), SINKS, SLOPES, OD, SINKS, False, batch, pages)
        else:
            prefill(lambda t, head, e: Q[t, head, e], K, V, lambda b, j: TABLE[b, j],
                    lambda b: T.max(T.min(LENS[b], width * P), 0), CU, SINKS, SLOPES, O, SINKS, False, batch, pages,
                    total_q)

    return main


def _prefill_body(scope: dict):
    """The ragged kernel's own body: a task per (query tile, sequence, KV heads), each sequence's tiles
    dealt to the chunks in turn (tile i to chunk i mod C), all of a tile's keys in it, no combine.
    Sequence b's queries are rows CU[b] … CU[b + 1] − 1 of O (and of ``query_at(t, head, e)``)."""
    H, D, G, R, C, KT, TASKS, QT, LANES, dt = (scope[k] for k in (
        "H", "D", "G", "R", "C", "KT", "TASKS", "QT", "LANES", "dt"))
    attend, start, keys, denominator = scope["attend"], scope["start"], scope["keys"], scope["denominator"]

    @T.macro
    def prefill(query_at, K, V, page_at, length_of, CU, SINKS, SLOPES, O, LSE, with_lse, batch, pages, total_q):
        for task in T.parallel(C * batch * TASKS):
            c = task // (batch * TASKS)
            b = task // TASKS % batch
            first = task % TASKS * KT
            length = length_of(b)
            q0 = T.max(T.min(CU[b], total_q), 0)  # (checked by the caller; clamped all the same)
            n_q = T.max(T.min(CU[b + 1], total_q) - q0, 0)
            qs = T.alloc_buffer((KT, R, D), "float32", scope="local")
            m = T.alloc_buffer((KT, R), "float32", scope="local")
            ls = T.alloc_buffer((KT, R), "float32", scope="local")
            acc = T.alloc_buffer((KT, R, D), "float32", scope="local")
            x = T.alloc_buffer((KT, R, BLOCK), "float32", scope="local")
            part = T.alloc_buffer((R, LANES), "float32", scope="local")
            pg = T.alloc_buffer((BLOCK,), "int32", scope="local")
            row = T.alloc_buffer((BLOCK,), "int32", scope="local")
            for k in range(T.max((n_q + QT - 1) // QT - c + C - 1, 0) // C):
                s0 = (c + k * C) * QT
                queries = T.min(QT, n_q - s0)
                start(qs, m, ls, acc, lambda s, head, e: query_at(q0 + T.min(s0 + s, n_q - 1), head, e), first)
                attend(K, V, page_at, SLOPES, pages, qs, m, ls, acc, x, part, pg, row, b, first, length,
                       keys(length, s0, queries, n_q)[0], keys(length, s0, queries, n_q)[1], s0, queries, n_q)
                for kv, r in T.grid(KT, R):
                    if r // G < queries:
                        for e in T.vectorized(D):
                            O[q0 + s0 + r // G, (first + kv) * G + r % G, e] = T.Cast(dt, variant.normalise(
                                acc[kv, r, e], denominator(SINKS, ls[kv, r], m[kv, r], (first + kv) * G + r % G)))
                        if with_lse:
                            LSE[q0 + s0 + r // G, (first + kv) * G + r % G] = T.Select(
                                ls[kv, r] > T.float32(0), m[kv, r] + T.log2(ls[kv, r]), T.float32(LOWEST))

    return prefill



def buffer_kernel(plan: PagedPlan, rows: int) -> tirx.PrimFunc:
    """The decode kernel over one contiguous buffer per sequence, (B, h_kv, rows, d) K and V (ONNX
    Runtime's GroupQueryAttention past/present buffer, each sequence's own length ``cache_seqlens``): the
    buffer read as HND pages of the plan's page size P (a power of two dividing ``rows``), sequence b's
    page j being page b·h_kv·rows/P + j of a strided view; no block table. ``main(q, k, v, cache_seqlens,
    sinks, alibi_slopes, out)``; the work split as the paged kernel's, so that ragged lengths balance."""
    spec = plan.spec
    H, HKV, D, N, P, dt = spec.h, spec.h_kv, spec.head_dim, spec.q_len, spec.page_size, spec.dtype
    per_head = rows // P  # pages of one (sequence, KV head)
    decode_body = bodies(plan)

    @T.prim_func
    def main(q_h: T.handle, k_h: T.handle, v_h: T.handle, lens_h: T.handle, sinks_h: T.handle, slopes_h: T.handle,
             o_h: T.handle):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        batch = T.int32()
        Q = T.match_buffer(q_h, (batch, N, H, D), dt)
        KB = T.match_buffer(k_h, (batch, HKV, rows, D), dt)
        VB = T.match_buffer(v_h, (batch, HKV, rows, D), dt)
        LENS = T.match_buffer(lens_h, (batch,), "int32")
        SINKS = T.match_buffer(sinks_h, (H,), "float32")
        SLOPES = T.match_buffer(slopes_h, (H,), "float32")
        O = T.match_buffer(o_h, (batch, N, H, D), dt)
        pages = T.meta_var((batch - 1) * HKV * per_head + per_head)  # the last sequence's first head's pages end here
        K = T.decl_buffer((pages, HKV, P, D), dt, data=KB.data, strides=(P * D, rows * D, D, 1))
        V = T.decl_buffer((pages, HKV, P, D), dt, data=VB.data, strides=(P * D, rows * D, D, 1))
        decode_body(lambda b, s, head, e: Q[b, s, head, e], K, V, lambda b, j: b * HKV * per_head + j,
                    lambda b: T.max(T.min(LENS[b], rows), 0), SINKS, SLOPES, O, SINKS, False, batch, pages)

    return main
