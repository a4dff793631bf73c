"""Packing for the CPU kernels' micro-kernels: operands copied, once, into the layouts their register
tiles and instructions read: the query panel (d_k-major, a transposition in registers), a mask's
tile, P's and V's pair panels for the bf16 dot products (and Vᵀ for tile products), fp16's bf16 parts,
and 16-bit operands widened to fp32; in a pass before the tasks, or inside a head's task."""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.s_tir import Schedule

from tvmattn.compiler.annotations import QUERY_AXIS
from tvmattn.compiler.isa.panels import PAIR, query_panel_intrinsic
from tvmattn.compiler.isa.record import Dot, Isa, Tiles
from tvmattn.compiler.passes import KEY_BLOCKS
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.te_attention import KEY_STAGE
from tvmattn.compiler.variant import MASK_AXES
from tvmattn.schedules.primitives import copy_of, has_block, tensorize, vectorize


def pack_queries(sch: Schedule, spec: AttentionSpec, task, q_tile: int, lanes: int, pairs: bool,
                   later: list) -> None:
    """Copy the task's queries into a (d_k, q_tile) panel: QKᵀ then loads whole vectors of queries
    (``pairs``: a (d_k/2, q_tile, 2) panel, the operand of the bf16 dot product). Where the tiles
    hold whole blocks of lanes × lanes words, a transposition in registers (`tensorize_queries`, a
    step for ``later``)."""
    padded = has_block(sch, "q_rows")  # (B, h, n_rows, d_k), rows clamped to n - 1
    width = lanes * (PAIR if pairs else 1)  # of d_k per block of the panel
    whole = q_tile % lanes == 0 and spec.d_k % width == 0 and (padded or (isinstance(spec.n_q, int)
                                                                          and spec.n_q % q_tile == 0))
    if padded and not whole:  # the stage is the panel
        panel = sch.get_sblock("q_rows")
    else:  # (a padded one: a copy of the task's clamped rows as they are, then the blocks of it)
        panel = copy_of(sch, sch.get_sblock("scores"), ("q_rows",) if padded else ("q", "q_proj"))
    sch.compute_at(panel, task, preserve_unit_loops=True)
    if padded and whole:
        rows = sch.get_sblock("q_rows")
        sch.compute_at(rows, task, preserve_unit_loops=True)
        vectorize(sch, sch.get_loops(rows)[-1], spec.d_k, lanes)
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
        later.append(functools.partial(tensorize_queries, sch, sch.get(panel).name_hint, intrinsic, lanes,
                                       width, bshd))


def tensorize_queries(sch: Schedule, name: str, intrinsic: str, lanes: int, width: int,
                       heads_between: bool) -> None:
    """The query panel ``name`` as ``intrinsic`` (`isa.panels.query_panel_intrinsic`): its loops
    (…, s, [head,] e), blocks of ``lanes`` queries × ``width`` of d_k (a unit head loop outside them)."""
    loops = sch.get_loops(sch.get_sblock(name))
    head = loops[-2:-1] if heads_between else []
    s_out, s_in = sch.split(loops[-3] if heads_between else loops[-2], [None, lanes])
    e_out, e_in = sch.split(loops[-1], [None, width])
    sch.reorder(*head, s_out, e_out, s_in, e_in)
    tensorize(sch, s_in, intrinsic)


def pack_mask(sch: Schedule, spec: AttentionSpec, task, q_tile: int, lanes: int, later: list,
              per_head: bool = False) -> None:
    """Copy the task's rows of a per-query attn_mask into a (key, query) tile, once: the stages that
    read it (row max, probabilities) run along queries, and would otherwise gather the mask with a
    stride of n_kv, twice. An fp32 mask in whole blocks of lanes × lanes is transposed in registers, as
    the query panel is (`tensorize_queries`, a step for ``later``); copied element by element, each
    store went to a cache line of its own. Padded rows (symbolic lengths) are copied as they are first,
    contiguous along keys, and the tile transposed from them; not in a head task's serial loop
    (``per_head``), whose offsets into that copy TVM cannot match to the intrinsic's. Other fp32 tiles
    are copied a key at a time, a vector of queries gathered."""
    readers = [sch.get_sblock(name) for name in ("row_max", "probs")]
    padded = has_block(sch, "mask_rows")  # the mask's rows in whole blocks, clamped (`te_attention._core`)
    rows_first = padded and not per_head
    if rows_first:  # (the tile's copy is then made in the task, under them)
        rows = sch.get_sblock("mask_rows")
        sch.compute_at(rows, task, preserve_unit_loops=True)
        if str(sch.get(rows).writes[0].source.dtype) != "bool":  # (TVM 0.27 cannot vectorise a bool copy)
            vectorize(sch, sch.get_loops(rows)[-1], None, lanes)  # (whole vectors unclamped: `unclamp_whole_vectors`)
        tile = copy_of(sch, readers[0], ("mask_rows",), readers)
    else:  # the tile is the padded rows' stage itself, or a copy of the mask
        tile = sch.get_sblock("mask_rows") if padded else copy_of(sch, readers[0], ("attn_mask",), readers)
        sch.compute_at(tile, task, preserve_unit_loops=True)
    sch.transform_layout(tile, ("write", 0), lambda b, h, s, t: (b, h, s // q_tile, t, s % q_tile),
                         assume_injective_transform=True)
    *_, queries, keys = (sch.get(loop).extent for loop in sch.get_loops(tile))
    static_blocks = not padded and isinstance(spec.n_q, int) and spec.n_q % q_tile == 0 and \
        isinstance(keys, tirx.IntImm) and int(keys) % lanes == 0  # (else the last task's tile is cut)
    whole = isinstance(queries, tirx.IntImm) and int(queries) % lanes == 0 and (rows_first or static_blocks)
    fp32 = str(sch.get(tile).writes[0].source.dtype) == "float32"
    if whole and lanes > 1 and fp32:
        later.append(functools.partial(tensorize_queries, sch, sch.get(tile).name_hint,
                                       query_panel_intrinsic("float32", lanes, False, True, False), lanes, lanes,
                                       False))
    elif fp32 and lanes > 1 and isinstance(queries, tirx.IntImm) and int(queries) % lanes == 0:
        # (the tile's rows past n read row n - 1: `passes.pad_query_tiles`); copied along keys, each
        # query's store went to a cache line of its own, a scatter per vector
        s, t = sch.get_loops(tile)[-2:]
        sch.reorder(t, s)
        vectorize(sch, s, int(queries), lanes)
        sch.annotate(tile, QUERY_AXIS, MASK_AXES.index("s"))


def pack_pairs(sch: Schedule, spec: AttentionSpec, pair_loop, step: int | None = None, head=None, *,
               lanes: int) -> tuple[str, str]:
    """The operands of P·V as the bf16 dot product reads them: P rounded to bf16 (as FlashAttention
    rounds it for 16-bit inputs; the row sums keep fp32), per pair of keys as probs computes it
    (``pair_loop``), and V once: in a pass before the tasks (a copy per query tile would be a pass
    over V per tile; the price is a workspace the size of V), or ``head``, a head task's loop
    (`CpuPlan.per_head`), its head's rows in each task, kept in its cache for the head's tiles (no
    pass of its own, no barrier; keys padded to whole blocks: V's padded rows, v_rows, copied there
    too, in vectors of ``lanes``). ``step``: V's keys in blocks of the tiles' reduction step (their Vᵀ).
    Both with keys 2t, 2t+1 side by side: P (t/2, q_tile, 2), V (t/2, d_v, 2). Their copies' names, for
    `tensorize_pairs`."""
    pv = sch.get_sblock("pv")
    padded = has_block(sch, "v_rows")  # (B, h_kv, n_keys, d_v)
    v_panel = copy_of(sch, pv, ("v_rows", "v", "v_proj"))
    p_panel = copy_of(sch, pv, ("probs",), [pv])  # the row sums keep fp32
    sch.reverse_compute_at(p_panel, pair_loop, preserve_unit_loops=True)
    sch.unsafe_set_dtype(p_panel, 0, "bfloat16")
    p_name = sch.get(p_panel).name_hint
    sch.transform_layout(p_panel, ("write", 0), lambda b, i, st, t, s: (b, i, st, t // PAIR, s, t % PAIR),
                         assume_injective_transform=True)
    if step and spec.projections and not padded:  # v_proj (B, n_kv, h_kv·d_v)
        v_layout = lambda b, t, m: (b, t // step, m, t % step)  # noqa: E731
    elif step and spec.layout == "BSHD" and not padded:
        v_layout = lambda b, t, h, c: (b, h, t // step, c, t % step)  # noqa: E731
    elif step:
        v_layout = lambda b, h, t, c: (b, h, t // step, c, t % step)  # noqa: E731
    elif spec.projections and not padded:  # v_proj (B, n_kv, h_kv·d_v)
        v_layout = lambda b, t, m: (b, t // PAIR, m, t % PAIR)  # noqa: E731
    elif spec.layout == "BHSD" or padded:
        v_layout = lambda b, h, t, c: (b, h, t // PAIR, c, t % PAIR)  # noqa: E731
    else:
        v_layout = lambda b, t, h, c: (b, h, t // PAIR, c, t % PAIR)  # noqa: E731
    sch.transform_layout(v_panel, ("write", 0), v_layout, assume_injective_transform=True)
    if head is not None:
        sch.compute_at(v_panel, head, preserve_unit_loops=True)
        if padded:  # (after the panel: moved first, its copy would sit in the task already, which compute_at refuses)
            rows = sch.get_sblock("v_rows")
            sch.compute_at(rows, head, preserve_unit_loops=True)
            vectorize(sch, sch.get_loops(rows)[-1], spec.d_v, lanes)
    return p_name, sch.get(v_panel).name_hint


def widened_once(sch: Schedule, reader: str, names: tuple[str, ...], width: int, lanes: int,
                 consumers: list | None = None, at=None) -> None:
    """A 16-bit operand of ``reader`` (K for QKᵀ, V for P·V, x for projections) widened to fp32 once,
    for ``consumers`` (default: every reader): the micro-kernel then loads plain fp32, not a
    conversion per vector of V in every query tile, nor K's register tile widened in every task.
    ``at`` a head task's loop (`CpuPlan.per_head`), its head's rows in each task, else in
    a parallel pass before the tasks (a workspace twice the operand's size)."""
    copy = copy_of(sch, sch.get_sblock(reader), names, consumers)
    sch.unsafe_set_dtype(copy, 0, "float32")
    if at is not None:
        sch.compute_at(copy, at, preserve_unit_loops=True)
    else:
        sch.parallel(sch.fuse(*sch.get_loops(copy)[:-1]))
    vectorize(sch, sch.get_loops(copy)[-1], width, lanes)


def in_blocks(sch: Schedule, name: str, lanes: int, own_pass: bool) -> None:
    """k_rows or v_rows, K or V with its keys in whole blocks: with ``own_pass`` (an intrinsic reads
    its rows: V's pair panels, the tiles' K, a clamped row being no block of rows), one parallel pass
    before the tasks, else inlined into its reader."""
    if own_pass:
        before_tasks(sch, (name,), lanes)
    else:
        sch.compute_inline(sch.get_sblock(name))


def before_tasks(sch: Schedule, names: tuple[str, ...], lanes: int) -> None:
    """Stages over every row of K and V (the same rows), computed in one parallel pass before the
    tasks: their row loops merged (a pass each is a start of the thread pool, or a barrier, each)."""
    rows = []
    for name in names:
        *loops, c = sch.get_loops(sch.get_sblock(name))
        rows.append(sch.fuse(*loops))
        vectorize(sch, c, int(sch.get(c).extent), lanes)
    sch.parallel(sch.merge(*rows) if len(rows) > 1 else rows[0])


def pack_query_parts(sch: Schedule, task, q_tile: int, lanes: int, later: list) -> None:
    """fp16 queries on tile products (`CpuPlan.fp16_parts`): each task computes its rows' bf16 parts, q_hi and
    q_lo, and turns each into QKᵀ's pair panel (d_k/2, q_tile, 2) as `pack_queries` does a bf16 one."""
    scores = sch.get_sblock("scores")
    for name in ("q_hi", "q_lo"):
        panel = copy_of(sch, scores, (name,))
        sch.compute_at(panel, task, preserve_unit_loops=True)
        rows = sch.get_sblock(name)
        sch.compute_at(rows, task, preserve_unit_loops=True)
        vectorize(sch, sch.get_loops(rows)[-1], None, lanes)
        sch.transform_layout(panel, ("write", 0),
                             lambda b, i, s, e: (b, i, s // q_tile, e // PAIR, s % q_tile, e % PAIR),
                             assume_injective_transform=True)
        intrinsic = query_panel_intrinsic("bfloat16", lanes, True, argument=False, heads_between=False)
        later.append(functools.partial(tensorize_queries, sch, sch.get(panel).name_hint, intrinsic, lanes,
                                       lanes * PAIR, False))


def pack_parts(sch: Schedule, pair_loop, q_tile: int, step: int) -> tuple[list[str], list[str]]:
    """fp16's P·V on tile products (`CpuPlan.fp16_parts`): P's bf16 parts, p_hi and p_lo, packed into pairs of
    keys as probs computes them (`pack_pairs`' P panel, twice), and Vᵀ panels of V's parts, once
    before the tasks. Their names, for `tensorize_parts`."""
    pv = sch.get_sblock("pv")
    p_names, v_names = [], []
    for p_name, v_name in (("p_hi", "v_hi"), ("p_lo", "v_lo")):
        p_panel = sch.get_sblock(p_name)
        sch.reverse_compute_at(p_panel, pair_loop, preserve_unit_loops=True)
        sch.transform_layout(p_panel, ("write", 0),
                             lambda b, i, t, s: (b, i, s // q_tile, t // PAIR, s % q_tile, t % PAIR),
                             assume_injective_transform=True)
        v_panel = copy_of(sch, pv, (v_name,))
        sch.transform_layout(v_panel, ("write", 0), lambda b, h, t, c: (b, h, t // step, c, t % step),
                             assume_injective_transform=True)
        p_names.append(p_name)
        v_names.append(sch.get(v_panel).name_hint)
    return p_names, v_names


def tensorize_parts(sch: Schedule, isa: Isa, panels: tuple[list[str], list[str]], q_tile: int) -> None:
    """`pack_parts`' panels as tensor intrinsics (a deferred step): P's parts as the dot product's pairs
    (rounded, and the residual), V's as the tiles' transposed values, in one pass."""
    p_names, v_names = panels
    for part, p_name in enumerate(p_names):
        in_pairs(sch, isa.dot, p_name, -2, q_tile, "float32", part=part)
        _pairs_of_keys(sch, p_name, q_tile, key_major=True)
    for v_name in v_names:
        _transposed_values(sch, isa.tiles, v_name, False)
    sch.parallel(sch.merge(*(sch.fuse(*sch.get_loops(sch.get_sblock(v + "_o"))) for v in v_names)))


def tensorize_pairs(sch: Schedule, isa: Isa, spec: AttentionSpec, panels: tuple[str, str], q_tile: int,
                    on_tiles: bool = False, per_head: bool = False) -> None:
    """`pack_pairs`' copies as the dot product's pair packing, one block per pair of rows, and with
    ``on_tiles`` V's as the tiles' transposed values (a deferred step, `register_tile`'s
    ``later``); V's a parallel pass of its own unless ``per_head`` (in the head tasks)."""
    p_name, v_name = panels
    # V's loops (b, t, h, c), else (…, t, c) (v_rows is BHSD)
    bshd = not spec.projections and spec.layout == "BSHD" and not has_block(sch, "v_rows")
    in_pairs(sch, isa.dot, p_name, -2, q_tile, "float32")
    if on_tiles:
        _transposed_values(sch, isa.tiles, v_name, bshd)
    else:
        # (a layer's v_proj: a head at a time)
        in_pairs(sch, isa.dot, v_name, -3 if bshd else -2, spec.d_v, "bfloat16", bshd)
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


def _transposed_values(sch: Schedule, tiles: Tiles, v_name: str, heads_between: bool) -> None:
    """V's copy ``v_name`` as ``tiles.transposed_values``, blocks of ``step`` keys × ``rows`` of d_v
    (its loops …, t, [head,] c)."""
    loops = sch.get_loops(sch.get_sblock(v_name))
    t, heads, c = (loops[-3], loops[-2:-1], loops[-1]) if heads_between else (loops[-2], [], loops[-1])
    t_out, t_in = sch.split(t, [None, tiles.step])
    c_out, c_in = sch.split(c, [None, tiles.rows])
    sch.reorder(t_out, *heads, c_out, t_in, c_in)
    tensorize(sch, t_in, tiles.transposed_values(heads_between))


def in_pairs(sch: Schedule, dot: Dot, name: str, row_at: int, width: int, source: str, heads_between: bool = False,
             part: int | None = None):
    """The copy ``name`` as ``dot.pairs`` (of P's ``part``, if given): its row loop
    (``row_at``) split into pairs, the pair innermost, ``width`` columns per block. Returns the loop
    over pairs of rows."""
    loops = sch.get_loops(sch.get_sblock(name))
    rows, pair = sch.split(loops[row_at], [None, dot.pair])
    sch.reorder(rows, *loops[row_at + 1:], pair)  # (rows/2, [head,] column, pair)
    tensorize(sch, sch.split(loops[-1], [None, width])[1], dot.pairs(source, width, heads_between, part))
    return rows


def weight_panels(width: int):
    """The layout of a weight W (c, m) on the 16-bit products: panels of ``width`` columns, each with
    pairs of W's rows interleaved, (m/width, c/2, width, 2), so that a tile of those columns reads
    its W contiguously (`matmul.pack` writes a constant weight so at compile time)."""
    return lambda c, m: (m // width, c // PAIR, m % width, c % PAIR)


def tensorize_weight_pairs(sch: Schedule, dot: Dot, panels: list[str], source: str) -> None:
    """W's pair panels (width/w, d/2, w, 2), packed 16 columns at a time in one parallel pass over pairs
    of rows: bf16 W's, or the two bf16 parts of an fp16 W (``source``)."""
    rows = [in_pairs(sch, dot, panel, -2, dot.lanes, source, part=part if len(panels) > 1 else None)
            for part, panel in enumerate(panels)]
    sch.parallel(sch.merge(*rows) if len(rows) > 1 else rows[0])
