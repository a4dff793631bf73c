"""`CpuPlan`: every decision the CPU attention schedule makes for a (spec, target, knobs), made once.

The rules of `schedules.cpu` (`CpuAttention`'s defaults, workload, apply and description) read a
plan and decide nothing themselves. A decision is made here, in order, from the ones before it:

    instruction set      `Isa` of the target: lanes, registers, bf16 dot product, tile registers
    fp16_parts           an fp16 core on bf16 tile products as two bf16 parts per operand
    padding              the block symbolic (or, on the tiles, ragged) lengths run in
    projections          each projection's path: tiles, bf16 pairs, widened 16-bit, fp32 FMAs;
                         its rows padded, its W copied into register-tile panels; (after the
                         knobs) its dot products' register tile over ragged static rows
    head_tasks           parallel tasks of whole (batch, KV head) pairs
    defaults             the knobs' defaults for this spec and CPU
    key_chunks           split-K decode: keys in parallel chunks (1: the query-tile kernel)
    q_tile, qk_keys      the query tile and keys per QKᵀ register tile the knobs give, made whole
    along_head_dim       decode's dot products along d_k (no vector of queries)
    on_tiles, qk/pv_pairs  QKᵀ and P·V on tile registers, or on the bf16 dot products, or on fp32 FMAs
    half_keys            fp16 P·V on the CPU's fp16 FMAs, summed in fp16 over blocks of this many keys
    widen_k, widen_v     16-bit K and V widened to fp32 once (in head tasks where `per_head`)
    v_pairs              V's pair panel packed in its head's task

Before a plan, `padded_widths` tells a caller that can pad q, k and v (the ONNX import, torch) the head
widths that would put its spec on the tiles, or on the bf16 dot products where there are no tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import tvm
from tvm.target import Target

from tvmattn.compiler.isa.panels import PAIR
from tvmattn.compiler.isa.record import Isa
from tvmattn.compiler.spec import AttentionSpec, Dim
from tvmattn.compiler.target import cores_of, isa_of
from tvmattn.schedules.knobs import Knob, KnobValue, resolve
from tvmattn.schedules.micro_kernels import GEMM_KNOBS, gemm_defaults, whole_row_tile
from tvmattn.schedules.primitives import at_most, divisor_at_most, lanes_for

KNOBS = (
    Knob("q_tile", (8, 16, 24, 32, 48, 64), 16, "queries per parallel task (a multiple of the vector width)"),
    Knob("qk_keys", (1, 2, 3, 4, 6, 8), 4, "keys per QKᵀ register tile"),
    Knob("pv_rows", (1, 2, 3, 4, 6, 8), 4, "queries per P·V register tile (at most: a divisor of q_tile)"),
    Knob("pv_vecs", (1, 2, 3, 4, 8, 16), 2, "vectors of d_v per P·V register tile"),
    Knob("key_chunks", (2, 4, 8, 16, 32), 8,
         "key chunks run in parallel when (batch, head) pairs are few (at most: a divisor of n_kv)"),
) + GEMM_KNOBS

# Rows (B·n) from which a projection's W pair panel pays for itself: the packing pass reads and writes
# W once more, which a one-token step would spend in a GEMV reading W once.
MIN_PAIR_ROWS = 16
# Rows (B·n) from which a projection's W copied into register-tile panels pays for the copy.
MIN_PANEL_ROWS = 128
# Keys a query sees (about half of them where causal) from which an fp16 core's bf16 parts on the
# tiles beat its widened fp32 FMAs: the parts' passes cost a task what three tile products save it.
PARTS_MIN_KEYS = 128
# Keys per block of fp16 P·V's fp16 sums, each block's sum then added in fp32 (`te_attention._core`):
# 32, or 16 where a mask bounds a tile's keys (every key stage then skips hidden keys in blocks of it)
HALF_KEYS, HALF_KEYS_MASKED = 32, 16
# fp32 lanes the query-tile defaults were measured at (AVX-512: 64 queries, 4 vectors); narrower vectors
# take the record's `Isa.query_vectors` a row instead
FULL_LANES = 16
PROJECTIONS = {"q_proj": "w_q", "k_proj": "w_k", "v_proj": "w_v", "out": "w_o"}  # the layer's GEMMs: block → W
PATHS = ("tiles", "pairs", "widened", "fp32")  # a projection's: tiles, bf16 dot products, 16-bit on FMAs, fp32


@dataclass(frozen=True)
class Projection:
    """How a layer's projection runs."""

    name: str  # its block: q_proj, k_proj, v_proj, out
    weight: str  # its W: w_q, w_k, w_v, w_o
    path: str  # one of `PATHS`
    parts: bool  # fp16 on the tiles as two bf16 parts (x's and W's)
    padded: bool  # rows computed in whole blocks (symbolic ones; ragged ones on the tiles)
    panels: bool  # W read from a copy in panels of the register tile's columns (fp32 FMAs)
    # (rows, vectors) of the dot products' register tile where the knobs' rows do not divide static rows
    row_tile: tuple[int, int] | None = None


@dataclass(frozen=True)
class CpuPlan:
    """The decisions of one CPU attention kernel (see the module docstring)."""

    spec: AttentionSpec
    isa: Isa
    cores: int
    knobs: Mapping[str, int]  # every knob's value (defaults, overridden)
    defaults: Mapping[str, int]  # the defaults this spec and CPU take, beyond each knob's own
    fp16_parts: bool
    padding: int
    parts: frozenset[str]  # the products whose fp16 operands run as bf16 parts (`te_attention`'s)
    projections: tuple[Projection, ...]
    head_tasks: bool
    key_chunks: int  # > 1: the split-K decode kernel
    q_tile: int
    q_tile_is_knob: bool  # the query axis is split by the knob itself (a sampled variable when tuning)
    q_tile_read: bool  # another choice of the q_tile knob builds another kernel (`describe` names it)
    qk_keys: int
    qk_keys_is_knob: bool
    pv_rows: int
    along_head_dim: bool
    on_tiles: bool  # QKᵀ and P·V on tile registers
    qk_pairs: bool
    pv_pairs: bool
    half_keys: int  # > 0: fp16 P·V on fp16 FMAs, in fp16 over blocks of this many keys (`te_attention._core`)
    widen_k: bool
    widen_v: bool
    v_pairs: bool
    per_head: bool  # tasks of whole (batch, KV head) pairs, each widening or packing its K and V once

    @property
    def lanes(self) -> int:
        return self.isa.lanes

    @property
    def split_k(self) -> bool:
        return self.key_chunks > 1

    @property
    def tiles_used(self) -> bool:
        """Whether any product of the kernel runs on tile registers."""
        return (self.on_tiles and not self.split_k) or any(p.path == "tiles" for p in self.projections)

    def projection(self, name: str) -> Projection:
        return next(p for p in self.projections if p.name == name)


def whole(length: Dim, block: int) -> Dim:
    """A length as the kernel's stages run it: in whole blocks where padded (a symbolic one: any
    multiple of the block stands for it)."""
    if block == 1:
        return length
    return block if not isinstance(length, int) else -(-length // block) * block


_PLANS: dict[tuple, CpuPlan] = {}
_MOST_PLANS = 4096  # (a model import plans a few per attention shape)


def plan_of(spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue] | None = None) -> CpuPlan:
    """The plan of ``spec`` on ``target`` with ``knobs`` (concrete values; None: the defaults), made
    once per (spec, target, knobs)."""
    key = (spec, str(target), tuple(sorted((knobs or {}).items())))
    if key not in _PLANS:
        if len(_PLANS) >= _MOST_PLANS:
            _PLANS.clear()
        _PLANS[key] = _plan(spec, target, knobs)
    return _PLANS[key]


def padded_widths(spec: AttentionSpec, target: Target) -> AttentionSpec | None:
    """``spec`` with d_k and d_v zero-padded where only its head widths keep its products off the better
    path, for a caller that can pad q, k and v and slice the output (`onnx.kernels.attend`, `torch.plan`):
    zero columns add nothing to QKᵀ, and P·V's extra columns are dropped. The paths rank tile registers
    (d_k to their step, d_v to their block: Phi-2's and ViT-H's 80, Stable Diffusion's 40), then the bf16
    dot products (d_v to whole vectors, d_k to whole pairs: 40 and 72 on AVX-512 without AMX), then fp32
    FMAs. None where ``spec`` is on its CPU's best path as it is, or padding would not move it (decode,
    symbolic lengths off the dot products). The wasted width costs far less than the path it avoids (the
    README's AMX paragraph and its 16-bit inputs have the measurements)."""
    isa = isa_of(target)
    if spec.projections:
        return None
    plan = plan_of(spec, target)
    if isa.tiles is not None and not plan.on_tiles:
        padded = _padded_heads(spec, isa.tiles.step, isa.tiles.block)
        if padded is not None and plan_of(padded, target).on_tiles:
            return padded
    if isa.dot is not None and not plan.on_tiles and not (plan.qk_pairs and plan.pv_pairs):
        padded = _padded_heads(spec, PAIR if isinstance(spec.n_kv, int) else isa.dot.lanes, isa.dot.lanes)
        if padded is not None:
            dots = plan_of(padded, target)
            if dots.qk_pairs + dots.pv_pairs > plan.qk_pairs + plan.pv_pairs:
                return padded
    return None


def _padded_heads(spec: AttentionSpec, k_step: int, v_step: int) -> AttentionSpec | None:
    """``spec`` with d_k and d_v rounded up to whole steps, its scale still 1/√(true d_k); None if whole already."""
    d_k, d_v = -(-spec.d_k // k_step) * k_step, -(-spec.d_v // v_step) * v_step
    if (d_k, d_v) == (spec.d_k, spec.d_v):
        return None
    return spec.replace(head_dim=d_k, v_head_dim=d_v, scale=spec.softmax_scale)


def _plan(spec: AttentionSpec, target: Target, given: Mapping[str, KnobValue] | None) -> CpuPlan:
    isa = isa_of(target)
    cores = cores_of(target)
    parts_core = _fp16_parts(spec, isa)
    padding = _padding(spec, isa, parts_core)
    projections = tuple(_projection(spec, isa, name, weight) for name, weight in PROJECTIONS.items()) \
        if spec.projections else ()
    parts = frozenset((["core"] if parts_core else []) + [p.name for p in projections if p.path == "tiles"]) \
        if spec.dtype == "float16" else frozenset()
    head_tasks = (spec.batch if isinstance(spec.batch, int) else 1) * spec.h_kv % cores == 0
    defaults = _defaults(spec, isa, cores, parts_core, padding)
    knobs = resolve(KNOBS, {**defaults, **(given or {})})
    projections = tuple(_row_tile(spec, isa, p, knobs) for p in projections)
    chunks = divisor_at_most(spec.n_kv, knobs["key_chunks"]) if _few_tasks_of_one_query(spec, isa, cores) else 1

    n_q, n_kv = whole(spec.n_q, padding), whole(spec.n_kv, padding)
    q_tile = at_most(None, knobs["q_tile"], n_q)  # decode: one exact tile
    dot_tile = _dot_tile(spec, isa, parts_core, padding, q_tile)  # dot products: whole tiles
    q_tile_is_knob = dot_tile is None and not (isinstance(n_q, int) and n_q < knobs["q_tile"])
    choices = next(k for k in KNOBS if k.name == "q_tile").choices
    q_tile_read = q_tile_is_knob or dot_tile is None or len(
        {_dot_tile(spec, isa, parts_core, padding, c) for c in choices}) > 1
    q_tile = dot_tile or q_tile
    if padding > 1 and not isinstance(spec.n_kv, int):  # the padded keys come in whole blocks
        qk_keys, qk_keys_is_knob = divisor_at_most(isa.dot.lanes, knobs["qk_keys"]), False
    else:
        qk_keys = at_most(None, knobs["qk_keys"], spec.n_kv)
        qk_keys_is_knob = not (isinstance(spec.n_kv, int) and spec.n_kv < knobs["qk_keys"])
    s_lanes = lanes_for(q_tile, isa.lanes)
    along_head_dim = s_lanes == 1 and lanes_for(spec.d_k, isa.lanes) > 1
    on_tiles = (_tile_widths(spec, isa, parts_core) and padding in (1, isa.tiles.block)
                and q_tile % isa.tiles.block == 0 and n_q % q_tile == 0 and n_kv % isa.tiles.block == 0)
    qk_pairs, pv_pairs = (True, True) if on_tiles else _bf16_dots(spec, isa, n_q, n_kv, q_tile, qk_keys)
    half_keys = _half_keys(spec, isa) if not (parts_core or on_tiles) and s_lanes > 1 else 0
    # 16-bit K and V widened once for fp32 FMAs; not fp16's V where the record converts it per vector
    # (`Isa.converts_v`: AVX2's 16 registers beside F16C); not decode's K, read along
    # d_k; a layer's only in head tasks (elsewhere its register tiles widen k_proj, P·V converts V)
    widened = spec.dtype != "float32" and not along_head_dim and (not spec.projections or head_tasks)
    widen_k = widened and not qk_pairs
    widen_v = (widened and not pv_pairs and not half_keys and s_lanes > 1
               and not (isa.converts_v and spec.dtype == "float16"))
    # V's pair panel packed in its head's task (keys padded to whole blocks: from their padded rows,
    # copied there too); not from a layer's v_proj
    v_pairs = pv_pairs and not on_tiles and not spec.projections
    per_head = (widen_k or widen_v or v_pairs) and head_tasks
    return CpuPlan(spec, isa, cores, knobs, defaults, parts_core, padding, parts, projections, head_tasks, chunks,
                   q_tile, q_tile_is_knob, q_tile_read, qk_keys, qk_keys_is_knob,
                   divisor_at_most(q_tile, knobs["pv_rows"]),
                   along_head_dim, on_tiles, qk_pairs, pv_pairs, half_keys, widen_k, widen_v, v_pairs and per_head,
                   per_head)


def _fp16_parts(spec: AttentionSpec, isa: Isa) -> bool:
    """An fp16 core on bf16 tile products, each operand the sum of two bf16 parts (exact for fp16;
    three tile products where bf16 takes one): the records have no fp16 tile products, and
    fp32 FMAs of widened fp16 run at fp32's speed. Not for one query (a decode step: its dot products
    along d_k read half fp32's bytes) nor where a query sees fewer than `PARTS_MIN_KEYS` static keys."""
    seen = spec.n_kv // 2 if spec.causal and isinstance(spec.n_kv, int) else spec.n_kv
    seen = min(seen, spec.window) if spec.window is not None and isinstance(seen, int) else seen
    few_keys = isinstance(seen, int) and seen < PARTS_MIN_KEYS
    return (spec.dtype == "float16" and isa.tiles is not None and spec.n_q != 1 and not few_keys
            and spec.d_k % isa.tiles.step == 0 and spec.d_v % isa.tiles.block == 0)


def _half_keys(spec: AttentionSpec, isa: Isa) -> int:
    """The keys per fp16 block of fp16 P·V on the CPU's fp16 FMAs (twice fp32's lanes an instruction),
    0 for none: static keys in whole blocks, d_v in whole fp16 vectors (the block's register tile has no
    tail), the attention returned (measured on Sapphire Rapids' AVX512-FP16: the README's "Default
    tiles"); not a window over a symbolic query length (TVM 0.27 fails to lower its key blocks' bounds).
    (Queries in vectors, no tiles or bf16 parts: `_plan` asks only then.)"""
    keys = HALF_KEYS_MASKED if spec.causal or spec.window is not None else HALF_KEYS
    fits = (spec.dtype == "float16" and isa.half_math and spec.output == "attn" and isinstance(spec.n_kv, int)
            and spec.n_kv % keys == 0 and spec.d_v % isa.vector_lanes("float16") == 0
            and not (spec.window is not None and isinstance(spec.n_q, str)))
    return keys if fits else 0


def _tile_widths(spec: AttentionSpec, isa: Isa, parts: bool) -> bool:
    """Widths the tiles take: bf16 (fp16 in parts), d_k and d_v whole steps and blocks."""
    return ((spec.dtype == "bfloat16" or parts) and isa.tiles is not None
            and spec.d_k % isa.tiles.step == 0 and spec.d_v % isa.tiles.block == 0)


def _padding(spec: AttentionSpec, isa: Isa, parts: bool) -> int:
    """The block the core's lengths run in (`te_attention._core`; 1: none), for the 16-bit products,
    which take no tail: the tiles' blocks (symbolic lengths and ragged static ones, but for one query,
    which keeps its dot products along d_k), else the dot product's lanes for symbolic lengths, which
    QKᵀ then always takes (TVM 0.27 cannot build the widened key tiles over padded keys, of d_k in whole
    vectors); none where P·V cannot take them there (d_v no whole vector), as QKᵀ then does not (`_bf16_dots`)."""
    n_q, n_kv = spec.n_q, spec.n_kv
    if parts:
        return isa.tiles.block if any(isinstance(x, str) or x % isa.tiles.block for x in (n_q, n_kv)) else 1
    if not (spec.dtype == "bfloat16" and isa.dot is not None and spec.d_k % PAIR == 0):
        return 1
    if spec.d_k % isa.dot.lanes == 0 and spec.d_v % isa.dot.lanes:
        return 1
    if _tile_widths(spec, isa, parts) and n_q != 1 and any(isinstance(x, str) or x % isa.tiles.block
                                                          for x in (n_q, n_kv)):
        return isa.tiles.block
    symbolic = any(isinstance(x, str) for x in (n_q, n_kv))
    # static lengths with no whole query tile (a ViT's 197 tokens): padded, the dot products over whole tiles
    ragged = not symbolic and n_q != 1 and any(x % isa.dot.lanes for x in (n_q, n_kv))
    return isa.dot.lanes if ragged or (symbolic and (isinstance(n_q, str) or n_q % isa.dot.lanes == 0)) else 1


def _dot_tile(spec: AttentionSpec, isa: Isa, parts: bool, padding: int, q_tile: int) -> int | None:
    """The query tile for the dot products or the tiles at most ``q_tile``: the largest power of two
    from 16 dividing a static n_q (padded), or the block a symbolic one runs in; None: no such tile,
    or no such instruction."""
    if not parts and (spec.dtype != "bfloat16" or isa.dot is None):
        return None
    if not isinstance(spec.n_q, int):
        return padding if padding > 1 else None
    n_q = whole(spec.n_q, padding)
    tiles = (64, isa.tiles.block) if parts else tuple(t for t in (64, 32, 16, 8, 4) if t >= isa.dot.lanes)
    return next((t for t in tiles if t <= max(q_tile, tiles[-1]) and n_q % t == 0), None)


def _bf16_dots(spec: AttentionSpec, isa: Isa, n_q: Dim, n_kv: Dim, q_tile: int, qk_keys: int) -> tuple[bool, bool]:
    """Whether QKᵀ and P·V run on the bf16 dot product: bf16, static (padded) lengths in whole query
    tiles (a power of two from the instruction's lanes) and key tiles, whole pairs of the reduction
    and d_v in whole vectors (a tail's predicate cannot sit inside the instruction); QKᵀ only with P·V."""
    if spec.dtype != "bfloat16" or isa.dot is None or q_tile < isa.dot.lanes or q_tile & (q_tile - 1) \
            or not isinstance(n_q, int) or n_q % q_tile or not isinstance(n_kv, int):
        return False, False
    # (K's clamped rows of a symbolic n_kv, d_k not whole vectors: TVM cannot bind the instruction's pair views)
    qk = spec.d_k % PAIR == 0 and n_kv % qk_keys == 0 and (isinstance(spec.n_kv, int) or spec.d_k % isa.dot.lanes == 0)
    pv = n_kv % PAIR == 0 and spec.d_v % isa.dot.lanes == 0
    # QKᵀ alone on them, P·V widened, ran 1.06–1.17× slower than both widened (heads of 40 and 72 on
    # AVX512-BF16): QKᵀ takes them with P·V (over padded keys neither built: `_padding` pads none there)
    return qk and pv, pv


def _few_tasks_of_one_query(spec: AttentionSpec, isa: Isa, cores: int) -> bool:
    """Decode with fewer (batch, head) pairs than twice the cores: only the keys can keep them busy."""
    sizes = (spec.batch, spec.n_q, spec.n_kv)
    if any(isinstance(x, str) for x in sizes) or spec.n_q > 1 or lanes_for(spec.d_k, isa.lanes) == 1:
        return False
    return spec.batch * spec.h < 2 * cores and spec.n_kv >= 64 * cores


def _rows(spec: AttentionSpec, projection: str) -> Dim:
    """A projection's rows, B·n (symbolic: n, or n_kv for K's and V's)."""
    rows = spec.n_kv if projection in ("k_proj", "v_proj") else spec.n_q
    return rows * spec.batch if isinstance(spec.batch, int) and isinstance(rows, int) else rows


def _projection(spec: AttentionSpec, isa: Isa, name: str, weight: str) -> Projection:
    """A projection on tile registers where bf16 (fp16 in parts) has static rows from `MIN_PAIR_ROWS`
    (any symbolic ones) and the reduction and columns in whole blocks (W_O's within one head); else
    on the bf16 dot products (pairs of W packed once) with whole pairs and columns in whole vectors;
    else widened to fp32 FMAs. Rows padded to whole blocks where symbolic (on the tiles: where
    ragged); W in register-tile panels with 16 registers, from `MIN_PANEL_ROWS` rows."""
    depth, columns = spec.input_shapes()[weight]
    rows = _rows(spec, name)
    enough = not (isinstance(rows, int) and rows < MIN_PAIR_ROWS)
    tiles = (spec.dtype in ("bfloat16", "float16") and isa.tiles is not None and enough
             and depth % isa.tiles.step == 0 and columns % isa.tiles.block == 0
             and (name != "out" or spec.d_v % isa.tiles.step == 0))
    # W_O's pairs of merged columns must not straddle two heads: its x pairs are read from attn
    whole_pairs = depth % PAIR == 0 and (name != "out" or spec.d_v % PAIR == 0)
    pairs = (spec.dtype == "bfloat16" and isa.dot is not None and enough and whole_pairs
             and columns % isa.dot.lanes == 0)
    path = "tiles" if tiles else "pairs" if pairs else "fp32" if spec.dtype == "float32" else "widened"
    length = spec.n_kv if name in ("k_proj", "v_proj") else spec.n_q
    padded = not isinstance(length, int) or (tiles and length % isa.tiles.block > 0)
    panels = isa.registers < 32 and not (isinstance(rows, int) and rows < MIN_PANEL_ROWS)
    return Projection(name, weight, path, tiles and spec.dtype == "float16", padded, panels)


def _row_tile(spec: AttentionSpec, isa: Isa, projection: Projection, knobs: Mapping[str, int]) -> Projection:
    """``projection`` with `whole_row_tile`'s register tile where it is on the bf16 dot products over
    static rows (a sequence's: tiles stay inside one) that the knobs' rows do not divide, and that tile
    has more accumulators than the largest divisor up to the knobs' rows would (CLIP's 50 or 77 tokens:
    5 or 7 rows, not 2 or 1)."""
    rows = spec.n_kv if projection.name in ("k_proj", "v_proj") else spec.n_q
    if projection.path != "pairs" or not isinstance(rows, int) or rows % knobs["gemm_rows"] == 0:
        return projection
    width = gemm_widths(spec)[list(PROJECTIONS).index(projection.name)] // isa.lanes
    vecs = divisor_at_most(width, knobs["gemm_vecs"])  # (`dot_columns`)
    tile = whole_row_tile(rows, vecs, width, isa.registers)
    if tile is None or tile[0] * tile[1] <= divisor_at_most(rows, knobs["gemm_rows"]) * vecs:
        return projection
    return replace(projection, row_tile=tile)


def _defaults(spec: AttentionSpec, isa: Isa, cores: int, parts: bool, padding: int = 1) -> dict[str, int]:
    """Knob defaults (the measurements behind them: the README's "Default tiles"). With 32 registers
    and 16-bit inputs (or fp32 on full-width FMAs): 64-query tiles (32 where a mask bounds a tile's
    keys; 16 for a masked fp16 core widened on half-width FMAs) and P·V tiles of 4 vectors, 8 rows
    where d_v is at most 2 vectors (16 accumulators either way); with 16 registers those tiles spill,
    so fp32's defaults. One query: P·V tiles of 4 vectors in fp32, a 16-bit V's row in one pass
    (`_one_pass_vecs`). A layer's GEMM tiles by width (`gemm_defaults`); a one-token layer's column
    blocks give each core three tasks."""
    lanes = isa.lanes
    masked = spec.causal or spec.window is not None
    widened = spec.dtype == "float16" and not spec.projections and not parts
    tile = 64 if not masked else 16 if widened and not isa.full_width else 32
    if lanes < FULL_LANES:  # narrower vectors: the record's count of them a row (NEON's bfdot: 16 queries)
        tile = min(tile, isa.query_vectors * lanes)
    wide = isa.registers >= 32 and (spec.dtype != "float32" or isa.full_width)
    core = {"q_tile": tile, "pv_vecs": 4} if wide else {}
    if wide and spec.d_v <= 2 * lanes:  # a row of d_v in at most 2 vectors: 8 rows fill the tile
        core["pv_rows"] = 8
    core.update(isa.tile_knobs)  # (a record's own tiles: RVV-256's register groups)
    if spec.n_q == 1:
        core["pv_vecs"] = _one_pass_vecs(spec, lanes) if spec.dtype != "float32" else 4
    if isinstance(spec.n_q, str) and padding == lanes and isa.tiles is None:
        # a symbolic length on the dot products: query tiles of the padding's one vector, so 8 keys a
        # register tile make 8 accumulators (4 leave the dot product's latency exposed)
        core["qk_keys"] = 8
    if not spec.projections:
        return core
    d_in = max(spec.d, spec.h * spec.d_v)  # W_O's rows are the merged heads
    gemms = gemm_defaults(d_in, lanes, tvm.DataType(spec.dtype).bits, gemm_widths(spec), isa.registers)
    rows = spec.batch * spec.n_q if isinstance(spec.batch, int) and isinstance(spec.n_q, int) else None
    if rows is not None and rows < MIN_PAIR_ROWS:  # GEMVs: each W element read once, no panel to keep in L2
        tiles = min(spec.d, spec.h_kv * spec.d_k) // (gemms["gemm_vecs"] * lanes)  # per W's columns
        tasks = 3 * cores
        gemms["gemm_block_cols"] = next((c for c in (8, 4, 2) if c <= gemms["gemm_block_cols"]
                                         and tiles // c >= tasks), 1)
    return core | gemms


def gemm_widths(spec: AttentionSpec) -> tuple[int, int, int, int]:
    """The output widths of a layer's projections: W_Q, W_K, W_V, W_O."""
    return spec.h * spec.d_k, spec.h_kv * spec.d_k, spec.h_kv * spec.d_v, spec.d


def _one_pass_vecs(spec: AttentionSpec, lanes: int) -> int:
    """P·V vectors per register tile for one query of a 16-bit V: its whole row, up to 16 vectors
    (a pass then reads every cache line of a row once); a row of no power-of-two count of vectors
    keeps 4 (a predicated tail)."""
    row = max(spec.d_v // lanes, 1)
    return max((c for c in (2, 4, 8, 16) if row % c == 0), default=4)
