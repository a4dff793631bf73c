"""Attention as FlashAttention computes it: one pass over key tiles with an online softmax, as TIR.

Why this is a TIR template and not a schedule of the tensor expression: the TE states the softmax
as whole-row reductions (row_max, then probs/row_sum, then pv), so any schedule of it either keeps a
q_tile × n_kv score row per program instance (on a GPU, more than shared memory holds) or
recomputes QKᵀ once per pass. FlashAttention's running max/sum is state carried from one key tile
to the next, which a TE reduction cannot express. The alternatives weighed:
  * a split-key TE with a combine stage: partial (max, sum, P·V) per key tile is (n, n_kv/T, d_v)
    of memory, more than the score matrix when d_v > T: right for split-K decode only;
  * a tuple `comm_reducer` (max, sum, acc) over keys (log-sum-exp is a monoid): exact, but the
    reduction is per output element, so every exp is computed d_v times and P is never a matrix a
    tensor core can take;
  * this template (what TVM's own prefill kernels in ``relax/frontend/nn/llm`` do): the online
    softmax written once as sblocks over tiles, target-neutral, then scheduled per target.
The TE stays the statement of *what* attention is (the CPU build schedules it); this template is one
*algorithm* for it. Its numerics are checked on the CPU: `build.build_serial` compiles it unscheduled for
LLVM and the tests compare that with the float64 oracle over the spec sweep.

One program instance computes rows [row0, row0 + q_rows) of one (batch, KV head) pair; row r is
the pair (query s = r // g, query head kvh·g + r % g), so the g query heads of a GQA group share
each K/V tile. The template is four functions, split as Triton's fused-attention tutorial splits
``_attn_fwd`` from ``_attn_fwd_inner``:

    main                the grid of instances (block flash), its prologue and the loop over key tiles:
      q_load, init_state, o_init    Q; m = lowest, l = 0, O = 0
      kv_step           one key tile, below, for every tile j (keys j·kv_tile …) that the mask lets one
                        of the instance's queries see
      epilogue          o_store: o = O / l, or 0 for a row that sees no key (l = 0; with sinks, the sink's
                        exp2(sink − m) joins l: `variant.denominator`); with kv_splits > 1,
                        o_partial, ml_partial: this split's (O, m, l)
    combine             kv_splits > 1 only: split_max, split_sum, split_combine, split_store merge the
                        partials (memory (B, h, n, kv_splits, d_v)) into o

kv_step, the online softmax of key tile j:

    k_load, v_load      K_j (kv_tile, d_k), V_j (kv_tile, d_v)
    s_gemm, s_store     S = Q·K_jᵀ                          (q_rows, kv_tile), fp32
    row_max             tile_max = max_t x                   x = scale·log2(e)·S, −∞ where masked
    rescale             m_new = max(m, tile_max), alpha = exp2(m − m_new)
    probs               P = exp2(x − m_new), input dtype     (what a tensor core multiplies)
    row_sum, l_update   l_new = alpha·l + Σ_t P
    pv, pv_store        PV = P·V_j                           fp32
    o_update            O_new = alpha·O + PV
    state_update, o_copy  m, l, O = m_new, l_new, O_new
The shape is for schedules: no stage writes a buffer it reads (`bind` accepts only such blocks; the
register copies cost nothing after nvcc); reductions start from their identity (cross-thread
reductions need that); GEMMs accumulate apart from where their result is read (S_acc, PV_acc: tensor
core fragments on a GPU); s_gemm … o_update sit in one block, key_tile, whose stages only read what
earlier ones wrote, so `compute_at`-style primitives work inside it. Masked x are −∞ and running
maxima start at the lowest finite float, so an exponent is finite − finite or −∞ − finite: never ∞ − ∞.
kv_splits > 1 (decode: few queries, a long cache) lets kv_splits instances share a row block's key tiles.

kv_step, epilogue and combine are hygienic `T.macro`s: they expand where main calls them, so the
PrimFunc stays one function with the block and buffer names the schedules look up (a PrimFunc per
stage would need inlining; statements built with the IR builder would not read as TVMScript). They
are made anew for each template because they close over its sizes, and because a macro suffixes the
block names of every expansion but its first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from tvm import tirx
from tvm.ir.expr import Expr as PrimExpr
from tvm.script import tirx as T

from tvmattn.compiler import arguments, variant
from tvmattn.compiler.paged import PagedSpec
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.variant import ACC, Operand, size_expr

LOG2E = math.log2(math.e)
NEG_INF = -tirx.infinity(ACC)
LOWEST = tirx.min_value(ACC)  # the identity of max, where a row's running maximum starts



@dataclass(frozen=True)
class FlashTiles:
    """The template's shape: these change what is computed per instance, not only its schedule."""

    q_rows: int = 64  # rows (query, query head) per program instance
    kv_tile: int = 64  # keys per online-softmax step
    kv_splits: int = 1  # instances sharing one row block's keys (split-K); 1 = one pass
    min_steps: int = 1  # key-tile steps every instance takes, past its last visible tile if need be


def operands(spec: AttentionSpec, packed: bool = False) -> dict[str, Operand]:
    """q, k, v, o of the core; ``packed``: as the full layer's projections store them (B, n, h·d_k)."""
    layout = "packed" if packed else spec.layout
    return {"q": Operand(layout, spec.h, spec.d_k), "k": Operand(layout, spec.h_kv, spec.d_k),
            "v": Operand(layout, spec.h_kv, spec.d_v), "o": Operand(layout, spec.h, spec.d_v)}


def flash_attention(spec: AttentionSpec, tiles: FlashTiles, packed: bool = False,
                    scopes: Mapping[str, str] | None = None,
                    dims: Mapping[str, tirx.Var] | None = None, paged: PagedSpec | None = None) -> tirx.PrimFunc:
    """The online-softmax PrimFunc of the core of ``spec``: ``main(q, k, v, *extras, o)``, the extras
    the arguments past the data `arguments.TABLE` gives the spec (kv_lens, attn_mask, …).

    ``packed`` takes q, k, v and writes o as (B, n, heads·width) (the full layer's projections).
    ``scopes`` places the per-instance buffers (Q, K, V, S_acc, S, P,
    tile_max, tile_sum, m, m_new, alpha, l, l_new, PV_acc, PV, O, O_new)
    in memory ("shared", "local"…; "global" when not named): where a value lives, not what it is.
    ``dims``: the variables of symbolic sizes by name (to share them with another function).
    ``paged``: K and V read from a paged cache through its block table (`paged.PagedSpec`; ``spec``
    is then its ``attention``): ``main(q, k_cache, v_cache, block_table, cache_seqlens, *extras, o)``,
    key t of sequence b at row t % P of page block_table[b, t // P] (clamped into the cache).
    """
    spec.validate()
    dims = dict(dims or {})
    dim = lambda x: dims.setdefault(x, tirx.Var(x, "int32")) if isinstance(x, str) else x  # noqa: E731
    pages, width = dim("num_pages"), dim("max_pages")
    if paged is not None:  # the keys a block table reaches
        dims[spec.n_kv] = width * paged.page_size
    B, n, n_kv = dim(spec.batch), dim(spec.n_q), dim(spec.n_kv)
    ops = operands(spec, packed)
    q_shape, k_shape, v_shape, o_shape = (ops[x].shape(B, n_kv if x in "kv" else n) for x in "qkvo")
    q_at, o_at = ops["q"].index, ops["o"].index
    k_at, v_at = (lambda table, b, kvh, t, e: ops["k"].index(b, kvh, t, e)), \
        (lambda table, b, kvh, t, e: ops["v"].index(b, kvh, t, e))
    if paged is not None:
        k_shape = v_shape = paged.cache_shape(pages)
        k_at = v_at = _paged_index(paged, pages)
    mask_shape = tuple(dim(x) for x in spec.attn_mask_shape())
    dt, g, h, h_kv, d_k, d_v = spec.dtype, spec.group, spec.h, spec.h_kv, spec.d_k, spec.d_v
    R, Tk, splits = tiles.q_rows, tiles.kv_tile, tiles.kv_splits
    rows = n * g
    row_tiles = tirx.ceildiv(rows, R) if isinstance(rows, PrimExpr) else -(-rows // R)
    zero, zero_in = tirx.const(0, ACC), tirx.const(0, dt)
    padded = spec.key_padding
    at = lambda name: (scopes or {}).get(name, "global")  # noqa: E731

    def head(kvh: PrimExpr, row: PrimExpr) -> PrimExpr:
        return kvh * g + row % g

    def logit(score: PrimExpr, b: PrimExpr, kvh: PrimExpr, row: PrimExpr, t: PrimExpr, kv_len: PrimExpr,
              past_last_tile: PrimExpr, attn_mask: tirx.Buffer, slopes: tirx.Buffer) -> PrimExpr:
        """x = log2(e)·logit of query row and key t (`variant.logit`), or −∞ where it is hidden (by the
        variant, past the keys or past this instance's last tile): as the TE's logits, in base 2."""
        mask_value = tirx.BufferLoad(attn_mask, variant.mask_index(spec, b, head(kvh, row), row // g, t)) \
            if spec.attn_mask else None
        slope = tirx.BufferLoad(slopes, [head(kvh, row)]) if spec.alibi is not None else None
        seen = variant.sees(spec, row // g, t, kv_len, size_expr(n), mask_value, tirx.Not(past_last_tile), t < n_kv)
        return tirx.Select(seen, variant.logit(spec, score, row // g, t, kv_len, size_expr(n), mask_value, slope,
                                               factor=LOG2E), NEG_INF)

    def denominator(total: PrimExpr, running_max: PrimExpr, sinks: tirx.Buffer, i: PrimExpr) -> PrimExpr:
        """The row sum, with head i's sink (`variant.denominator`; both in base 2)."""
        return variant.denominator(spec, total, running_max, sinks[i] if spec.sinks else None, LOG2E)

    def tile_gemm_macro():
        """A macro per use: TVMScript renames the blocks of a macro's second expansion."""

        @T.macro
        def tile_gemm(gemm: str, store: str, a: tirx.Buffer, b: tirx.Buffer, b_transposed: bool,
                      acc: tirx.Buffer, out: tirx.Buffer) -> None:
            """out = acc = a·b (a·bᵀ), fp32: the accumulation apart from where it is read (tensor-core
            fragments on a GPU), one block each, named for the schedule."""
            rows, cols = T.meta_var(acc.shape)
            depth = T.meta_var(a.shape[1])
            for r, c, e in T.grid(rows, cols, depth):
                with T.sblock(gemm):
                    vr, vc, ve = T.axis.remap("SSR", [r, c, e])
                    with T.init():
                        acc[vr, vc] = zero
                    if b_transposed:
                        acc[vr, vc] = acc[vr, vc] + T.Cast(ACC, a[vr, ve]) * T.Cast(ACC, b[vc, ve])
                    else:
                        acc[vr, vc] = acc[vr, vc] + T.Cast(ACC, a[vr, ve]) * T.Cast(ACC, b[ve, vc])
            for r, c in T.grid(rows, cols):
                with T.sblock(store):
                    vr, vc = T.axis.remap("SS", [r, c])
                    out[vr, vc] = acc[vr, vc]

        return tile_gemm

    qk_gemm, pv_gemm = tile_gemm_macro(), tile_gemm_macro()

    @T.macro
    def kv_step(j: PrimExpr, j_hi: PrimExpr, vb: PrimExpr, vkvh: PrimExpr, row0: PrimExpr, kv_len: PrimExpr,
                k: tirx.Buffer, v: tirx.Buffer, table: tirx.Buffer, attn_mask: tirx.Buffer, slopes: tirx.Buffer,
                Q: tirx.Buffer, m: tirx.Buffer,
                l: tirx.Buffer, O: tirx.Buffer, m_new: tirx.Buffer, alpha: tirx.Buffer, l_new: tirx.Buffer,
                O_new: tirx.Buffer, P: tirx.Buffer) -> None:
        """Key tile j of row block row0 folded into the running (m, l, O) (Triton's ``_attn_fwd_inner``)."""
        with T.sblock("kv_step"):  # the body of the loop over key tiles
            vj = T.axis.spatial(T.ceildiv(n_kv, Tk), j)
            T.reads(Q[0:R, 0:d_k], m[0:R], l[0:R], O[0:R, 0:d_v])
            T.writes(m[0:R], l[0:R], O[0:R, 0:d_v], m_new[0:R], alpha[0:R], l_new[0:R],
                     O_new[0:R, 0:d_v], P[0:R, 0:Tk])
            K = T.sblock_alloc_buffer((Tk, d_k), dt, scope=at("K"))
            V = T.sblock_alloc_buffer((Tk, d_v), dt, scope=at("V"))
            for t, e in T.grid(Tk, d_k):
                with T.sblock("k_load"):
                    vt, ve = T.axis.remap("SS", [t, e])
                    K[vt, ve] = T.if_then_else(vj * Tk + vt < n_kv, k[k_at(table, vb, vkvh, vj * Tk + vt, ve)],
                                               zero_in)
            for t, cc in T.grid(Tk, d_v):
                with T.sblock("v_load"):
                    vt, vc = T.axis.remap("SS", [t, cc])
                    V[vt, vc] = T.if_then_else(vj * Tk + vt < n_kv, v[v_at(table, vb, vkvh, vj * Tk + vt, vc)],
                                               zero_in)
            # key_tile holds one block, so that TVM's software pipeliner keeps it one stage
            # (it splices a block whose body is a sequence into the pipeline).
            with T.sblock("key_tile"):
                T.reads(Q[0:R, 0:d_k], K[0:Tk, 0:d_k], V[0:Tk, 0:d_v], m[0:R], l[0:R], O[0:R, 0:d_v])
                T.writes(m_new[0:R], alpha[0:R], l_new[0:R], O_new[0:R, 0:d_v], P[0:R, 0:Tk])
                with T.sblock("key_tile_stages"):
                    T.reads(Q[0:R, 0:d_k], K[0:Tk, 0:d_k], V[0:Tk, 0:d_v], m[0:R], l[0:R], O[0:R, 0:d_v])
                    T.writes(m_new[0:R], alpha[0:R], l_new[0:R], O_new[0:R, 0:d_v], P[0:R, 0:Tk])
                    S_acc = T.sblock_alloc_buffer((R, Tk), ACC, scope=at("S_acc"))
                    S = T.sblock_alloc_buffer((R, Tk), ACC, scope=at("S"))
                    tile_max = T.sblock_alloc_buffer((R,), ACC, scope=at("tile_max"))
                    tile_sum = T.sblock_alloc_buffer((R,), ACC, scope=at("tile_sum"))
                    PV_acc = T.sblock_alloc_buffer((R, d_v), ACC, scope=at("PV_acc"))
                    PV = T.sblock_alloc_buffer((R, d_v), ACC, scope=at("PV"))
                    t0 = T.meta_var(vj * Tk)
                    qk_gemm("s_gemm", "s_store", Q, K, True, S_acc, S)  # S = Q·K_jᵀ
                    for r, t in T.grid(R, Tk):
                        with T.sblock("row_max"):
                            vr, vt = T.axis.remap("SR", [r, t])
                            with T.init():
                                tile_max[vr] = LOWEST
                            tile_max[vr] = T.max(tile_max[vr], logit(
                                S[vr, vt], vb, vkvh, row0 + vr, t0 + vt, kv_len, vj >= j_hi, attn_mask, slopes))
                    for r in range(R):
                        with T.sblock("rescale"):
                            vr = T.axis.remap("S", [r])
                            m_new[vr] = T.max(m[vr], tile_max[vr])
                            alpha[vr] = T.exp2(m[vr] - T.max(m[vr], tile_max[vr]))
                    for r, t in T.grid(R, Tk):
                        with T.sblock("probs"):
                            vr, vt = T.axis.remap("SS", [r, t])
                            P[vr, vt] = T.Cast(dt, T.exp2(logit(
                                S[vr, vt], vb, vkvh, row0 + vr, t0 + vt, kv_len, vj >= j_hi, attn_mask, slopes)
                                - m_new[vr]))
                    for r, t in T.grid(R, Tk):
                        with T.sblock("row_sum"):
                            vr, vt = T.axis.remap("SR", [r, t])
                            with T.init():
                                tile_sum[vr] = zero
                            tile_sum[vr] = tile_sum[vr] + T.Cast(ACC, P[vr, vt])
                    for r in range(R):
                        with T.sblock("l_update"):
                            vr = T.axis.remap("S", [r])
                            l_new[vr] = l[vr] * alpha[vr] + tile_sum[vr]
                    pv_gemm("pv", "pv_store", P, V, False, PV_acc, PV)  # PV = P·V_j
                    for r, cc in T.grid(R, d_v):
                        with T.sblock("o_update"):
                            vr, vc = T.axis.remap("SS", [r, cc])
                            O_new[vr, vc] = O[vr, vc] * alpha[vr] + PV[vr, vc]
            for r in range(R):
                with T.sblock("state_update"):
                    vr = T.axis.remap("S", [r])
                    m[vr] = m_new[vr]
                    l[vr] = l_new[vr]
            for r, cc in T.grid(R, d_v):
                with T.sblock("o_copy"):
                    vr, vc = T.axis.remap("SS", [r, cc])
                    O[vr, vc] = O_new[vr, vc]

    @T.macro
    def epilogue(out: tirx.Buffer | tuple[tirx.Buffer, tirx.Buffer, tirx.Buffer], vb: PrimExpr, vkvh: PrimExpr,
                 vsplit: PrimExpr, row0: PrimExpr, O: tirx.Buffer, m: tirx.Buffer, l: tirx.Buffer,
                 sinks: tirx.Buffer) -> None:
        """Row block row0's result: into ``out`` = o, O / l (0 for a row that sees no key, l = 0); or, with
        kv_splits > 1, into ``out`` = (o_part, m_part, l_part), its split's partial (O, m, l)."""
        if splits > 1:
            o_part, m_part, l_part = T.meta_var(out)
            for r, cc in T.grid(R, d_v):
                with T.sblock("o_partial"):
                    vr, vc = T.axis.remap("SS", [r, cc])
                    T.where(row0 + r < rows)
                    o_part[vb, head(vkvh, row0 + vr), (row0 + vr) // g, vsplit, vc] = O[vr, vc]
            for r in range(R):
                with T.sblock("ml_partial"):
                    vr = T.axis.remap("S", [r])
                    T.where(row0 + r < rows)
                    m_part[vb, head(vkvh, row0 + vr), (row0 + vr) // g, vsplit] = m[vr]
                    l_part[vb, head(vkvh, row0 + vr), (row0 + vr) // g, vsplit] = l[vr]
        else:
            for r, cc in T.grid(R, d_v):
                with T.sblock("o_store"):
                    vr, vc = T.axis.remap("SS", [r, cc])
                    T.where(row0 + r < rows)
                    out[o_at(vb, head(vkvh, row0 + vr), (row0 + vr) // g, vc)] = T.Cast(
                        dt, variant.normalise(O[vr, vc], denominator(l[vr], m[vr], sinks, head(vkvh, row0 + vr))))

    @T.macro
    def combine(parts: tuple[tirx.Buffer, tirx.Buffer, tirx.Buffer], o: tirx.Buffer, sinks: tirx.Buffer) -> None:
        """o from the kv_splits partial (O, m, l) of each row: rescaled to their common maximum, summed."""
        o_part, m_part, l_part = T.meta_var(parts)
        m_all = T.alloc_buffer((B, h, n), ACC)
        l_all = T.alloc_buffer((B, h, n), ACC)
        o_all = T.alloc_buffer((B, h, n, d_v), ACC)
        for b, i, s, sp in T.grid(B, h, n, splits):
            with T.sblock("split_max"):
                vb, vi, vs, vsp = T.axis.remap("SSSR", [b, i, s, sp])
                with T.init():
                    m_all[vb, vi, vs] = LOWEST
                m_all[vb, vi, vs] = T.max(m_all[vb, vi, vs], m_part[vb, vi, vs, vsp])
        for b, i, s, sp in T.grid(B, h, n, splits):
            with T.sblock("split_sum"):
                vb, vi, vs, vsp = T.axis.remap("SSSR", [b, i, s, sp])
                with T.init():
                    l_all[vb, vi, vs] = zero
                l_all[vb, vi, vs] = l_all[vb, vi, vs] + l_part[vb, vi, vs, vsp] * T.exp2(
                    m_part[vb, vi, vs, vsp] - m_all[vb, vi, vs])
        for b, i, s, cc, sp in T.grid(B, h, n, d_v, splits):
            with T.sblock("split_combine"):
                vb, vi, vs, vc, vsp = T.axis.remap("SSSSR", [b, i, s, cc, sp])
                with T.init():
                    o_all[vb, vi, vs, vc] = zero
                o_all[vb, vi, vs, vc] = o_all[vb, vi, vs, vc] + o_part[vb, vi, vs, vsp, vc] * T.exp2(
                    m_part[vb, vi, vs, vsp] - m_all[vb, vi, vs])
        for b, i, s, cc in T.grid(B, h, n, d_v):
            with T.sblock("split_store"):
                vb, vi, vs, vc = T.axis.remap("SSSS", [b, i, s, cc])
                o[o_at(vb, vi, vs, vc)] = T.Cast(dt, variant.normalise(
                    o_all[vb, vi, vs, vc], denominator(l_all[vb, vi, vs], m_all[vb, vi, vs], sinks, vi)))

    @T.prim_func(s_tir=True)
    def main(q_h: T.handle, k_h: T.handle, v_h: T.handle, table_h: T.handle, lens_h: T.handle, mask_h: T.handle,
             sinks_h: T.handle, slopes_h: T.handle, o_h: T.handle):
        q = T.match_buffer(q_h, q_shape, dt)
        k = T.match_buffer(k_h, k_shape, dt)
        v = T.match_buffer(v_h, v_shape, dt)
        block_table = T.match_buffer(table_h, (B, width), "int32")
        kv_lens = T.match_buffer(lens_h, (B,), "int32")
        attn_mask = T.match_buffer(mask_h, mask_shape, spec.input_dtype("attn_mask"))
        sinks = T.match_buffer(sinks_h, (h,), "float32")
        alibi_slopes = T.match_buffer(slopes_h, (h,), "float32")
        o = T.match_buffer(o_h, o_shape, dt)
        if splits > 1:
            o_part = T.alloc_buffer((B, h, n, splits, d_v), ACC)
            m_part = T.alloc_buffer((B, h, n, splits), ACC)
            l_part = T.alloc_buffer((B, h, n, splits), ACC)
            parts = T.meta_var((o_part, m_part, l_part))
        for b, kvh, tile, split in T.grid(B, h_kv, row_tiles, splits):
            with T.sblock("flash"):
                vb, vkvh, vtile, vsplit = T.axis.remap("SSSS", [b, kvh, tile, split])
                T.reads()
                T.writes()
                Q = T.sblock_alloc_buffer((R, d_k), dt, scope=at("Q"))
                m = T.sblock_alloc_buffer((R,), ACC, scope=at("m"))
                l = T.sblock_alloc_buffer((R,), ACC, scope=at("l"))
                O = T.sblock_alloc_buffer((R, d_v), ACC, scope=at("O"))
                m_new = T.sblock_alloc_buffer((R,), ACC, scope=at("m_new"))
                l_new = T.sblock_alloc_buffer((R,), ACC, scope=at("l_new"))
                alpha = T.sblock_alloc_buffer((R,), ACC, scope=at("alpha"))
                O_new = T.sblock_alloc_buffer((R, d_v), ACC, scope=at("O_new"))
                P = T.sblock_alloc_buffer((R, Tk), dt, scope=at("P"))  # not with S: TVM's cache_read of a
                # buffer allocated in the block that is its scope loses the buffer
                row0 = T.meta_var(vtile * R)
                kv_len = T.meta_var(kv_lens[vb] if padded else size_expr(n_kv))
                j_lo, j_hi = T.meta_var(_key_tiles(spec, tiles, row0, vsplit, kv_len, size_expr(n), size_expr(n_kv)))
                for r, e in T.grid(R, d_k):
                    with T.sblock("q_load"):
                        vr, ve = T.axis.remap("SS", [r, e])
                        Q[vr, ve] = T.if_then_else(row0 + vr < rows,
                                                   q[q_at(vb, head(vkvh, row0 + vr), (row0 + vr) // g, ve)], zero_in)
                for r in range(R):
                    with T.sblock("init_state"):
                        vr = T.axis.remap("S", [r])
                        m[vr] = LOWEST
                        l[vr] = zero
                for r, cc in T.grid(R, d_v):
                    with T.sblock("o_init"):
                        vr, vc = T.axis.remap("SS", [r, cc])
                        O[vr, vc] = zero
                # At least min_steps steps, even for a row block that sees fewer tiles (a step at or past
                # j_hi is all masked and changes nothing): TVM's software pipeliner guards the steps of a
                # loop it cannot prove to run its stage count with branches, and a branch around the
                # barriers of a pipelined step is something CUDA code generation cannot place.
                for step in T.serial(T.max(j_hi - j_lo, tiles.min_steps)):
                    kv_step(j_lo + step, j_hi, vb, vkvh, row0, kv_len, k, v, block_table, attn_mask, alibi_slopes,
                            Q, m, l, O, m_new, alpha, l_new, O_new, P)
                epilogue(parts if splits > 1 else o, vb, vkvh, vsplit, row0, O, m, l, sinks)
        if splits > 1:
            combine(parts, o, sinks)

    # The calling convention has the extras the spec takes (`arguments.TABLE`), in its order (the
    # parameters are named after their buffers).
    takes = {a.name for a in arguments.extras(spec)} | {"q", "k", "v", "o"}
    if paged is not None:  # the paged kernels' calling convention (`paged.with_unused`): sinks and slopes always
        takes |= {"block_table", "sinks", "alibi_slopes"}
    main = tirx.PrimFunc([p for p in main.params if p.name in takes], main.body, main.ret_type, main.attrs)
    return main.with_attr("global_symbol", "main")


def _paged_index(paged: PagedSpec, pages: PrimExpr):
    """(block_table, b, kvh, t, e) → the cache element of key t of sequence b: its page clamped into the
    cache (a block-table entry past the sequence's keys is never used, and never read out of bounds)."""
    P = paged.page_size

    def index(table: tirx.Buffer, b, kvh, t, e) -> tuple:
        page = tirx.max(tirx.min(tirx.BufferLoad(table, [b, tirx.floordiv(t, P)]), pages - 1), 0)
        row = tirx.floormod(t, P)
        return (page, row, kvh, e) if paged.kv_layout == "NHD" else (page, kvh, row, e)

    return index


def _key_tiles(spec: AttentionSpec, tiles: FlashTiles, row0, split, kv_len, n, n_kv) -> tuple[PrimExpr, PrimExpr]:
    """Key tiles [j_lo, j_hi) that instance (row0, split) visits: its share of the keys, cut to those
    the mask lets its queries see (`variant.key_range`): causal/window/padding tile skipping."""
    g, Tk = spec.group, tiles.kv_tile
    kv_tiles = tirx.ceildiv(n_kv, Tk)
    share = tirx.ceildiv(kv_tiles, tiles.kv_splits)
    lo, hi = split * share, tirx.min(kv_tiles, split * share + share)
    s_lo, s_hi = row0 // g, tirx.min(n - 1, (row0 + tiles.q_rows - 1) // g)
    t_lo, t_hi = variant.key_range(spec, s_lo, s_hi, kv_len, n)
    if t_lo is not None:
        lo = tirx.max(lo, tirx.floordiv(t_lo, Tk))
    if t_hi is not None:
        hi = tirx.min(hi, tirx.floordiv(t_hi + Tk - 1, Tk))
    return lo, hi

