"""A bf16 GEMM (``import_onnx(dtype="bfloat16")``: bf16 activations · a bf16 weight, fp32 accumulation)
on the target's tile registers where it has them and the reduction and width are whole blocks (AMX:
`_on_tiles`, on `cpu.tiles.tile_gemm` as a layer's projections), else on its bf16 dot product (its
record's `Isa.dot`: AVX512-BF16's ``vdpbf16ps``, two products per fp32 lane), in the register tiles of
`micro_kernels.gemm` as the attention layer's projections run them, each step broadcasting a pair of
x's reduction. The weight, a constant, is packed at compile time into one panel per register tile's
(or tile block's) columns, pairs of its rows interleaved (m/w, c/2, w, 2), so that a tile streams it
contiguously rather than a row of pairs a whole output row apart; an activation B (DeBERTa's
positional keys) is packed into pairs of its rows (c/2, m, 2) in the kernel, once a call. Neither
instruction takes a tail predicate: static rows run in register tiles of rows that divide them
(`micro_kernels.whole_row_tile`, where those do more useful work than padding), symbolic ones and the
other static ones in whole blocks of 16, on the tiles any rows in blocks of 32 (``pad_einsum``: x copied
with zero rows past its end; each block of the product stores its real rows); the register tiles are on the stack
(`passes.register_tiles_on_stack`); the reduction must be whole pairs and the width whole vectors. A
decode step's few rows (static, under `MIN_PAIR_ROWS`; one row: `GemvPairs`, on `micro_kernels.gemv`'s
column tiles) by a constant weight take the dot product too, unpadded, off the tiles: one pass over a
weight packed at compile time, half the bytes of widening it to fp32 FMAs (gpt2-decode 1.42× → 1.56× our
fp32). Elsewhere (a record without a dot product, odd sizes, an activation cast inside the function, an
activation B of a few rows) the `matmul` rule widens the operands to fp32 FMAs.
"""

from __future__ import annotations

from typing import Mapping

from tvm import tirx
from tvm.s_tir import Schedule
from tvm.target import Target

from tvmattn.compiler.isa import RECORDS
from tvmattn.compiler.isa.record import Dot, Isa
from tvmattn.compiler.passes import KEEP_16BIT, keep_operands_16bit, register_tiles_on_stack
from tvmattn.compiler.target import cores_of, isa_of
from tvmattn.schedules.cpu.packing import in_pairs, weight_panels
from tvmattn.schedules.cpu.plan import MIN_PAIR_ROWS
from tvmattn.schedules.cpu.tiles import tile_gemm
from tvmattn.schedules.knobs import resolve
from tvmattn.schedules.micro_kernels import PADDED_ROW_BLOCK, dot_columns, gemv, whole_row_tile
from tvmattn.schedules.ops.injective import spatial
from tvmattn.schedules.ops.matmul import CONSTANT_PARAMS, KNOBS, Matmul, _chain, pad_axes
from tvmattn.schedules.primitives import same_domain, vectorize

# x's padded copy keeps its bf16 bits for the instruction (whichever record's dot product reads it)
_READERS = tuple(sorted({reader for isa in RECORDS for reader in isa.packed_readers}))


class MatmulPairs(Matmul):
    # (the records' own passes act only on what their intrinsics marked: AMX's tile configuration)
    passes = (keep_operands_16bit(_READERS), register_tiles_on_stack(),
              *dict.fromkeys(p for isa in RECORDS for p in isa.passes))

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool,
              knobs: Mapping[str, int] | None = None) -> Schedule | None:
        isa = isa_of(target)
        dot = isa.dot if isa is not None else None
        if dot is None:
            return None
        match = self._match(func, target)
        if match is None:
            return None
        sch, infos, at, weight, lanes, defaults = match
        block = infos[at].block_rv
        stmt = sch.get(block)
        if at != 0 or not _bf16_operands(stmt) or lanes != dot.lanes:
            return None  # a prologue (a cast of x inside the function) leaves no bf16 pairs to read
        *_, width, depth = [iv.dom.extent for iv in stmt.iter_vars]
        rows = stmt.iter_vars[-3].dom.extent if self.rows else None
        constants = func.attrs.get(CONSTANT_PARAMS, []) if func.attrs else []
        constant = any(weight.same_as(func.params[int(i)]) for i in constants) and len(weight.ty.shape) == 2
        if not (isinstance(depth, tirx.IntImm) and int(depth) % dot.pair == 0 and int(width) % dot.lanes == 0):
            return None
        # a decode step's few rows: one pass over a weight packed at compile time, no row padded
        few = rows is None or isinstance(rows, tirx.IntImm) and rows.value < MIN_PAIR_ROWS
        if few and not constant:
            return None  # an activation's pairs packed each call for a few rows: the widened tiles are as fast
        knobs = resolve(KNOBS, {**defaults, **(knobs or {})})
        tiles = isa.tiles
        if not few and tiles is not None and int(depth) % tiles.step == 0 and int(width) % tiles.block == 0:
            return _on_tiles(sch, infos, at, weight, constant, isa, knobs, cores_of(target))
        tile = knobs["gemm_rows"] if isinstance(knobs["gemm_rows"], int) else defaults["gemm_rows"]
        epilogue = list(_chain(sch, [info.block_rv for info in infos[at + 1:]]))
        static = isinstance(rows, tirx.IntImm)
        ragged = not few and static and rows.value % tile > 0
        vecs = dot_columns(sch, int(width), lanes, knobs["gemm_vecs"]) // lanes
        retiled = _whole_row_tile(rows.value, tile, vecs, int(width) // lanes, isa.registers) if ragged else None
        if retiled is not None:
            knobs = {**knobs, "gemm_rows": retiled[0], "gemm_vecs": retiled[1]}
        padded = not few and (not static or ragged and retiled is None)
        if padded:  # symbolic rows, or static ones without the tile's rows as a divisor (ViT's 2·197)
            epilogue = pad_axes(sch, block, _rows_in_blocks(stmt, PADDED_ROW_BLOCK), lanes, epilogue)
        pair = dot.pair
        packing = None if constant else _pair_panel(sch, block, weight, dot, lanes)
        panel = weight if packing is None else packing[0]
        steps: list = []
        for rest in self.tiles(sch, block, lanes, knobs, epilogue, dot=dot, later=steps):
            if padded or not same_domain(sch, sch.get_consumers(block)[0], rest):
                # the real rows of each register tile (or those a slice keeps), after its store (in L1)
                sch.reverse_compute_at(rest, _tile_loop(sch, block), preserve_unit_loops=True)
                vectorize(sch, sch.get_loops(rest)[-1], None, lanes)
            else:
                spatial(sch, rest, target)
        index = next(i for i, r in enumerate(sch.get(block).reads) if r.source.same_as(panel))
        if packing is None:  # the weight, packed at compile time: each register tile's columns one panel
            columns = dot_columns(sch, int(width), lanes, knobs["gemm_vecs"])
            sch.transform_layout(block, ("read", index), weight_panels(columns))
        else:  # an activation (DeBERTa's positional keys), packed by `_pair_panel` in the kernel
            sch.transform_layout(block, ("read", index), _row_pairs(pair))
            packing[1]()
        sch.annotate(sch.get_loops(block)[0], "pragma_import_llvm", dot.llvm)  # the instruction's definition
        for step in steps:  # last: a tensorized stage leaves the others no stage pipeline
            step()
        return sch


class GemvPairs(MatmulPairs):
    """One row (a decode step): `micro_kernels.gemv`'s column tiles on the dot product, the constant
    weight's pair panel packed at compile time."""

    rows = False
    tiles = staticmethod(gemv)


def _whole_row_tile(rows: int, tile: int, vecs: int, width: int, registers: int) -> tuple[int, int] | None:
    """`whole_row_tile` for a static row count the knobs' ``tile`` (of ``vecs`` vectors) does not
    divide, where it does more useful work than the knobs' tile over rows padded to whole blocks
    (8 × 2 over a Wav2Vec2's 6399 rows padded to 6400, not 3 × 2). A CLIP's 50 tokens a sequence
    padded to 64 spent 22 % of the GEMM on zero rows; 5-row tiles spend none."""
    found = whole_row_tile(rows, vecs, width, registers)
    if found is None:
        return None
    padded = -(-rows // PADDED_ROW_BLOCK) * PADDED_ROW_BLOCK
    return found if min(found[0] * found[1], tile * vecs) * padded > tile * vecs * rows else None


def _bf16_operands(block) -> bool:
    """Both operands bf16, the accumulator fp32."""
    reads = [r.source.dtype for r in block.reads if not r.source.same_as(block.writes[0].source)]
    return str(block.writes[0].source.dtype) == "float32" and len(reads) == 2 and \
        all(str(d) == "bfloat16" for d in reads)


def _on_tiles(sch: Schedule, infos, at: int, weight: tirx.Buffer, constant: bool, isa: Isa,
              knobs: Mapping, cores: int) -> Schedule:
    """The GEMM on tile registers (`tile_gemm`): rows in whole blocks (padded where they are not), a
    constant weight packed at compile time into panels of one block's columns (an activation into
    pairs of its rows in the kernel, `_pair_panel`), and the epilogue (and the padded rows' copy back)
    computed on each block of accumulators after its store, from that block alone (a block's worth of
    the fp32 product, which stays in L1)."""
    tiles, lanes = isa.tiles, isa.lanes
    block = infos[at].block_rv
    stmt = sch.get(block)
    rows = stmt.iter_vars[-3].dom.extent
    padded = not isinstance(rows, tirx.IntImm) or rows.value % tiles.block != 0
    epilogue = list(_chain(sch, [info.block_rv for info in infos[at + 1:]]))
    if padded:
        epilogue = pad_axes(sch, block, _rows_in_blocks(stmt, tiles.block), lanes, epilogue)
    packing = None if constant else _pair_panel(sch, block, weight, isa.dot, lanes)
    panel = weight if packing is None else packing[0]
    later: list = []
    columns = tile_gemm(sch, tiles, lanes, block, knobs, later, cores=cores)
    index = next(i for i, r in enumerate(sch.get(block).reads) if r.source.same_as(panel))
    sch.transform_layout(block, ("read", index), weight_panels(tiles.block) if constant else _row_pairs(isa.dot.pair))
    if packing is not None:
        packing[1]()
    for stage in epilogue:
        sch.reverse_compute_at(stage, columns, preserve_unit_loops=True)
        vectorize(sch, sch.get_loops(stage)[-1], None, lanes)
    sch.annotate(sch.get_loops(block)[0], "pragma_import_llvm", tiles.llvm)
    for step in later:
        step()
    return sch


def _row_pairs(pair: int):
    """An activation B (…, c, m) as pairs of its rows, (…, c/pair, m, pair) (`_pair_panel`'s copy)."""
    return lambda *i: (*i[:-2], i[-2] // pair, i[-1], i[-2] % pair)


def _rows_in_blocks(stmt: tirx.SBlock, rows: int) -> list[int]:
    """`matmul.pad_axes`'s factors for rows in whole blocks of ``rows``: each block of the product stores its
    own real rows (the whole padded fp32 product had been an array, read and copied back in a pass of its
    own: an audio front end's 10-tap convolution, 13 MB)."""
    return [1] * (len(stmt.iter_vars) - 3) + [rows, 1, 1]


def _tile_loop(sch: Schedule, block):
    """The loop under which a register tile of ``block`` is stored (its accumulator's, `register_tile`)."""
    mine = [sch.get(loop) for loop in sch.get_loops(block)]
    store = sch.get_consumers(block)[0]
    return [loop for loop in sch.get_loops(store) if any(sch.get(loop).same_as(m) for m in mine)][-1]


def _pair_panel(sch: Schedule, block, b: tirx.Buffer, dot: Dot, lanes: int):
    """An activation B (…, c, m) read through a copy the GEMM's layout makes (…, c/pair, m, pair): each
    pair of B's rows interleaved, once a call, before the GEMM (its reads of pairs are then contiguous).
    Returns the copy's buffer and its schedule, to run after the layout is set."""
    index = next(i for i, r in enumerate(sch.get(block).reads) if r.source.same_as(b))
    copy = sch.cache_read(block, index, "global")
    sch.annotate(copy, KEEP_16BIT, 1)

    def schedule() -> None:  # tensorized as the attention's V panels are: two rows' words at a time
        outer = sch.get_loops(copy)[:-2]
        rows = in_pairs(sch, dot, sch.get(copy).name_hint, -2, lanes, "bfloat16")
        sch.parallel(sch.fuse(*outer, rows) if outer else rows)

    return sch.get(copy).writes[0].source, schedule
