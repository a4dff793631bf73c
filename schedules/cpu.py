"""FlashAttention-style CPU schedule of the attention tensor expression.

Query tiles (prefill, and any spec with more tasks than cores): one parallel task per (batch, head,
query tile of ``q_tile`` rows); the query heads of a GQA group take consecutive tasks on the same tile,
so the K/V rows they share are still in cache. A 16-bit K or V widened to fp32 for the FMAs
(`widened_kv`) is widened once: in a task per (batch, KV head) that runs its query tiles in turn,
where those pairs split evenly over the cores (`head_tasks`), else in a pass before the tasks.
Every attention stage is computed inside the query tile, so a task holds a q_tile × n_kv score
tile, never the n × n_kv matrix. Tiles are stored key-major, (tile, t, s), so that every stage
vectorises over queries:

    pack    q tile → (d_k, q_tile)                           once per task, lanes × lanes blocks
                                                             transposed in registers (`x86_panels`)
    scores  acc[qk_keys][q_tile/lanes vectors] += k[t, e] (broadcast) · q[e, s:s+lanes]
            row_max: of each register tile as it is stored (a mask tile: a pass of its own)
    probs   exp2(logits - row_max), vectorised over s; row_sum: of each key's row as it is computed
    pv      acc[pv_rows][pv_vecs vectors] += probs[t, s] (broadcast) · v[t, c:c+lanes]
    attn    pv / row_sum

Each stage reads what the one before wrote while it is in L1: the q_tile × n_kv tile streams through
L2 once per stage (scores, probs, pv), not once per reduction as well. With the bf16 dot products
(`bf16_dots`), P's pair panel is packed from each pair of keys as probs computes it, and V's once:
in its head's task where those split evenly (`head_tasks`), else in a pass before the tasks. On
AMX's tiles (`amx_tiles`, `x86_amx`) the same stages keep their layout:

    scores  acc[32 keys][32 queries] += k[t:t+32, e:e+32] · panel[e/2, s:s+32, 2]    (K in place)
    pv      accᵀ[32 of d_v][32 queries] += vᵀ[c:c+32, t:t+32] · P[t/2, s:s+32, 2]  (Vᵀ before the tasks)
    attn    pvᵀ turned into rows (`_pv_rows`), then / row_sum

with lengths padded to whole blocks of 32 (`_padding`), fp16 as bf16 parts (`fp16_parts`), and a
layer's projections as `amx_gemm` (fp16's in bf16 parts too: `parts_of`).

Decode (one query): the dot products run along d_k instead (``rfactor`` into one partial sum per
lane, then their sum), and with fewer (batch, head) pairs than twice the cores the keys are split into
``key_chunks`` parallel chunks (split-K): per-chunk partial row max, row sum and P·V, then a combine.

The register tiles are `cache_write` accumulators that LLVM keeps in vector registers (16 fp32
lanes with AVX-512, 8 with AVX2). Projections (full layer) are blocked GEMMs with the same register-tile
idea (symbolic rows padded to whole blocks, `_pad_rows`), in bf16 on the dot products from a
pair-packed copy of W (`weight_pairs`). Every tensor intrinsic
is applied last (`_register_tile`'s ``later``). Masked key tiles are removed after scheduling by
`tvmattn.compiler.passes.skip_masked_key_tiles`.
"""

from __future__ import annotations

import functools
from typing import Mapping

import tvm
from tvm.s_tir import Schedule
from tvm.target import Target
from tvm.tirx import PrimFunc

from tvmattn.compiler.isa.lane_sums import lane_sum_intrinsic
from tvmattn.compiler.isa.panels import query_panel_intrinsic
from tvmattn.compiler.isa.x86_amx import (
    BLOCK,
    STEP,
    STORE,
    configure_tiles,
    dot_intrinsic,
    transposed_values_intrinsic,
    zero_intrinsic,
)
from tvmattn.compiler.isa.x86_bf16 import (
    LANES,
    PAIR,
    DOT_16x2,
    DOT_16x2_PAIR_FIRST,
    pairs_intrinsic,
)
from tvmattn.compiler.passes import KEEP_16BIT, KEY_BLOCKS
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import isa_of, vector_lanes
from tvmattn.compiler.te_attention import KEY_STAGE, attention_te
from tvmattn.schedules.knobs import Knob, KnobValue
from tvmattn.schedules.rule import AttentionRule


def has_amx(target):
    return isa_of(target).tiles is not None


def has_bf16_dot(target):
    return isa_of(target).dot is not None


def full_width_avx512(target):
    return isa_of(target).full_width

KNOBS = (
    Knob("q_tile", (8, 16, 24, 32, 48, 64), 16, "queries per parallel task (a multiple of the vector width)"),
    Knob("qk_keys", (1, 2, 3, 4, 6, 8), 4, "keys per QKᵀ register tile"),
    Knob("pv_rows", (1, 2, 3, 4, 6, 8), 4, "queries per P·V register tile (at most: a divisor of q_tile)"),
    Knob("pv_vecs", (1, 2, 3, 4, 8, 16), 2, "vectors of d_v per P·V register tile"),
    Knob("key_chunks", (2, 4, 8, 16, 32), 8,
         "key chunks run in parallel when (batch, head) pairs are few (at most: a divisor of n_kv)"),
    Knob("gemm_rows", (1, 2, 3, 4, 6, 8), 4, "rows per projection register tile"),
    Knob("gemm_vecs", (1, 2, 3, 4), 2, "vectors of columns per projection register tile"),
    Knob("gemm_block_rows", (1, 4, 8, 16, 32), 16, "register tiles of rows per projection task"),
    Knob("gemm_block_cols", (1, 2, 4, 8), 4, "register tiles of columns per projection task"),
)

# Rows (B·n) from which a projection's W pair panel pays for itself: the packing pass reads and writes
# W once more, which a one-token step (decode, n = 1) would spend in a GEMV reading W once (0.65× the
# widened projections there; 0.9–1.3× from 16 rows, 1.6–1.9× from 64, (1, n, 768) layers).
MIN_PAIR_ROWS = 16
PANEL_BYTES = 384 * 1024  # a projection task's panel of W (d_in × its columns), to stay in L2
# Rows (B·n) from which a projection's W copied into register-tile panels (`weight_panels`) pays for
# the copy: 0.88× at 64 rows, 1.06–1.13× at 128, 1.19× from 1024 (fp32 GPT-2 layers, Zen 3)
MIN_PANEL_ROWS = 128
# Keys a query sees (about half of them where causal) from which an fp16 core's bf16 parts on AMX's
# tiles (`fp16_parts`) beat its widened fp32 FMAs: the parts' passes cost a task what three times the
# tile products save it on short rows (widened ÷ parts: 1.09 at (1, 8, 128, 64), 0.88 at it causal,
# 1.03 and 1.16 at (8, 8, 256, 32) causal and (1, 16, 256, 64) causal)
PARTS_MIN_KEYS = 128

PROJECTIONS = {"q_proj": "w_q", "k_proj": "w_k", "v_proj": "w_v", "out": "w_o"}  # the layer's GEMMs: block → W
INLINED = ("q_heads", "k_heads", "v_heads", "logits", "merged")
PER_TILE = ("pv", "row_sum", "probs", "row_max", "scores")  # consumers first, for compute_at


class CpuAttention(AttentionRule):
    name = "cpu"  # the name tuning records carry
    target_kind = "llvm"
    KNOBS = KNOBS

    def defaults(self, spec: AttentionSpec, target: Target) -> dict[str, int]:
        """Projection tiles by vector width and model width (`gemm_defaults`); with 16-bit inputs,
        64-query tiles and P·V tiles of 4 vectors: more work per widened key, or per bf16 panel (1.2×
        and 1.4× the 16-query tiles with bf16 dot products and fp16 at (4, 12, 512, 64)); 32-query
        tiles where a mask bounds each tile's keys (causal, a window): a tile computes every key up
        to its last query, and half its diagonal block is masked away (1.08× fp16 and 1.04× bf16 at
        (1, 8, 128, 64) causal, 1.08× fp16 at (8, 8, 256, 32), the same as 64 from n = 512); 16-query
        tiles, fp32's, for a masked fp16 core, whose K is widened once (`widened_kv`; 1.03× at (1, 8,
        128, 64) causal, 1.00–1.01× from n = 256; on AMX's tiles, `fp16_parts`, 32 as bf16's). A
        one-token layer (fewer than `MIN_PAIR_ROWS` rows: GEMVs, each W element read once, so no
        panel to keep in L2) takes column blocks small enough to give each core three tasks of its
        narrowest W (1.4× in bf16 and fp16, 1.02× in fp32 at (1, 1, 768): 6 tasks on 2 cores, not 3).

        The 16-bit tiles need AVX-512's 32 vector registers: with AVX2's 16 (8 lanes) a 64-query
        tile's 8 × 4 accumulators spill (0.32× fp32 at (1, 8, 512, 64) on Zen3), so there 16-bit
        inputs, widened to fp32 FMAs, take fp32's tiles (1.01×). fp32 takes the 16-bit tiles too
        where the FMA units are 512 bits wide (`full_width_avx512`, Zen 5: 1.03–1.41× fp32's 16-query
        tiles over 15 cores and layers, 1.33–1.41× dense from n = 128); Zen 4, whose FMAs are two
        256-bit halves, keeps them (its tuning records' best are 16- and 32-query tiles). On full-width
        FMAs a masked fp16 core takes 32-query tiles, not 16 (1.10–1.22× over the bench suite, Zen 5).
        Those P·V tiles hold 16 accumulators (4 rows × 4 vectors), what two FMA or dot-product pipes
        need to hide their latency; a d_v of at most 2 vectors (d_k = 32) fills them with 8 rows
        (1.17× bf16, 1.07× fp32, 1.05× fp16 at (8, 8, 256, 32) on Zen 5; 1.10×, 1.03×, 1.05× causal).

        One query (decode) takes P·V tiles of 4 vectors too in fp32: each tile streams V's rows
        once, so 2 vectors read V in 8 passes (4 take 1.16× their time at (1, 32, 4096, 128) on Zen
        3, 8 0.89×). A 16-bit V, half the bytes, is read in one pass where its rows fit 16 vectors
        (`_one_pass_vecs`)."""
        lanes = vector_lanes(target)
        masked = spec.causal or spec.window is not None
        full_width = full_width_avx512(target)
        widened = spec.dtype == "float16" and not spec.projections and not fp16_parts(spec, target)
        tile = 64 if not masked else 16 if widened and not full_width else 32
        wide = lanes >= LANES and (spec.dtype != "float32" or full_width)
        core = {"q_tile": tile, "pv_vecs": 4} if wide else {}
        if wide and spec.d_v <= 2 * lanes:  # a row of d_v in at most 2 vectors: 8 rows fill the tile
            core["pv_rows"] = 8
        if spec.n_q == 1:
            core["pv_vecs"] = _one_pass_vecs(spec, lanes) if spec.dtype != "float32" else 4
        if not spec.projections:
            return core
        d_in = max(spec.d_model, spec.h * spec.d_v)  # W_O's rows are the merged heads
        widths = _gemm_widths(spec)
        gemms = gemm_defaults(d_in, lanes, tvm.DataType(spec.dtype).bits, widths)
        rows = spec.batch * spec.n_q if isinstance(spec.batch, int) and isinstance(spec.n_q, int) else None
        if rows is not None and rows < MIN_PAIR_ROWS:
            tiles = min(spec.d_model, spec.h_kv * spec.d_k) // (gemms["gemm_vecs"] * lanes)  # per W's columns
            tasks = 3 * int(target.attrs.get("num-cores", 1))
            gemms["gemm_block_cols"] = next((c for c in (8, 4, 2) if c <= gemms["gemm_block_cols"]
                                             and tiles // c >= tasks), 1)
        return core | gemms

    def workload(self, spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue]) -> PrimFunc:
        """The tensor expression's function; on the bf16 instructions, symbolic lengths run in whole
        blocks (`_padding`, `te_attention._core`), the tiles the instructions need."""
        return attention_te(spec, _padding(spec, target), parts_of(spec, target)).prim_func()

    def describe(self, spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue]) -> str:
        """Which variant ``apply`` builds for ``spec``, with the knobs it reads."""
        lanes = vector_lanes(target)
        dots = []
        if _few_tasks_of_one_query(spec, target, lanes) and _divisor_at_most(spec.n_kv, knobs["key_chunks"]) > 1:
            used = ["key_chunks"]
            what = f"split-K decode over {_divisor_at_most(spec.n_kv, knobs['key_chunks'])} key chunks"
        else:
            used = ["q_tile", "qk_keys", "pv_rows", "pv_vecs"]
            what = f"query tiles × {lanes}-lane vectors"
            n_q = _whole(spec.n_q, _padding(spec, target))
            q_tile = min(knobs["q_tile"], n_q) if isinstance(n_q, int) else knobs["q_tile"]
            q_tile = _dot_tile(spec, target, q_tile) or q_tile
            qk_keys = _qk_keys(None, spec, target, knobs["qk_keys"])
            if _along_head_dim(spec, q_tile, lanes):  # (qk_keys, and q_tile = n_q, unread)
                used = ["pv_rows", "pv_vecs"] if q_tile > 1 else ["pv_vecs"]
                queries = "1 query" if q_tile == 1 else f"{q_tile} queries"
                what = f"{queries} per task × {lanes}-lane dot products along d_k"
            if amx_tiles(spec, target, q_tile):
                used = ["q_tile"]
                parts = ", fp16 as bf16 hi + lo" if fp16_parts(spec, target) else ""
                what += f", QKᵀ and P·V on AMX tiles (tdpbf16ps{parts})"
            else:
                dots = [stage for stage, on in zip(("QKᵀ", "P·V"), bf16_dots(spec, target, q_tile, qk_keys)) if on]
                widened = [x for x, on in zip("KV", widened_kv(spec, target, q_tile, qk_keys)) if on]
                v_pairs = "P·V" in dots and _v_pairs_per_head(spec, target)
                if (widened or v_pairs) and head_tasks(spec, target):
                    once = f"widening its {_listed(widened)}" if widened else "packing its V in pairs"
                    what += f", a task per (batch, KV head) {once} once"
        if "pv_vecs" in used and _lanes_for(spec.d_v, lanes) < lanes:  # d_v in narrower vectors: one per tile
            used.remove("pv_vecs")
        if spec.projections:
            used += ["gemm_rows", "gemm_vecs", "gemm_block_rows", "gemm_block_cols"]
            tiles = [weight.upper() for name, weight in PROJECTIONS.items() if weight_tiles(spec, target, name)]
            widths = _gemm_widths(spec)
            if not tiles and all(_lanes_for(w, lanes) < lanes for w in widths):  # `gemm`: one narrower vector
                used.remove("gemm_vecs")
            dots += [weight.upper() for name, weight in PROJECTIONS.items()
                     if weight_pairs(spec, target, name) and not weight_tiles(spec, target, name)]
            if tiles:
                parts = " (fp16 as bf16 hi + lo)" if spec.dtype == "float16" else ""
                what += f", {_listed(tiles)} on AMX tiles{parts}"
        if dots:
            what += f", {_listed(dots)} on bf16 dot products (vdpbf16ps)"
        return f"{what}: " + " ".join(f"{name}={knobs[name]}" for name in used)

    def apply(self, sch: Schedule, spec: AttentionSpec, target: Target,
              knobs: Mapping[str, KnobValue]) -> Schedule | None:
        """Schedule the PrimFunc of ``spec`` (in place; returns ``sch``)."""
        if not self.applies(spec, target):
            return None
        lanes = vector_lanes(target)
        for name in INLINED:
            # (W_O's x, merged, a stage of its own where `_pad_rows` pads it: an einsum's operand)
            # (fp16's merged_hi and merged_lo read it instead: `parts_of`)
            if not _has_block(sch, name):
                continue
            if name != "merged" or _has_block(sch, "merged_hi") or not _padded_rows(spec, target, "out"):
                sch.compute_inline(sch.get_sblock(name))
        # Every tensorize runs last, in order (`_register_tile`'s ``later``): a tensorized stage can
        # leave the root scope no "stage pipeline" for the other stages' primitives.
        steps: list = []
        _widen_projection_inputs(sch, spec, target, lanes)
        for name in PROJECTIONS:
            if _has_block(sch, name):
                _gemm(sch, spec, target, name, lanes, knobs, steps)
        for x in ("x", "x_kv", "merged"):  # fp16 projections' operand parts (`parts_of`): a pass each
            if _has_block(sch, x + "_hi"):
                _before_tasks(sch, (x + "_hi", x + "_lo"), lanes)
        chunks = _divisor_at_most(spec.n_kv, _int(sch, knobs["key_chunks"]))  # rfactor drops tail predicates
        amx = spec.projections and any(weight_tiles(spec, target, name) for name in PROJECTIONS)
        if _few_tasks_of_one_query(spec, target, lanes) and chunks > 1:
            _split_keys(sch, spec, lanes, chunks, steps)
        else:
            amx |= _attention_core(sch, spec, target, lanes, knobs, steps)
        for step in steps:
            step()
        if amx or (steps and spec.dtype == "bfloat16" and has_bf16_dot(target)):  # the instructions' LLVM IR
            first = sch.get_loops(sch.get_sblock("attn" if spec.projections else spec.output))[0]
            isa = isa_of(target)
            sch.annotate(first, "pragma_import_llvm", isa.tiles.llvm if amx else isa.dot.llvm)
        return sch


def _gemm_widths(spec: AttentionSpec) -> tuple[int, int, int, int]:
    """The output widths of a layer's projections: W_Q, W_K, W_V, W_O."""
    return spec.h * spec.d_k, spec.h_kv * spec.d_k, spec.h_kv * spec.d_v, spec.d_model


def gemm_defaults(d_in: int, lanes: int, bits: int, widths: tuple[int, ...] = ()) -> dict[str, int]:
    """GEMM register tiles: 4 rows × 4 vectors of accumulators with AVX-512's 32 registers; with
    AVX2's 16, 4 × 3 where every output width (``widths``) is whole tiles of them: 12 accumulators,
    3 W vectors and the broadcast x fill all 16 (1.12–1.14× the 4 × 2 tiles in fp32, 1.2–1.3× in
    fp16 and bf16, GPT-2 layers on Zen 3), else 4 × 2 (a tail tile is predicated lane by lane). As
    many column tiles per task as keep the task's W panel (``d_in`` rows) within `PANEL_BYTES`
    (wide models: fewer columns, or W streams from memory)."""
    vecs = 4 if lanes >= 16 else 3 if widths and all(w % (3 * lanes) == 0 for w in widths) else 2
    tile_bytes = d_in * vecs * lanes * bits // 8
    cols = next((c for c in (8, 4, 2) if c * tile_bytes <= PANEL_BYTES), 1)
    return {"gemm_vecs": vecs, "gemm_block_cols": cols}


def _attention_core(sch: Schedule, spec: AttentionSpec, target: Target, lanes: int,
                    k: Mapping[str, KnobValue], steps: list) -> bool:
    """The query-tile kernel (see the module docstring); True where QKᵀ and P·V run on AMX tiles."""
    tile_factor = _at_most(sch, k["q_tile"], _whole(spec.n_q, _padding(spec, target)))  # decode: one exact tile
    tile_factor = _dot_tile(spec, target, _int(sch, tile_factor)) or tile_factor  # dot products: whole tiles
    q_tile = _int(sch, tile_factor)
    s_lanes = _lanes_for(q_tile, lanes)  # queries per vector
    by_head_dim = _along_head_dim(spec, q_tile, lanes)
    qk_keys = _qk_keys(sch, spec, target, k["qk_keys"])
    amx = amx_tiles(spec, target, q_tile)
    parts = fp16_parts(spec, target)  # (then amx: `_dot_tile` keeps whole blocks of 32)
    qk_pairs, pv_pairs = (True, True) if amx else bf16_dots(spec, target, q_tile, _int(sch, qk_keys))
    widen_k, widen_v = widened_kv(spec, target, q_tile, _int(sch, qk_keys))
    v_pairs = pv_pairs and not amx and _v_pairs_per_head(spec, target)  # V's pair panel in head tasks, if any
    per_head = (widen_k or widen_v or v_pairs) and head_tasks(spec, target)
    v_pairs = v_pairs and per_head
    if by_head_dim:
        scores_rf = _split_head_dim(sch, _lanes_for(spec.d_k, lanes))
    # Tile-local buffers are laid out (query tile, key, query in tile): vectors run along queries, and
    # the tile axis makes their compacted size q_tile × n_kv even when lengths are symbolic.
    by_tile = lambda b, i, s, *rest: (b, i, s // q_tile, *rest, s % q_tile)  # noqa: E731
    for name in ("scores", "probs", "row_max", "row_sum"):
        sch.transform_layout(sch.get_sblock(name), ("write", 0), by_tile, assume_injective_transform=True)
    # (AMX: pvᵀ, d_v-major, as its tiles compute it: `_amx_stage`)
    pv_at = (lambda b, i, s, c: (b, i, s // q_tile, c, s % q_tile)) if amx else (  # noqa: E731
        lambda b, i, s, c: (b, i, s // q_tile, s % q_tile, c))
    sch.transform_layout(sch.get_sblock("pv"), ("write", 0), pv_at, assume_injective_transform=True)

    attn = sch.get_sblock("attn")
    loops = _loops_by_axis(sch, attn)
    s_tile, s_in = sch.split(loops["s"], [None, tile_factor])
    # GQA: the query heads of a group take consecutive tasks on the same query tile, so the key and
    # value rows one task streams are still in cache for the next
    head_kv, head_in_group = sch.split(loops["i"], [None, spec.group])
    sch.reorder(loops["b"], head_kv, s_tile, head_in_group, s_in, loops["c"])
    if per_head:  # the per-tile stages live in ``task``, the loop over a head task's tiles
        head = sch.fuse(loops["b"], head_kv)
        task = sch.fuse(s_tile, head_in_group)
        sch.parallel(head)
    else:
        head = None  # (16-bit K and V widened in a pass before the tasks)
        task = sch.fuse(loops["b"], head_kv, s_tile, head_in_group)
        sch.parallel(task)
    if amx:
        configure_tiles(sch, task)
    _vectorize(sch, loops["c"], spec.d_v, lanes)
    for name in PER_TILE[:1] + (("p_hi", "p_lo") if parts else ()) + PER_TILE[1:]:  # consumers first
        sch.compute_at(sch.get_sblock(name), task, preserve_unit_loops=True)
    if _has_block(sch, "v_rows"):  # keys in whole blocks (`_padding`): P·V's panels are packed from them
        _in_blocks(sch, "v_rows", lanes, pv_pairs)
        _in_blocks(sch, "k_rows", lanes, amx)
    if parts:  # K's and V's parts, once before the tasks, in one pass
        _before_tasks(sch, ("k_hi", "k_lo", "v_hi", "v_lo"), lanes)

    if by_head_dim:
        _scores_along_head_dim(sch, scores_rf, steps)
        _row_reduction(sch, "row_max", s_lanes)
    else:
        if parts:
            _pack_query_parts(sch, task, q_tile, lanes, steps)
        else:
            _pack_queries(sch, spec, task, q_tile, lanes, qk_pairs, steps)
        if widen_k:
            _widened_once(sch, "scores", ("k", "k_proj"), spec.d_k, lanes, at=head)
        if amx:
            in_place = not (parts or spec.projections or _has_block(sch, "k_rows"))  # K read as it is given
            tile_keys = _amx_stage(sch, "scores", in_place and spec.layout == "BSHD", parts, steps)
        else:
            widen = spec.dtype != "float32" and not qk_pairs and not widen_k  # (a layer's k_proj outside head tasks)
            tile_keys = _scores(sch, s_lanes, qk_keys, qk_pairs, steps, widen=widen)
        if spec.attn_mask is not None and {"s", "t"} <= set(spec.attn_mask_dims):
            _pack_mask(sch, task, q_tile)  # (row_max then reads the mask's tile: a pass of its own)
            _row_reduction(sch, "row_max", s_lanes)
        else:  # of each register tile as it is stored
            _row_reduction(sch, "row_max", s_lanes, tile_keys)
    probs = sch.get_sblock("probs")
    s, t = sch.get_loops(probs)[-2:]
    if pv_pairs:  # a pair of keys at a time: P's panel is packed from them while they are in registers
        t, t_pair = sch.split(t, [None, PAIR])
        sch.reorder(t, t_pair, s)
    else:
        sch.reorder(t, s)
    if s_lanes > 1:
        _vectorize(sch, s, q_tile, s_lanes)
        _row_reduction(sch, "row_sum", s_lanes, t)
    else:  # one query: the keys are contiguous
        _vectorize(sch, t, spec.n_kv if isinstance(spec.n_kv, int) else None, lanes)
        _row_reduction(sch, "row_sum", s_lanes)
    if pv_pairs:
        panels = _pack_parts(sch, t, q_tile) if parts else _pack_pairs(sch, spec, t, amx, head if v_pairs else None)
    else:
        panels = None
    if widen_v:
        _widened_once(sch, "pv", ("v_rows", "v", "v_proj"), spec.d_v, lanes, at=head)
    if amx:
        _amx_stage(sch, "pv", False, parts, steps)
        _pv_rows(sch, lanes, steps)
    else:  # whole row groups per tile: a partial group's accumulator has a loop-dependent size
        _weights_v(sch, spec, lanes, _divisor_at_most(q_tile, _int(sch, k["pv_rows"])), k["pv_vecs"], pv_pairs,
                   steps)
    if panels and parts:
        steps.append(functools.partial(_tensorize_parts, sch, panels, q_tile))
    elif panels:
        steps.append(functools.partial(_tensorize_pairs, sch, spec, panels, q_tile, amx, v_pairs))
    return amx


def _row_reduction(sch: Schedule, name: str, s_lanes: int, at=None) -> None:
    """row_max or row_sum vectorised over queries, reducing along keys: a pass of its own over the
    task's tile, or, ``at`` the loop over keys of the stage it reads, inside it (reading what that
    stage just wrote, from L1: the tile streams through L2 once per stage)."""
    blk = sch.get_sblock(name)
    if at is None:
        s, t = sch.get_loops(blk)[-2:]
        s_out, s_vec = sch.split(s, [None, s_lanes])
        sch.reorder(s_out, t, s_vec)
        _vectorize(sch, s_vec, s_lanes, s_lanes)
        sch.decompose_reduction(blk, t)
        return
    sch.reverse_compute_at(blk, at, preserve_unit_loops=True)
    s, t = sch.get_loops(blk)[-2:]
    sch.reorder(t, s)
    _vectorize(sch, s, None, s_lanes)
    sch.decompose_reduction(blk, at)


def _padding(spec: AttentionSpec, target: Target) -> int:
    """The block the core kernel's lengths run in (`te_attention._core`; 1: none), for the bf16
    instructions, which take no tail: 32 for AMX's tiles (`amx_tiles`; symbolic lengths, and static
    ones that are no multiple of 32, but for one query), else `LANES` for the dot products (symbolic
    lengths), which QKᵀ
    then always takes (static queries in whole dot tiles, d_k in pairs, `_qk_keys` dividing the
    block; TVM 0.27 cannot build the widened key tiles over padded keys)."""
    n_q, n_kv = spec.n_q, spec.n_kv
    if fp16_parts(spec, target):
        return BLOCK if any(isinstance(x, str) or x % BLOCK for x in (n_q, n_kv)) else 1
    if not (spec.dtype == "bfloat16" and has_bf16_dot(target) and spec.d_k % PAIR == 0):
        return 1
    # (one query, a decode step, keeps its dot products along d_k: 31 padding rows cost 2.5× there,
    # while from 4 queries the padded tiles beat the other kernels: 1.8× at (1, 16, 4 → 1024, 64))
    if _amx_widths(spec, target) and n_q != 1 and any(isinstance(x, str) or x % BLOCK for x in (n_q, n_kv)):
        return BLOCK
    symbolic = any(isinstance(x, str) for x in (n_q, n_kv))
    return LANES if symbolic and (isinstance(n_q, str) or n_q % LANES == 0) else 1


def _whole(length, block: int):
    """A length as the kernel's stages run it (`_padding`): in whole blocks where padded (a symbolic
    one: any multiple of the block stands for it)."""
    if block == 1:
        return length
    return block if not isinstance(length, int) else -(-length // block) * block


def _qk_keys(sch: Schedule | None, spec: AttentionSpec, target: Target, knob: KnobValue) -> KnobValue:
    """Keys per QKᵀ register tile: the knob, at most a static n_kv; with `_padding`, the largest
    divisor of `LANES` up to it (the padded keys come in whole blocks)."""
    if _padding(spec, target) > 1 and not isinstance(spec.n_kv, int):
        return _divisor_at_most(LANES, _int(sch, knob))
    return _at_most(sch, knob, spec.n_kv)


def _dot_tile(spec: AttentionSpec, target: Target, q_tile: int) -> int | None:
    """The query tile for bf16 dot products or AMX tiles at most ``q_tile``: the largest power of two
    from 16 that divides a static n_q (padded, `_padding`), or the block a symbolic one runs in; None:
    no such tile, or no such instruction."""
    parts = fp16_parts(spec, target)  # (always on AMX's tiles: whole blocks of 32)
    if not parts and (spec.dtype != "bfloat16" or not has_bf16_dot(target)):
        return None
    block = _padding(spec, target)
    if not isinstance(spec.n_q, int):
        return block if block > 1 else None
    n_q = _whole(spec.n_q, block)
    tiles = (64, BLOCK) if parts else (64, 32, LANES)
    return next((t for t in tiles if t <= max(q_tile, tiles[-1]) and n_q % t == 0), None)


def bf16_dots(spec: AttentionSpec, target: Target, q_tile: int, qk_keys: int) -> tuple[bool, bool]:
    """Whether QKᵀ and P·V of the query-tile kernel run on `x86_bf16.DOT_16x2` (vdpbf16ps): bf16 on
    a CPU with AVX512-BF16, static lengths in whole query tiles (``q_tile`` a power of two from 16)
    and key tiles (``qk_keys``), whole pairs of the reduction (d_k even; for P·V an even n_kv) and d_v
    in whole vectors: a tail's predicate cannot sit inside the instruction. Elsewhere the stage
    widens to fp32 FMAs."""
    block = _padding(spec, target)
    n_q, n_kv = (_whole(x, block) for x in (spec.n_q, spec.n_kv))
    if spec.dtype != "bfloat16" or not has_bf16_dot(target) or q_tile < LANES or q_tile & (q_tile - 1) \
            or not isinstance(n_q, int) or n_q % q_tile or not isinstance(n_kv, int):
        return False, False
    # (K's clamped rows of a symbolic n_kv, d_k not whole vectors of 16: TVM cannot bind the instruction's pair views)
    qk = spec.d_k % PAIR == 0 and n_kv % qk_keys == 0 and (isinstance(spec.n_kv, int) or spec.d_k % LANES == 0)
    return qk, n_kv % PAIR == 0 and spec.d_v % LANES == 0


def amx_tiles(spec: AttentionSpec, target: Target, q_tile: int) -> bool:
    """Whether QKᵀ and P·V of the query-tile kernel run on AMX tiles (`x86_amx`, 32 × 32 blocks of
    accumulators): `_amx_widths`, and lengths in whole blocks of 32 (an instruction takes no tail),
    padded to them where they are not (`_padding`), with query tiles a multiple of 32 dividing them.
    Elsewhere `bf16_dots` decides."""
    block = _padding(spec, target)
    n_q, n_kv = (_whole(x, block) for x in (spec.n_q, spec.n_kv))
    return (_amx_widths(spec, target) and block in (1, BLOCK) and q_tile % BLOCK == 0 and n_q % q_tile == 0
            and n_kv % BLOCK == 0)


def _amx_widths(spec: AttentionSpec, target: Target) -> bool:
    """A spec whose widths AMX's tiles take: bf16 (fp16: `fp16_parts`) on a CPU with AMX-BF16 (and
    AVX512-BF16, which rounds P into its pairs), d_k and d_v multiples of 32."""
    return ((spec.dtype == "bfloat16" or fp16_parts(spec, target)) and has_amx(target) and has_bf16_dot(target)
            and spec.d_k % STEP == 0 and spec.d_v % BLOCK == 0)


def parts_of(spec: AttentionSpec, target: Target) -> frozenset[str]:
    """The products of ``spec``'s kernel whose fp16 operands run on AMX's bf16 tiles as two bf16
    parts each (`te_attention.attention_te`'s ``parts``): "core" (`fp16_parts`) and the projections
    on the tiles (`weight_tiles`)."""
    projections = [name for name in PROJECTIONS if spec.projections and weight_tiles(spec, target, name)]
    core = ["core"] if fp16_parts(spec, target) else []
    return frozenset(core + projections) if spec.dtype == "float16" else frozenset()


def fp16_parts(spec: AttentionSpec, target: Target) -> bool:
    """Whether an fp16 core kernel runs on AMX's bf16 tiles, each operand the sum of two bf16 parts
    (`te_attention.bf16_parts`: exact for fp16; three tile products where bf16 takes one, 2^-16 of
    each product left out): CPUs have no fp16 tile products before AMX-FP16, and fp32 FMAs of
    widened fp16 run at fp32's speed. Not for one query (a decode step: its dot products along d_k
    read half fp32's bytes) nor where a query sees fewer than `PARTS_MIN_KEYS` static keys (in a
    layer too: 1.21× the widened core at a causal (1, 1024, 768) GPT-2 layer)."""
    seen = spec.n_kv // 2 if spec.causal and isinstance(spec.n_kv, int) else spec.n_kv
    seen = min(seen, spec.window) if spec.window is not None and isinstance(seen, int) else seen
    few_keys = isinstance(seen, int) and seen < PARTS_MIN_KEYS
    return (spec.dtype == "float16" and has_amx(target) and has_bf16_dot(target)
            and spec.n_q != 1 and not few_keys and spec.d_k % STEP == 0 and spec.d_v % BLOCK == 0)


def widened_kv(spec: AttentionSpec, target: Target, q_tile: int, qk_keys: int) -> tuple[bool, bool]:
    """Whether the query-tile kernel widens 16-bit K and V to fp32 once (`_widened_once`), for fp32
    FMAs (no AMX tiles, no `bf16_dots`) that then load plain fp32 in every tile. Not fp16's V with
    AVX2 (Zen 3): there P·V's vcvtph2ps per vector of V, shared by the tile's rows, costs less than
    the widened copy (1.05–1.11× the pass; 0.99–1.01× a copy per head task; bf16's widening in the
    tile, a zero-extension and a shift per vector, measured 0.97×). Not decode's K, read along d_k.
    A layer's k_proj and v_proj only in head tasks (`head_tasks`; bf16 GPT-2-small layers 1.05–1.16×
    on Zen 3): elsewhere its register tiles widen k_proj (`_widen_keys`) and P·V converts V."""
    lanes = vector_lanes(target)
    s_lanes = _lanes_for(q_tile, lanes)
    by_head_dim = s_lanes == 1 and _lanes_for(spec.d_k, lanes) > 1
    qk_pairs, pv_pairs = (True, True) if amx_tiles(spec, target, q_tile) else bf16_dots(spec, target, q_tile, qk_keys)
    widened = spec.dtype != "float32" and not by_head_dim and (not spec.projections or head_tasks(spec, target))
    return (widened and not qk_pairs,
            widened and not pv_pairs and s_lanes > 1 and (lanes >= LANES or spec.dtype == "bfloat16"))


def _v_pairs_per_head(spec: AttentionSpec, target: Target) -> bool:
    """Whether the pair panel of a core's V for the bf16 dot products can be packed in its head's task
    (`_pack_pairs`, where `head_tasks`): not from a layer's v_proj, nor from keys padded to whole
    blocks (TVM 0.27 cannot bind the pairs' view of the clamped rows there)."""
    return not spec.projections and _whole(spec.n_kv, _padding(spec, target)) == spec.n_kv


def head_tasks(spec: AttentionSpec, target: Target) -> bool:
    """Whether the core's parallel tasks are whole (batch, KV head) pairs, each running its query
    tiles in turn, where they split evenly over the cores (as many tiles of work each: a head's
    tiles, causal or not, sum to the same). A task then widens its head's 16-bit K and V once, kept
    in its cache for the next tile, where query-tile tasks need a parallel pass before them (a
    thread-pool start, and the fp32 copy written to memory and read back): 1.08–1.12× fp16 and bf16
    at (1, 8, 128, 64) dense and causal, 1.09× bf16 at (8, 8, 256, 32) causal, within noise from n =
    512 (Zen 3). A symbolic batch (the PyTorch drop-in's kernels) splits evenly at any size where its
    KV heads do."""
    per_batch = spec.batch if isinstance(spec.batch, int) else 1
    return per_batch * spec.h_kv % int(target.attrs.get("num-cores", 1)) == 0


def _one_pass_vecs(spec: AttentionSpec, lanes: int) -> int:
    """P·V vectors per register tile for one query of a 16-bit V: its whole row, up to 16 vectors
    (then a pass reads every cache line of a row once, where 4 vectors read a 256-byte fp16 row in
    4 passes of one line each). At (1, 32, 4096, 128) on Zen 3, whose 16 registers spill 3 of the 16
    accumulators: fp16 1.06–1.07× the 4-vector tile, bf16 0.99–1.03×; at L = 1024 1.20× and 1.04×.
    Unmeasured on AVX-512, whose 32 registers hold them. A row of no power-of-two count of vectors
    keeps 4 (a predicated tail)."""
    row = max(spec.d_v // lanes, 1)
    return max((c for c in (2, 4, 8, 16) if row % c == 0), default=4)


def _along_head_dim(spec: AttentionSpec, q_tile: int, lanes: int) -> bool:
    """Query tiles no vector of queries fits (one query, a decode step; an odd tile): the vectors run
    along d_k instead."""
    return _lanes_for(q_tile, lanes) == 1 and _lanes_for(spec.d_k, lanes) > 1


def _few_tasks_of_one_query(spec: AttentionSpec, target: Target, lanes: int) -> bool:
    """Decode with fewer (batch, head) pairs than twice the cores: only the keys can keep them busy."""
    sizes = (spec.batch, spec.n_q, spec.n_kv)
    if any(isinstance(x, str) for x in sizes) or spec.n_q > 1 or _lanes_for(spec.d_k, lanes) == 1:
        return False
    cores = int(target.attrs.get("num-cores", 1))
    return spec.batch * spec.h < 2 * cores and spec.n_kv >= 64 * cores


def _divisor_at_most(n, limit: int) -> int:
    """The largest factor of ``n`` up to ``limit`` (1 when n is symbolic)."""
    if not isinstance(n, int):
        return 1
    return max(d for d in range(1, limit + 1) if n % d == 0)


def _split_keys(sch: Schedule, spec: AttentionSpec, lanes: int, chunks: int, steps: list) -> None:
    """Split-K decode: every key reduction becomes per-chunk partials computed in parallel (rfactor)
    and a small combine; scores and probs run in parallel over key chunks directly. ``chunks``
    divides n_kv.

        scores[t]              parallel over chunks of t     (dot products along d_k, `_scores_along_head_dim`)
        row_max_rf[chunk]      parallel  → row_max = max over chunks
        probs[t]               parallel over chunks of t
        row_sum_rf[chunk], pv_rf[chunk, c]   parallel → sums over chunks
    """
    scores_rf = _split_head_dim(sch, _lanes_for(spec.d_k, lanes))
    partial = {}
    for name in ("row_max", "row_sum", "pv"):
        t = sch.get_loops(sch.get_sblock(name))[-1]
        chunk, _ = sch.split(t, [chunks, None])
        partial[name] = sch.rfactor(chunk, 0)
    attn = sch.get_sblock("attn")
    loops = _loops_by_axis(sch, attn)
    sch.reorder(loops["b"], loops["i"], loops["s"], loops["c"])
    task = sch.fuse(loops["b"], loops["i"], loops["s"])  # few: serial, the parallelism is inside
    _vectorize(sch, loops["c"], spec.d_v, lanes)
    for blk in (sch.get_sblock("pv"), partial["pv"], sch.get_sblock("row_sum"), partial["row_sum"],
                sch.get_sblock("probs"), sch.get_sblock("row_max"), partial["row_max"], sch.get_sblock("scores")):
        sch.compute_at(blk, task, preserve_unit_loops=True)

    _scores_along_head_dim(sch, scores_rf, steps, chunks)
    for name in ("row_max", "row_sum"):
        chunk = sch.get_loops(partial[name])[-5]  # (chunk, b, i, s, t_in)
        sch.parallel(chunk)
    probs_t = sch.get_loops(sch.get_sblock("probs"))[-1]
    chunk, t_in = sch.split(probs_t, [chunks, None])
    sch.parallel(chunk)
    _vectorize(sch, t_in, None, lanes)
    chunk, *_, c, t_in = sch.get_loops(partial["pv"])[-6:]  # (chunk, b, i, s, c, t_in)
    sch.reorder(t_in, c)
    sch.parallel(chunk)
    _vectorize(sch, c, spec.d_v, lanes)
    sch.decompose_reduction(partial["pv"], t_in)
    _vectorize(sch, sch.get_loops(sch.get_sblock("pv"))[-1], spec.d_v, lanes)


def _pack_queries(sch: Schedule, spec: AttentionSpec, task, q_tile: int, lanes: int, pairs: bool,
                   steps: list) -> None:
    """Copy the task's queries into a (d_k, q_tile) panel: QKᵀ then loads whole vectors of queries
    (``pairs``: a (d_k/2, q_tile, 2) panel, the operand of `x86_bf16.DOT_16x2`). Where the tiles
    hold whole blocks of lanes × lanes words, a transposition in registers (`_tensorize_queries`, a
    step for ``steps``)."""
    padded = _has_block(sch, "q_rows")  # (B, h, n_rows, d_k), rows clamped to n - 1
    width = lanes * (PAIR if pairs else 1)  # of d_k per block of the panel
    whole = q_tile % lanes == 0 and spec.d_k % width == 0 and (padded or (isinstance(spec.n_q, int)
                                                                          and spec.n_q % q_tile == 0))
    if padded and not whole:  # the stage is the panel
        panel = sch.get_sblock("q_rows")
    else:  # (a padded one: a copy of the task's clamped rows as they are, then the blocks of it)
        panel = _copy_of(sch, sch.get_sblock("scores"), ("q_rows",) if padded else ("q", "q_proj"))
    sch.compute_at(panel, task, preserve_unit_loops=True)
    if padded and whole:
        rows = sch.get_sblock("q_rows")
        sch.compute_at(rows, task, preserve_unit_loops=True)
        _vectorize(sch, sch.get_loops(rows)[-1], spec.d_k, lanes)
    # bf16 dot products: (d_k/2, q_tile, 2), each query's pairs of e side by side
    at = (lambda e, s: (e // PAIR, s % q_tile, e % PAIR)) if pairs else (lambda e, s: (e, s % q_tile))  # noqa: E731
    if spec.projections and not padded:  # q_proj (B, n, h·d_k)
        layout = lambda b, s, m: (b, s // q_tile, *at(m, s))  # noqa: E731
    elif spec.layout == "BHSD" or padded:  # q_rows is (B, h, n_rows, d_k) in either layout
        layout = lambda b, i, s, e: (b, i, s // q_tile, *at(e, s))  # noqa: E731
    else:
        layout = lambda b, s, i, e: (b, i, s // q_tile, *at(e, s))  # noqa: E731
    sch.transform_layout(panel, ("write", 0), layout, assume_injective_transform=True)
    if spec.dtype != "float32" and not pairs:  # widened once here, not at every use
        sch.unsafe_set_dtype(panel, 0, "float32")
    if whole:
        bshd = not spec.projections and spec.layout == "BSHD" and not padded
        intrinsic = query_panel_intrinsic(spec.dtype, lanes, pairs, argument=not (spec.projections or padded),
                                          heads_between=bshd)
        steps.append(functools.partial(_tensorize_queries, sch, sch.get(panel).name_hint, intrinsic, lanes,
                                       width, bshd))


def _tensorize_queries(sch: Schedule, name: str, intrinsic: str, lanes: int, width: int,
                       heads_between: bool) -> None:
    """The query panel ``name`` as ``intrinsic`` (`x86_panels.query_panel_intrinsic`): its loops
    (…, s, [head,] e), blocks of ``lanes`` queries × ``width`` of d_k (a unit head loop outside them)."""
    loops = sch.get_loops(sch.get_sblock(name))
    head = loops[-2:-1] if heads_between else []
    s_out, s_in = sch.split(loops[-3] if heads_between else loops[-2], [None, lanes])
    e_out, e_in = sch.split(loops[-1], [None, width])
    sch.reorder(*head, s_out, e_out, s_in, e_in)
    _tensorize(sch, s_in, intrinsic)


def _pack_mask(sch: Schedule, task, q_tile: int) -> None:
    """Copy the task's rows of a per-query attn_mask into a (key, query) tile, once: the stages that
    read it (row max, probabilities) run along queries, and would otherwise gather the mask with a
    stride of n_kv, twice."""
    readers = [sch.get_sblock(name) for name in ("row_max", "probs")]
    padded = _has_block(sch, "mask_rows")  # the mask in whole blocks (`te_attention._core`): the tile is of it
    tile = sch.get_sblock("mask_rows") if padded else _copy_of(sch, readers[0], ("attn_mask",), readers)
    sch.compute_at(tile, task, preserve_unit_loops=True)
    sch.transform_layout(tile, ("write", 0), lambda b, h, s, t: (b, h, s // q_tile, t, s % q_tile),
                         assume_injective_transform=True)


def _scores(sch: Schedule, lanes: int, keys_factor: KnobValue, pairs: bool, steps: list, widen: bool):
    """acc[qk_keys keys][q_tile queries] += k[t, e] · q[e, s], over e, in registers (``lanes``
    queries per vector); with ``pairs``, two steps of e per instruction (`x86_bf16.DOT_16x2`: the
    pair k[t, e:e+2] broadcast, the panel's q[e:e+2, s:s+16]); ``widen``: 16-bit keys widened to fp32
    a key tile at a time (`_widen_keys`: a layer's k_proj where no head task widens it, `widened_kv`).
    Returns the loop over register tiles of keys."""
    scores = sch.get_sblock("scores")
    s, t, e = sch.get_loops(scores)[-3:]
    keys = _int(sch, keys_factor)
    t_out, t_in = sch.split(t, [None, keys_factor])
    s_out, s_vec = sch.split(s, [None, lanes])
    if pairs:
        e, e_pair = sch.split(e, [None, PAIR])
        sch.reorder(t_out, e, t_in, s_out, s_vec, e_pair)
    else:
        sch.reorder(t_out, e, t_in, s_out, s_vec)
    if widen:
        _widen_keys(sch, scores, t_out, lanes)
    _register_tile(sch, scores, t_out, lambda b, i, st, t, s: (b, i, st, t // keys, t % keys, s),
                   (t_in, s_out), s_vec, lanes, e, intrinsic=DOT_16x2 if pairs else None,
                   key_blocks=f"b=v_b_o,s=v_s_o*{LANES},t=v_t_o", later=steps)
    return t_out


def _amx_stage(sch: Schedule, name: str, heads_between: bool, parts: bool, steps: list):
    """QKᵀ or P·V on AMX's tiles (`x86_amx.DOT`), a 32 × 32 accumulator block per (m, n), 32 steps of
    the reduction per product; both stages' loops run (queries n, m, reduction):

        scores  acc[32 keys][32 queries]     += k[t, e:e+32] · panel[e/2, s, e%2]   (K in place,
                                                ``heads_between`` in BSHD; the query pair panel)
        pv      accᵀ[32 of d_v][32 queries]  += Vᵀ[c, t:t+32] · P[t/2, s, t%2]     (`_pack_pairs`' panels;
                                                stored d_v-major, `_pv_rows` turns it for the epilogue)

    with ``parts``, each operand's bf16 parts (`fp16_parts`). Returns the loop over blocks of m."""
    blk = sch.get_sblock(name)
    n, m, k = sch.get_loops(blk)[-3:]
    n_out, n_in = sch.split(n, [None, BLOCK])
    m_out, m_in = sch.split(m, [None, BLOCK])
    k_out, k_in = sch.split(k, [None, STEP])
    sch.reorder(m_out, n_out, k_out, m_in, n_in, k_in)
    # (keys come in blocks of 32 either way: QKᵀ's m, P·V's reduction; BLOCK == STEP)
    _amx_block(sch, blk, n_out, k_out, False, f"b=v_b_o,s=v_s_o*{BLOCK},t=v_t_o*{BLOCK}", steps, heads_between,
               parts)
    return m_out


def _amx_block(sch: Schedule, block, outer, reduction, gemm: bool, key_blocks: str | None, steps: list,
               heads_between: bool = False, parts: bool = False) -> None:
    """The register-tile idiom (`_register_tile`) on AMX's tiles: ``block``'s 32 × 32 accumulator
    under ``outer``, its init, update (from the loop inside ``reduction``) and store as `x86_amx.zero_intrinsic`,
    `DOT` (`x86_amx.dot_intrinsic` of ``gemm`` and ``heads_between``) and `STORE`, tensorized by
    ``steps``. The block's buffer is (…, row, column) and its loops (…, rows, columns, reduction)
    blocks of 32 inside ``outer``."""
    acc = sch.cache_write(block, 0, "local")
    sch.transform_layout(block, ("write", 0),  # one 32 × 32 block per accumulator, whatever is around it
                         lambda *i, m, n: (*i, m // BLOCK, n // BLOCK, m % BLOCK, n % BLOCK),
                         assume_injective_transform=True)
    sch.reverse_compute_at(acc, outer, preserve_unit_loops=True)
    init = sch.decompose_reduction(block, reduction)
    dot = dot_intrinsic(heads_between, gemm, parts)
    steps.append(functools.partial(_tensorize, sch, sch.get_loops(block)[-3], dot, key_blocks))
    steps.append(functools.partial(_tensorize, sch, sch.get_loops(init)[-2], zero_intrinsic(gemm)))
    steps.append(functools.partial(_tensorize, sch, sch.get_loops(acc)[-2], STORE))


def _widen_keys(sch: Schedule, scores, t_out, lanes: int) -> None:
    """The qk_keys × d_k keys of a register tile converted to fp32 once, a vector at a time
    (vcvtph2ps), into a small tile the FMAs broadcast from: widening each key element where it is
    broadcast costs a conversion per FMA group."""
    tile = _copy_of(sch, scores, ("k_proj",))
    sch.compute_at(tile, t_out, preserve_unit_loops=True)
    sch.unsafe_set_dtype(tile, 0, "float32")
    _vectorize(sch, sch.get_loops(tile)[-1], None, lanes)


def _split_head_dim(sch: Schedule, lanes: int):
    """Before anything moves: scores = Σ_lane Σ_e_out q·k, each inner sum one vector lane (a key's
    lanes side by side, the operand of `x86_sums.lane_sum_intrinsic`)."""
    scores = sch.get_sblock("scores")
    *_, e = sch.get_loops(scores)
    _, e_lane = sch.split(e, [None, lanes])
    scores_rf = sch.rfactor(e_lane, 0)
    sch.transform_layout(scores_rf, ("write", 0), lambda lane, b, i, s, t: (b, i, s, t, lane))
    return scores_rf


def _scores_along_head_dim(sch: Schedule, scores_rf, steps: list, chunks: KnobValue | None = None) -> None:
    """Per key: lanes partial dot products over d_k (one vector FMA per step), then their sum in a
    tree (`x86_sums`, a step for ``steps``); with ``chunks``, the keys run in that many parallel chunks.

    The blocks' loops follow their iterators: scores (e_lane, b, i, s, t) and, inside one key,
    scores_rf (e_lane, b, i, s, t, e_out).
    """
    scores = sch.get_sblock("scores")
    e_lane, *_, t = sch.get_loops(scores)[-5:]
    sch.reorder(t, e_lane)
    if chunks is not None:
        chunk, t = sch.split(t, [chunks, None])
        sch.parallel(chunk)
    sch.compute_at(scores_rf, t, preserve_unit_loops=True)
    e_lane, *_, e_out = sch.get_loops(scores_rf)[-6:]
    sch.reorder(e_out, e_lane)
    sch.vectorize(e_lane)
    sch.decompose_reduction(scores_rf, e_out)
    *_, t, unit, _, _, lane = sch.get_loops(scores)  # (t, b, i, s units, lane)
    sch.decompose_reduction(scores, unit)
    lanes = _int(sch, sch.get(lane).extent)
    steps.append(functools.partial(_tensorize, sch, lane, lane_sum_intrinsic(lanes)))


def _weights_v(sch: Schedule, spec: AttentionSpec, lanes: int, rows_factor: KnobValue, vecs: KnobValue,
               pairs: bool, steps: list) -> None:
    """acc[pv_rows queries][pv_vecs·lanes of d_v] += probs[t, s] · v[t, c], over t, in registers;
    with ``pairs``, two keys per instruction (`x86_bf16.DOT_16x2_PAIR_FIRST` on `_pack_pairs`' panels)."""
    pv = sch.get_sblock("pv")
    s, c, t = sch.get_loops(pv)[-3:]
    rows = _int(sch, rows_factor)
    s_out, s_in = sch.split(s, [None, rows_factor])
    lanes_c = _lanes_for(spec.d_v, lanes)
    if pairs:  # whole tiles: a tile tail's predicate would sit inside the instruction
        vecs = _divisor_at_most(spec.d_v // lanes_c, _int(sch, vecs))
    c_out, c_mid, c_vec = sch.split(c, [None, vecs if lanes_c == lanes else 1, lanes_c])
    if pairs:
        t, t_pair = sch.split(t, [None, PAIR])
        sch.reorder(s_out, c_out, t, s_in, c_mid, c_vec, t_pair)
    else:
        sch.reorder(s_out, c_out, t, s_in, c_mid, c_vec)
    _register_tile(sch, pv, c_out, lambda b, i, st, s, c: (b, i, st, s // rows, s % rows, c),
                   (s_in, c_mid), c_vec, lanes_c, t, intrinsic=DOT_16x2_PAIR_FIRST if pairs else None,
                   key_blocks=f"b=v_b_o,s=v_s_o,t=v_t_o*{PAIR}", later=steps)


def _pv_rows(sch: Schedule, lanes: int, steps: list) -> None:
    """The task's pvᵀ (d_v, q_tile) turned into rows of d_v for the epilogue: 16 × 16 blocks of fp32
    transposed in registers (`x86_panels`, as the query panel's)."""
    rows = _copy_of(sch, sch.get_sblock("attn"), ("pv",))  # (after pv's store, inside the task)
    sch.transform_layout(rows, ("write", 0), lambda b, i, st, c, s: (b, i, st, s, c), assume_injective_transform=True)
    intrinsic = query_panel_intrinsic("float32", lanes, False, argument=True, heads_between=False)
    steps.append(functools.partial(_tensorize_queries, sch, sch.get(rows).name_hint, intrinsic, lanes, lanes, False))


def _pack_pairs(sch: Schedule, spec: AttentionSpec, pair_loop, amx: bool = False, head=None) -> tuple[str, str]:
    """The operands of P·V as `x86_bf16.DOT_16x2` reads them: P rounded to bf16 (as FlashAttention
    rounds it for 16-bit inputs; the row sums keep fp32), per pair of keys as probs computes it
    (``pair_loop``), and V once: in a pass before the tasks (a copy per query tile would be a pass
    over V per tile; the price is a workspace the size of V), or ``head``, a head task's loop
    (`head_tasks`), its head's rows in each task, kept in its cache for the head's tiles (no pass of
    its own, no barrier: 1.00–1.05× bf16 over the bench suite's shapes, Zen 5). Both with keys 2t,
    2t+1 side by side: P (t/2, q_tile, 2), V (t/2, d_v, 2). Their copies' names, for
    `_tensorize_pairs`."""
    pv = sch.get_sblock("pv")
    padded = _has_block(sch, "v_rows")  # (B, h_kv, n_keys, d_v)
    v_panel = _copy_of(sch, pv, ("v_rows", "v", "v_proj"))
    p_panel = _copy_of(sch, pv, ("probs",), [pv])  # the row sums keep fp32
    sch.reverse_compute_at(p_panel, pair_loop, preserve_unit_loops=True)
    sch.unsafe_set_dtype(p_panel, 0, "bfloat16")
    p_name = sch.get(p_panel).name_hint
    sch.transform_layout(p_panel, ("write", 0), lambda b, i, st, t, s: (b, i, st, t // PAIR, s, t % PAIR),
                         assume_injective_transform=True)
    if amx and spec.projections and not padded:  # v_proj (B, n_kv, h_kv·d_v)
        v_layout = lambda b, t, m: (b, t // STEP, m, t % STEP)  # noqa: E731
    elif amx and spec.layout == "BSHD" and not padded:
        v_layout = lambda b, t, h, c: (b, h, t // STEP, c, t % STEP)  # noqa: E731
    elif amx:
        v_layout = lambda b, h, t, c: (b, h, t // STEP, c, t % STEP)  # noqa: E731
    elif spec.projections and not padded:  # v_proj (B, n_kv, h_kv·d_v)
        v_layout = lambda b, t, m: (b, t // PAIR, m, t % PAIR)  # noqa: E731
    elif spec.layout == "BHSD" or padded:
        v_layout = lambda b, h, t, c: (b, h, t // PAIR, c, t % PAIR)  # noqa: E731
    else:
        v_layout = lambda b, t, h, c: (b, h, t // PAIR, c, t % PAIR)  # noqa: E731
    sch.transform_layout(v_panel, ("write", 0), v_layout, assume_injective_transform=True)
    if head is not None:
        sch.compute_at(v_panel, head, preserve_unit_loops=True)
    return p_name, sch.get(v_panel).name_hint


def _widened_once(sch: Schedule, reader: str, names: tuple[str, ...], width: int, lanes: int,
                  consumers: list | None = None, at=None) -> None:
    """A 16-bit operand of ``reader`` (K for QKᵀ, V for P·V, x for projections) widened to fp32 once,
    for ``consumers`` (default: every reader): the micro-kernel then loads plain fp32, not a
    conversion per vector of V in every query tile, nor K's register tile widened in every task
    (1.03–1.07× fp16 at 16-query tiles, (1, 8, 128, 64) and (8, 8, 256, 32) causal; within 1 % from
    64-query tiles). ``at`` a head task's loop (`head_tasks`), its head's rows in each task, else in
    a parallel pass before the tasks (a workspace twice the operand's size)."""
    copy = _copy_of(sch, sch.get_sblock(reader), names, consumers)
    sch.unsafe_set_dtype(copy, 0, "float32")
    if at is not None:
        sch.compute_at(copy, at, preserve_unit_loops=True)
    else:
        sch.parallel(sch.fuse(*sch.get_loops(copy)[:-1]))
    _vectorize(sch, sch.get_loops(copy)[-1], width, lanes)


def _widen_projection_inputs(sch: Schedule, spec: AttentionSpec, target: Target, lanes: int) -> None:
    """The 16-bit x of the projections that widen to fp32 FMAs (no pairs, no tiles: `weight_pairs`,
    `weight_tiles`), x_kv's and W_O's merged heads too, each widened once before the tasks
    (`_widened_once`): a register tile's row then broadcasts plain fp32, where it took a
    broadcast and a conversion per element, a row of the tile each (fp16 GPT-2 layers on Zen 3:
    0.85–0.98× fp32 before, 1.10–1.29× after, W's half bytes read). Padded rows are widened in their
    pass that pads them (`_pad_rows`)."""
    widened = [sch.get_sblock(name + "_acc") for name in PROJECTIONS if _widened_projection(spec, target, name)
               and not _padded_rows(spec, target, name)]
    for x, width in (("x", spec.d), ("x_kv", spec.d), ("attn", spec.d_v)):  # (W_O reads attn)
        readers = [blk for blk in widened if x in (r.source.name for r in sch.get(blk).reads)]
        if readers:
            _widened_once(sch, sch.get(readers[0]).name_hint, (x,), width, lanes, readers)


def _widened_projection(spec: AttentionSpec, target: Target, projection: str) -> bool:
    """Whether a projection (a `PROJECTIONS` block) of 16-bit inputs runs on fp32 FMAs."""
    return (spec.projections and spec.dtype != "float32" and not weight_pairs(spec, target, projection)
            and not weight_tiles(spec, target, projection))


def _in_blocks(sch: Schedule, name: str, lanes: int, own_pass: bool) -> None:
    """k_rows or v_rows, K or V with its keys in whole blocks: with ``own_pass`` (an intrinsic reads
    its rows: V's pair panels, AMX's K, a clamped row being no block of rows), one parallel pass
    before the tasks, else inlined into its reader."""
    if own_pass:
        _before_tasks(sch, (name,), lanes)
    else:
        sch.compute_inline(sch.get_sblock(name))


def _before_tasks(sch: Schedule, names: tuple[str, ...], lanes: int) -> None:
    """Stages over every row of K and V (the same rows), computed in one parallel pass before the
    tasks: their row loops merged (a pass each is a start of the thread pool, or a barrier, each)."""
    rows = []
    for name in names:
        *loops, c = sch.get_loops(sch.get_sblock(name))
        rows.append(sch.fuse(*loops))
        _vectorize(sch, c, int(sch.get(c).extent), lanes)
    sch.parallel(sch.merge(*rows) if len(rows) > 1 else rows[0])


def _pack_query_parts(sch: Schedule, task, q_tile: int, lanes: int, steps: list) -> None:
    """fp16 queries on AMX's tiles (`fp16_parts`): each task computes its rows' bf16 parts, q_hi and
    q_lo, and turns each into QKᵀ's pair panel (d_k/2, q_tile, 2) as `_pack_queries` does a bf16 one."""
    scores = sch.get_sblock("scores")
    for name in ("q_hi", "q_lo"):
        panel = _copy_of(sch, scores, (name,))
        sch.compute_at(panel, task, preserve_unit_loops=True)
        rows = sch.get_sblock(name)
        sch.compute_at(rows, task, preserve_unit_loops=True)
        _vectorize(sch, sch.get_loops(rows)[-1], None, lanes)
        sch.transform_layout(panel, ("write", 0),
                             lambda b, i, s, e: (b, i, s // q_tile, e // PAIR, s % q_tile, e % PAIR),
                             assume_injective_transform=True)
        intrinsic = query_panel_intrinsic("bfloat16", lanes, True, argument=False, heads_between=False)
        steps.append(functools.partial(_tensorize_queries, sch, sch.get(panel).name_hint, intrinsic, lanes,
                                       lanes * PAIR, False))


def _pack_parts(sch: Schedule, pair_loop, q_tile: int) -> tuple[list[str], list[str]]:
    """fp16's P·V on AMX's tiles (`fp16_parts`): P's bf16 parts, p_hi and p_lo, packed into pairs of
    keys as probs computes them (`_pack_pairs`' P panel, twice), and Vᵀ panels of V's parts, once
    before the tasks. Their names, for `_tensorize_parts`."""
    pv = sch.get_sblock("pv")
    p_names, v_names = [], []
    for p_name, v_name in (("p_hi", "v_hi"), ("p_lo", "v_lo")):
        p_panel = sch.get_sblock(p_name)
        sch.reverse_compute_at(p_panel, pair_loop, preserve_unit_loops=True)
        sch.transform_layout(p_panel, ("write", 0),
                             lambda b, i, t, s: (b, i, s // q_tile, t // PAIR, s % q_tile, t % PAIR),
                             assume_injective_transform=True)
        v_panel = _copy_of(sch, pv, (v_name,))
        sch.transform_layout(v_panel, ("write", 0), lambda b, h, t, c: (b, h, t // STEP, c, t % STEP),
                             assume_injective_transform=True)
        p_names.append(p_name)
        v_names.append(sch.get(v_panel).name_hint)
    return p_names, v_names


def _tensorize_parts(sch: Schedule, panels: tuple[list[str], list[str]], q_tile: int) -> None:
    """`_pack_parts`' panels as tensor intrinsics (a deferred step): P's parts as `x86_bf16`'s pairs
    (rounded, and the residual), V's as `x86_amx.transposed_values_intrinsic`, in one pass."""
    p_names, v_names = panels
    for part, p_name in enumerate(p_names):
        _in_pairs(sch, p_name, -2, q_tile, "float32", part=part)
        _pairs_of_keys(sch, p_name, q_tile, key_major=True)
    for v_name in v_names:
        _transposed_values(sch, v_name, False)
    sch.parallel(sch.merge(*(sch.fuse(*sch.get_loops(sch.get_sblock(v + "_o"))) for v in v_names)))


def _tensorize_pairs(sch: Schedule, spec: AttentionSpec, panels: tuple[str, str], q_tile: int,
                     amx: bool = False, per_head: bool = False) -> None:
    """`_pack_pairs`' copies as `x86_bf16.pairs_intrinsic`, one block per pair of rows, and with
    ``amx`` V's as `x86_amx.transposed_values_intrinsic` (a deferred step, `_register_tile`'s
    ``later``); V's a parallel pass of its own unless ``per_head`` (in the head tasks)."""
    p_name, v_name = panels
    # V's loops (b, t, h, c), else (…, t, c) (v_rows is BHSD)
    bshd = not spec.projections and spec.layout == "BSHD" and not _has_block(sch, "v_rows")
    _in_pairs(sch, p_name, -2, q_tile, "float32")
    if amx:
        _transposed_values(sch, v_name, bshd)
    else:
        _in_pairs(sch, v_name, -3 if bshd else -2, spec.d_v, "bfloat16", bshd)  # (a layer's v_proj: a head at a time)
    if not per_head:  # V's panel: a pass before the tasks
        sch.parallel(sch.fuse(*sch.get_loops(sch.get_sblock(v_name + "_o"))))
    _pairs_of_keys(sch, p_name, q_tile, key_major=False)


def _pairs_of_keys(sch: Schedule, p_name: str, q_tile: int, key_major: bool) -> None:
    """P's tensorized panel ``p_name`` as a key stage: it reads the weights of the keys its queries
    see, in pairs (V's panels read the input, every key). Its iterators (b, i, query tile, pair of
    keys), or (b, i, pair, query tile) for a ``key_major`` stage (`te_attention`'s P parts)."""
    p_panel = sch.get_sblock(p_name + "_o")
    b, _, x, y = (iv.var.name for iv in sch.get(p_panel).iter_vars[:4])
    tile, pair = (y, x) if key_major else (x, y)
    sch.annotate(p_panel, KEY_STAGE, 1)
    sch.annotate(p_panel, KEY_BLOCKS, f"b={b},s={tile}*{q_tile},t={pair}*{PAIR}")


def _transposed_values(sch: Schedule, v_name: str, heads_between: bool) -> None:
    """V's copy ``v_name`` as `x86_amx.transposed_values_intrinsic`, blocks of 32 keys × 16 of d_v
    (its loops …, t, [head,] c)."""
    loops = sch.get_loops(sch.get_sblock(v_name))
    t, heads, c = (loops[-3], loops[-2:-1], loops[-1]) if heads_between else (loops[-2], [], loops[-1])
    t_out, t_in = sch.split(t, [None, STEP])
    c_out, c_in = sch.split(c, [None, LANES])
    sch.reorder(t_out, *heads, c_out, t_in, c_in)
    _tensorize(sch, t_in, transposed_values_intrinsic(heads_between))


def _gemm(sch: Schedule, spec: AttentionSpec, target: Target, name: str, lanes: int,
          k: Mapping[str, KnobValue], steps: list) -> None:
    """A projection of the layer: `gemm` (`amx_gemm` on AMX's tiles, `weight_tiles`) on its block, and
    its cast to the storage dtype, if any: in `gemm`'s register-tile store (a one-token bf16 layer
    1.2× faster than with a pass of its own), after AMX's tile stores. On the bf16 dot products
    (`weight_pairs`) and AMX's tiles W is packed into pairs first, once, before the tasks (fp16: its
    two parts' panels); the tensorize steps of the register tile and of that copy go to ``steps``."""
    acc_name = name + "_acc" if _has_block(sch, name + "_acc") else name
    blk = sch.get_sblock(acc_name)
    tiles = weight_tiles(spec, target, name)
    pairs = tiles or weight_pairs(spec, target, name)
    parts = name in parts_of(spec, target)  # (x's parts and W's are stages of their own)
    padded = _padded_rows(spec, target, name)
    if padded:
        _pad_rows(sch, blk, lanes, cast=acc_name != name, block=BLOCK if tiles else LANES,
                  widen=_widened_projection(spec, target, name))
    if pairs:  # AMX: blocks of 32 columns, (m/32, c/2, 32, 2), each B operand's rows 128 bytes apart
        at = (lambda c, m: (m // BLOCK, c // PAIR, m % BLOCK, c % PAIR)) if tiles else (  # noqa: E731
            lambda c, m: (c // PAIR, m, c % PAIR))
        w = PROJECTIONS[name]
        panels = [sch.get_sblock(w + "_hi"), sch.get_sblock(w + "_lo")] if parts else [_copy_of(sch, blk, (w,))]
        for panel in panels:
            sch.transform_layout(panel, ("write", 0), at, assume_injective_transform=True)
    elif weight_panels(spec, target, name):
        _pack_panels(sch, blk, PROJECTIONS[name], _int(sch, k["gemm_vecs"]) * lanes, lanes)
    # the cast to the storage dtype as each register tile is stored, but after AMX's tile stores (of
    # fp32 rows) and padded rows' tiles (which run past the rows it stores)
    fused = acc_name != name and not tiles and not padded
    left = []
    if tiles:
        amx_gemm(sch, blk, k, steps, parts)
    else:
        left = gemm(sch, blk, lanes, k, (sch.get_sblock(name),) if fused else (), pairs=steps if pairs else None)
    if pairs:
        names = [sch.get(panel).name_hint for panel in panels]
        steps.append(functools.partial(_tensorize_weight_pairs, sch, names, spec.dtype if parts else "bfloat16"))
    if acc_name != name and (not fused or left):  # the cast in a pass of its own, per output element
        cast = sch.get_sblock(name)
        loops = sch.get_loops(cast)
        sch.parallel(sch.fuse(*loops[:2]))
        _vectorize(sch, loops[-1], int(sch.get(loops[-1]).extent), lanes)


def _pad_rows(sch: Schedule, blk, lanes: int, cast: bool, block: int, widen: bool = False) -> None:
    """A projection's rows computed in whole blocks (``pad_einsum``: x copied with zero rows past its
    end, in a parallel pass, widened to fp32 with ``widen``, `_widen_projection_inputs`; the
    accumulator's extra rows are never stored): symbolic ones in blocks of `LANES`, and on AMX's
    tiles any in blocks of 32, so that `gemm`'s tiles divide them: no tail predicate in the
    micro-kernel (where the bf16 instructions cannot take one at all)."""
    sch.pad_einsum(blk, [1, block, 1, 1])
    copies = [b for b in sch.get_producers(blk) if sch.get(b).name_hint.endswith("_pad")]  # x's (fp16: its parts')
    for copy in copies if widen else ():
        sch.unsafe_set_dtype(copy, 0, "float32")
    for stage in sch.get_producers(copies[0]):  # merged (W_O's x): read where it is padded
        if sch.get(stage).name_hint == "merged":
            sch.compute_inline(stage)
    back = sch.get_consumers(blk)[0]  # the copy of the real rows: into the cast to 16 bits, if any
    if cast:
        sch.compute_inline(back)
    else:  # (an fp32 projection: its readers look for it by name)
        copies.append(back)
    for copy in copies:
        *rows, c = sch.get_loops(copy)
        sch.parallel(sch.fuse(*rows))
        _vectorize(sch, c, None, lanes)


def weight_pairs(spec: AttentionSpec, target: Target, projection: str) -> bool:
    """Whether a projection (a `PROJECTIONS` block) runs on `x86_bf16.DOT_16x2_PAIR_FIRST`: bf16 on a
    CPU with AVX512-BF16, at least `MIN_PAIR_ROWS` rows if they are static (symbolic ones run in
    whole blocks, `_pad_rows`), whole pairs of the reduction and columns in whole vectors (`gemm`
    then takes whole tiles: a tail's predicate cannot sit inside the instruction). Elsewhere it
    widens to fp32 FMAs."""
    depth, columns = spec.input_shapes()[PROJECTIONS[projection]]
    rows = _rows(spec, projection)
    # W_O's pairs of merged columns must not straddle two heads: its x pairs are read from attn
    whole_pairs = depth % PAIR == 0 and (projection != "out" or spec.d_v % PAIR == 0)
    return (spec.dtype == "bfloat16" and has_bf16_dot(target) and not (isinstance(rows, int) and rows < MIN_PAIR_ROWS)
            and whole_pairs and columns % LANES == 0)


def weight_panels(spec: AttentionSpec, target: Target, projection: str) -> bool:
    """Whether a projection on FMAs reads W from a copy in panels of its register tile's columns
    (`_pack_panels`): with AVX2, at least `MIN_PANEL_ROWS` rows if they are static. Read in place,
    each step of the reduction loads the tile's 3 vectors from a row of W d_model elements after
    the last: a task's W panel streams from L2 in pieces of 96 bytes (fp32), 3 KB apart. AVX-512's
    tiles (4 vectors, 256 bytes a row) are not measured with it."""
    rows = _rows(spec, projection)
    return (vector_lanes(target) < LANES
            and not (isinstance(rows, int) and rows < MIN_PANEL_ROWS))


def _pack_panels(sch: Schedule, blk, weight: str, width: int, lanes: int) -> None:
    """W (c, m) copied as (m / ``width``, c, ``width``): a register tile's columns are one run of
    memory along the reduction. One parallel pass over W before the tasks (a workspace its size)."""
    if int(sch.get(sch.get_loops(blk)[-2]).extent) % width:  # columns: a tail tile would read past a panel
        return
    panel = _copy_of(sch, blk, (weight,))
    sch.transform_layout(panel, ("write", 0), lambda c, m: (m // width, c, m % width),
                         assume_injective_transform=True)
    c, m = sch.get_loops(panel)
    m_out, m_in = sch.split(m, [None, width])
    sch.reorder(m_out, c, m_in)
    sch.parallel(sch.fuse(m_out, c))
    _vectorize(sch, m_in, width, lanes)
    sch.annotate(panel, KEEP_16BIT, 1)  # (bf16: TVM would store its own bf16 buffer widened to fp32)


def _rows(spec: AttentionSpec, projection: str):
    """A projection's rows, B·n (symbolic: n, or n_kv for K's and V's)."""
    rows = spec.n_kv if projection in ("k_proj", "v_proj") else spec.n_q
    return rows * spec.batch if isinstance(spec.batch, int) and isinstance(rows, int) else rows


def _padded_rows(spec: AttentionSpec, target: Target, projection: str) -> bool:
    """Whether a projection's rows are padded to whole blocks (`_pad_rows`): symbolic ones, and on
    AMX's tiles static ones that are no multiple of 32."""
    rows = spec.n_kv if projection in ("k_proj", "v_proj") else spec.n_q
    return not isinstance(rows, int) or (weight_tiles(spec, target, projection) and rows % BLOCK > 0)


def weight_tiles(spec: AttentionSpec, target: Target, projection: str) -> bool:
    """Whether a projection runs on AMX's tiles (`amx_gemm`): bf16 (fp16 as two bf16 parts, `parts_of`)
    on a CPU with AMX-BF16 (and AVX512-BF16), at least `MIN_PAIR_ROWS` rows if they are static (any
    rows run in whole blocks of 32, `_pad_rows`), the reduction and the columns in whole blocks of
    32 (W_O's blocks of merged columns within one head: d_v a multiple of 32)."""
    depth, columns = spec.input_shapes()[PROJECTIONS[projection]]
    rows = _rows(spec, projection)
    return (spec.dtype in ("bfloat16", "float16") and has_amx(target) and has_bf16_dot(target)
            and not (isinstance(rows, int) and rows < MIN_PAIR_ROWS) and depth % STEP == 0 and columns % BLOCK == 0
            and (projection != "out" or spec.d_v % STEP == 0))


def amx_gemm(sch: Schedule, blk, k: Mapping[str, KnobValue], steps: list, parts: bool = False) -> None:
    """y[…, s, m] = Σ_c x[…, s, c]·w[c, m] on AMX's tiles (loops: batch…, s, m, c; rows and columns
    in whole blocks of 32, w a (m/32, c/2, 32, 2) pair panel): parallel over (batch, row block,
    column block) tasks of ``gemm_rows × gemm_block_rows`` rows (one block of 32 where they are
    symbolic) × ``gemm_vecs × 16 × gemm_block_cols`` columns, the x and W panels a task streams, as
    `gemm`'s; per 32 × 32 accumulator block, 32 steps of c per product (`x86_amx.DOT`, x's rows read
    in place; with ``parts``, x's and w's bf16 parts, `parts_of`)."""
    *batch, s, m, c = sch.get_loops(blk)
    extent = sch.get(s).extent
    row_blocks = extent.value // BLOCK if isinstance(extent, tvm.tirx.IntImm) else 1
    col_blocks = int(sch.get(m).extent) // BLOCK
    rows = _divisor_at_most(row_blocks, max(1, _int(sch, k["gemm_rows"]) * _int(sch, k["gemm_block_rows"]) // BLOCK))
    cols = _divisor_at_most(col_blocks, max(1, _int(sch, k["gemm_vecs"]) * LANES * _int(sch, k["gemm_block_cols"])
                                            // BLOCK))
    r_task, r_out, r_in = sch.split(s, [None, rows, BLOCK])
    m_task, m_out, m_in = sch.split(m, [None, cols, BLOCK])
    c_out, c_in = sch.split(c, [None, STEP])
    sch.reorder(*batch, r_task, m_task, r_out, m_out, c_out, r_in, m_in, c_in)
    task = sch.fuse(*batch, r_task, m_task)
    sch.parallel(task)
    configure_tiles(sch, task)
    _amx_block(sch, blk, m_out, c_out, True, None, steps, parts=parts)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def _tensorize_weight_pairs(sch: Schedule, panels: list[str], source: str) -> None:
    """W's pair panels (d/2, width, 2), packed 16 columns at a time in one parallel pass over pairs
    of rows: bf16 W's, or the two bf16 parts of an fp16 W (``source``)."""
    rows = [_in_pairs(sch, panel, -2, LANES, source, part=part if len(panels) > 1 else None)
            for part, panel in enumerate(panels)]
    sch.parallel(sch.merge(*rows) if len(rows) > 1 else rows[0])


def _in_pairs(sch: Schedule, name: str, row_at: int, width: int, source: str, heads_between: bool = False,
              part: int | None = None):
    """The copy ``name`` as `x86_bf16.pairs_intrinsic` (of P's ``part``, if given): its row loop
    (``row_at``) split into pairs, the pair innermost, ``width`` columns per block. Returns the loop
    over pairs of rows."""
    loops = sch.get_loops(sch.get_sblock(name))
    rows, pair = sch.split(loops[row_at], [None, PAIR])
    sch.reorder(rows, *loops[row_at + 1:], pair)  # (rows/2, [head,] column, pair)
    _tensorize(sch, sch.split(loops[-1], [None, width])[1], pairs_intrinsic(source, width, heads_between, part))
    return rows


def gemm(sch: Schedule, blk, lanes: int, k: Mapping[str, KnobValue], epilogue: tuple = (),
         padded_columns: bool = False, pairs: list | None = None) -> list:
    """y[…, s, m] = Σ_c x[…, s, c]·w[…, c, m] (loops: batch…, s, m, c): parallel over (batch, row
    tile, column tile), register-tiled; the ``epilogue`` blocks (bias, activation, residual) are
    computed on each register tile as it is stored; those that cannot be are returned. With
    ``padded_columns`` (w is zero-padded to whole tiles) the column tail takes whole vectors too.
    Given ``pairs`` (bf16, w read from a (c/2, m, 2) pair panel, a static row count, the width in whole
    vectors), two steps of c per `x86_bf16.DOT_16x2_PAIR_FIRST`, every tile whole (the factors are
    the largest divisors up to the knobs), its tensorize step appended to ``pairs`` (`_register_tile`'s
    ``later``)."""
    *batch, s, m, c = sch.get_loops(blk)
    width = int(sch.get(m).extent)
    # Row tiles stay inside one sequence: a tile crossing a batch boundary would make the
    # accumulator's region non-rectangular, and its write-back would cover rows it never computed.
    extent = sch.get(s).extent
    n_rows = int(extent) if isinstance(extent, tvm.tirx.IntImm) else None
    if n_rows is None and tvm.sym.Analyzer().can_prove_equal(tvm.tirx.floormod(extent, LANES), 0):
        n_rows = LANES  # rows in whole blocks (`_pad_rows`): tiles that divide a block, no tail
    at_most = (lambda knob, n: _divisor_at_most(n, _int(sch, knob))) if pairs is not None else (  # noqa: E731
        lambda knob, n: _at_most(sch, knob, n))
    rows_factor = at_most(k["gemm_rows"], n_rows)  # one token (decode): a one-row register tile
    row_tiles = None if n_rows is None else -(-n_rows // _int(sch, rows_factor))
    block_factor = at_most(k["gemm_block_rows"], row_tiles)
    r_task, r_out, r_in = sch.split(s, [None, block_factor, rows_factor])
    lanes_m = lanes if padded_columns else _lanes_for(width, lanes)
    vecs = k["gemm_vecs"] if lanes_m == lanes else 1
    if pairs is not None:
        vecs = _divisor_at_most(width // lanes_m, _int(sch, vecs))
    col_tiles = -(-width // (_int(sch, vecs) * lanes_m))
    # a divisor of the column tiles: a partial last block would guard every register tile of the task
    m_task, m_out, m_mid, m_vec = sch.split(m, [None, _divisor_at_most(col_tiles, _int(sch, k["gemm_block_cols"])),
                                                vecs, lanes_m])
    # a task owns a block of rows × columns, so its panels of x and w stay in L2 across register tiles
    if pairs is not None:
        c, c_pair = sch.split(c, [None, PAIR])
        sch.reorder(*batch, r_task, m_task, r_out, m_out, c, r_in, m_mid, m_vec, c_pair)
    else:
        sch.reorder(*batch, r_task, m_task, r_out, m_out, c, r_in, m_mid, m_vec)
    sch.parallel(sch.fuse(*batch, r_task, m_task))
    rows = _int(sch, rows_factor)
    # whole column tiles in the accumulator: with padded columns the last tile computes past the width
    w = _int(sch, vecs) * lanes_m
    return _register_tile(sch, blk, m_out, lambda *i: (*i[:-2], i[-2] // rows, i[-2] % rows, i[-1] // w, i[-1] % w),
                          (r_in, m_mid), m_vec, lanes_m, c, epilogue,
                          intrinsic=None if pairs is None else DOT_16x2_PAIR_FIRST, later=pairs)


def gemv(sch: Schedule, blk, lanes: int, k: Mapping[str, KnobValue], epilogue: tuple = (),
         padded_columns: bool = False) -> list:
    """y[…, m] = Σ_c x[…, c]·w[…, c, m] (loops: batch…, m, c; one row: a decode step's projection):
    parallel over (batch, column tile), each tile ``gemm_vecs`` vectors of accumulators streaming its
    panel of w; the epilogue as in `gemm`."""
    *batch, m, c = sch.get_loops(blk)
    width = int(sch.get(m).extent)
    lanes_m = lanes if padded_columns else _lanes_for(width, lanes)
    vecs = k["gemm_vecs"] if lanes_m == lanes else 1
    m_task, m_mid, m_vec = sch.split(m, [None, vecs, lanes_m])
    sch.reorder(*batch, m_task, c, m_mid, m_vec)
    task = sch.fuse(*batch, m_task)
    sch.parallel(task)
    w = _int(sch, vecs) * lanes_m  # whole column tiles in the accumulator (see `gemm`)
    return _register_tile(sch, blk, task, lambda *i: (*i[:-1], i[-1] // w, i[-1] % w), (m_mid,), m_vec, lanes_m,
                          c, epilogue)


def _register_tile(sch: Schedule, block, outer, layout, unrolled: tuple, vector, lanes: int, reduction,
                   epilogue: tuple = (), intrinsic: str | None = None, key_blocks: str | None = None,
                   later: list | None = None) -> list:
    """The register-tile idiom: ``block`` accumulates its tile under ``outer`` in a local buffer
    (``cache_write``) that LLVM keeps in registers once its loops are unrolled and vectorised.
    ``layout`` gives that buffer a fixed size even where a tail predicate cuts the tile. The init
    is split off last: vectorising after ``decompose_reduction`` fails. The ``epilogue`` blocks
    (elementwise consumers of ``block``, in order) are inlined into the store of the tile, up to the
    first that cannot be (or while the tile has other consumers): that one and the rest are returned.
    With ``intrinsic``, the loop nest from ``vector`` in is that tensor intrinsic instead of a vector:
    tensorized now, or, given ``later``, a step appended to it for the caller to run last (a
    tensorized stage can leave the root scope no "stage pipeline" for other stages' primitives)."""
    acc = sch.cache_write(block, 0, "local")
    left = list(epilogue)
    while left and _only_consumer(sch, acc, left[0]):
        try:
            sch.reverse_compute_inline(left[0])
        except RuntimeError:  # TVM refused (a ScheduleError or internal error): e.g. a consumer reading other elements
            break
        left.pop(0)
    sch.transform_layout(block, ("write", 0), layout, assume_injective_transform=True)
    sch.reverse_compute_at(acc, outer, preserve_unit_loops=True)
    for loop in unrolled:
        sch.unroll(loop)
    if intrinsic is None:
        _vectorize(sch, vector, lanes, lanes)
    _vectorize(sch, sch.get_loops(acc)[-1], None, lanes)
    # the store unrolled like the update: a loop over the tile would leave it a stack array that LLVM
    # zeroes before and spills after every tile (32 stores per 16 accumulators)
    acc_loops = sch.get_loops(acc)
    at = next(i for i, loop in enumerate(acc_loops) if sch.get(loop).same_as(sch.get(outer)))
    for loop in acc_loops[at + 1:-1]:
        sch.unroll(loop)
    init = sch.decompose_reduction(block, reduction)
    if intrinsic is not None:  # ``vector`` and the loops inside it are the intrinsic's
        _vectorize(sch, sch.get_loops(init)[-1], lanes, lanes)
        step = functools.partial(_tensorize, sch, vector, intrinsic, key_blocks)
        step() if later is None else later.append(step)
    return left


def _copy_of(sch: Schedule, block, names: tuple[str, ...], consumers: list | None = None):
    """`cache_read` of ``block``'s operand named one of ``names`` (a TE input or the stage it was
    inlined from), for ``consumers`` (default: every reader)."""
    reads = [r.source.name for r in sch.get(block).reads]
    index = next(i for i, name in enumerate(reads) if name in names)
    if consumers is None:
        return sch.cache_read(block, index, "global")
    return sch.cache_read(block, index, "global", consumer_blocks=consumers)


def _tensorize(sch: Schedule, loop, intrinsic: str, key_blocks: str | None = None) -> None:
    """Tensorize the loop nest from ``loop`` in with ``intrinsic``; ``key_blocks`` (`passes.KEY_BLOCKS`)
    says which of the new block's iterators are its queries and keys, for `skip_masked_key_tiles`."""
    outer = sch.blockize(loop)
    sch.tensorize(outer, intrinsic)
    if key_blocks is not None:
        sch.annotate(outer, KEY_STAGE, 1)
        sch.annotate(outer, KEY_BLOCKS, key_blocks)


def _only_consumer(sch: Schedule, producer, block) -> bool:
    consumers = sch.get_consumers(producer)
    return len(consumers) == 1 and sch.get(consumers[0]).same_as(sch.get(block))


def _vectorize(sch: Schedule, loop, extent: int | None, lanes: int) -> None:
    """Vectorise ``loop`` by the widest vector (at most ``lanes``) dividing its extent; split off if longer."""
    if extent is None:
        extent_expr = sch.get(loop).extent
        if not hasattr(extent_expr, "value"):  # symbolic: whole vectors, and a tail predicate
            sch.vectorize(sch.split(loop, [None, lanes])[1])  # (the tail peeled: passes.peel_key_tails)
            return
        extent = int(extent_expr.value)
    width = _lanes_for(extent, lanes)
    if width == 1:
        return
    sch.vectorize(loop if extent == width else sch.split(loop, [None, width])[1])


def _lanes_for(extent: int, lanes: int) -> int:
    """The widest power-of-two vector, at most ``lanes``, that divides ``extent``."""
    while lanes > 1 and extent % lanes:
        lanes //= 2
    return lanes


def _at_most(sch: Schedule, factor: KnobValue, extent) -> KnobValue:
    """A split factor no larger than a static extent: a tile of one real row and padding rows makes
    TVM's buffer compaction leak loop variables into allocation sizes."""
    return extent if isinstance(extent, int) and extent < _int(sch, factor) else factor


def _int(sch: Schedule, value: KnobValue) -> int:
    """A knob's value now: itself, or the current decision of a sampled variable. Only buffer layouts
    read it, and a layout never changes what is computed, so a later resampling stays correct."""
    return value if isinstance(value, int) else int(sch.get(value))


def _loops_by_axis(sch: Schedule, block) -> dict:
    """An untransformed block's loops by the TE axis they run over (b, i, s, c, …)."""
    return {iv.var.name.removeprefix("v_"): loop for iv, loop in zip(sch.get(block).iter_vars, sch.get_loops(block))}


def _has_block(sch: Schedule, name: str) -> bool:
    try:
        sch.get_sblock(name)
        return True
    except Exception:  # s_tir raises ScheduleError for an unknown name
        return False
