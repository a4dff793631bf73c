"""Paged decode on the CPU (`paged.PagedSpec`): a TIR kernel written loop by loop, as no schedule of
the dense tensor expression reads keys through a block table.

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

The plan (`PagedPlan`) makes every choice once: vector lanes, chunks, rows per task.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target

from tvmattn.compiler import variant
from tvmattn.compiler.isa.panels import shuffle
from tvmattn.compiler.paged import PagedSpec
from tvmattn.compiler.target import isa_of
from tvmattn.compiler.te_attention import LOG2E
from tvmattn.compiler.variant import ACC
from tvmattn.schedules.primitives import lanes_for

BLOCK = 16  # keys per online-softmax step: one vector of their logits
LOWEST = -3.0e38  # a running maximum before any key: finite, so exp2(m − m_new) is 1 or 0, never NaN


@dataclass(frozen=True)
class PagedPlan:
    """The decisions of one paged decode kernel."""

    spec: PagedSpec
    lanes: int  # fp32 lanes of the vectors along d
    chunks: int  # key chunks per sequence: the cores (each thread takes whole chunks of every sequence)
    rows: int  # query rows sharing each K/V read: q_len · group

    def describe(self) -> str:
        return (f"paged decode: {self.chunks} key chunks per sequence × {self.rows} query rows per K/V read, "
                f"{self.lanes}-lane dot products along d, {BLOCK}-key softmax blocks")


def plan_of(spec: PagedSpec, target: Target) -> PagedPlan:
    isa = isa_of(target)
    cores = int(target.attrs.get("num-cores", 1))
    return PagedPlan(spec, lanes_for(spec.head_dim, isa.lanes if isa else 8), max(cores, 1),
                     spec.q_len * spec.group)


def paged_decode(plan: PagedPlan) -> tirx.PrimFunc:
    """The kernel of ``plan``: main(q, k_cache, v_cache, block_table, cache_seqlens, sinks, alibi_slopes,
    out), sinks and alibi_slopes (h,) float32 read only where the spec has them."""
    spec, a = plan.spec, plan.spec.attention
    H, HKV, G, D, P, N = spec.h, spec.h_kv, spec.group, spec.head_dim, spec.page_size, spec.q_len
    R, LANES, C, dt = plan.rows, plan.lanes, plan.chunks, spec.dtype
    LOG2P, VECS = P.bit_length() - 1, D // LANES
    nhd = spec.kv_layout == "NHD"

    def cache_at(cache, page, row, kvh, e):
        return cache[page, row, kvh, e] if nhd else cache[page, kvh, row, e]

    def span(length, c):
        """The first key of chunk ``c``'s share of the keys its queries see (c = C: the end)."""
        lo, hi = variant.key_range(a, tirx.const(0, "int32"), tirx.const(N - 1, "int32"), length,
                                   tirx.const(N, "int32"))
        lo = tirx.const(0, "int32") if lo is None else tirx.max(lo, 0)
        count = tirx.max(hi - lo, 0)
        return lo + count * c // C

    def logit(slopes, score, r, t, length, kvh, live):
        """The base-2 logit of row r (query r // G, head kvh·G + r % G) and key t; −inf where hidden."""
        s, head = r // G, kvh * G + r % G
        slope = slopes[head] if spec.alibi is not None else None
        x = variant.logit(a, score, s, t, length, tirx.const(N, "int32"), None, slope, LOG2E)
        seen = variant.visible(a, s, t, length, tirx.const(N, "int32"), variant.tir_all)
        return tirx.Select(live if seen is None else tirx.all(live, seen), x, -tirx.infinity(ACC))

    def tree(buf, r, width, op):
        """op over buf[r, 0:width] (a power of two) in log2(width) vector steps."""
        x = buf.vload([r, 0], f"float32x{width}")
        while width > 1:
            width //= 2
            x = op(shuffle([x], list(range(width))), shuffle([x], list(range(width, 2 * width))))
        return x

    def denominator(sinks, total, row_max, head):
        return variant.denominator(a, total, row_max, sinks[head] if spec.sinks else None, LOG2E)

    add, biggest = (lambda x, y: x + y), tirx.max  # noqa: E731

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
        part_m = T.alloc_buffer((C, batch, N * H), "float32")
        part_l = T.alloc_buffer((C, batch, N * H), "float32")
        part_o = T.alloc_buffer((C, batch, N * H, D), "float32")
        for task in T.parallel(C * batch * HKV):
            c = task // (batch * HKV)
            b = task // HKV % batch
            kvh = task % HKV
            length = T.max(T.min(LENS[b], width * P), 0)  # (checked by the caller; clamped all the same)
            t_begin = span(length, c)
            t_end = span(length, c + 1)
            qs = T.alloc_buffer((R, D), "float32", scope="local")
            m = T.alloc_buffer((R,), "float32", scope="local")
            ls = T.alloc_buffer((R,), "float32", scope="local")
            acc = T.alloc_buffer((R, D), "float32", scope="local")
            x = T.alloc_buffer((R, BLOCK), "float32", scope="local")
            part = T.alloc_buffer((R, LANES), "float32", scope="local")
            pg = T.alloc_buffer((BLOCK,), "int32", scope="local")
            row = T.alloc_buffer((BLOCK,), "int32", scope="local")
            for r in range(R):
                m[r] = T.float32(LOWEST)
                ls[r] = T.float32(0)
                for e in T.vectorized(D):
                    qs[r, e] = T.Cast("float32", Q[b, r // G, kvh * G + r % G, e])
                    acc[r, e] = T.float32(0)
            for blk in range((t_end - t_begin + BLOCK - 1) // BLOCK):
                t0 = t_begin + blk * BLOCK
                live = T.min(BLOCK, t_end - t0)
                for tt in range(live):
                    pg[tt] = T.max(T.min(TABLE[b, T.shift_right(t0 + tt, LOG2P)], pages - 1), 0)
                    row[tt] = T.bitwise_and(t0 + tt, P - 1)
                for tt in range(live):
                    for r in T.unroll(R):
                        for lane in T.vectorized(LANES):
                            part[r, lane] = T.float32(0)
                    for e0 in range(VECS):
                        for r in T.unroll(R):
                            for lane in T.vectorized(LANES):
                                part[r, lane] = part[r, lane] + qs[r, e0 * LANES + lane] * T.Cast(
                                    "float32", cache_at(K, pg[tt], row[tt], kvh, e0 * LANES + lane))
                    for r in T.unroll(R):
                        x[r, tt] = tree(part, r, LANES, add)
                for r in range(R):
                    for tt in T.vectorized(BLOCK):
                        x[r, tt] = logit(SLOPES, x[r, tt], r, t0 + tt, length, kvh, tt < live)
                    m_new = T.max(m[r], tree(x, r, BLOCK, biggest))
                    correction = T.exp2(m[r] - m_new)
                    for tt in T.vectorized(BLOCK):
                        x[r, tt] = T.Select(tt < live, T.exp2(x[r, tt] - m_new), T.float32(0))
                    ls[r] = ls[r] * correction + tree(x, r, BLOCK, add)
                    m[r] = m_new
                    for e in T.vectorized(D):
                        acc[r, e] = acc[r, e] * correction
                for e0 in range(VECS):
                    for tt in range(live):
                        for r in T.unroll(R):
                            for lane in T.vectorized(LANES):
                                acc[r, e0 * LANES + lane] = acc[r, e0 * LANES + lane] + x[r, tt] * T.Cast(
                                    "float32", cache_at(V, pg[tt], row[tt], kvh, e0 * LANES + lane))
            for r in range(R):
                part_m[c, b, r // G * H + kvh * G + r % G] = m[r]
                part_l[c, b, r // G * H + kvh * G + r % G] = ls[r]
                for e in T.vectorized(D):
                    part_o[c, b, r // G * H + kvh * G + r % G, e] = acc[r, e]
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

    return main
