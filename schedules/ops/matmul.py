"""Fused GEMM / batch GEMM: ``C[…, s, m] = Σ_c A[…, s, c] · B[…, c, m]`` with elementwise prologues
(casts) and epilogues (bias, activation, residual, scale) in the same function.

The GEMM block goes on the register-tile micro-kernel of the attention layer's projections
(`schedules.micro_kernels.gemm`): parallel (row block × column block) tasks, register tiles of rows ×
vectors of columns accumulated over c, the epilogue applied to each tile as it is stored. Prologues
are inlined into the GEMM's loads. Rows may be symbolic (batch · sequence of a dynamic export):
`passes.clamp_row_tails` keeps the row tail's test off the micro-kernel.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from tvm import tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir import Schedule
from tvm.s_tir.dlight import ScheduleRule, normalize_prim_func
from tvm.target import Target

from tvmattn.compiler.annotations import CONSTANT_PARAMS, PADDED_AXES
from tvmattn.compiler.passes import clamp_row_tails, uses
from tvmattn.compiler.target import isa_of, vector_lanes
from tvmattn.schedules.knobs import resolve
from tvmattn.schedules.micro_kernels import GEMM_KNOBS, gemm, gemm_defaults
from tvmattn.schedules.ops.injective import spatial
from tvmattn.schedules.primitives import lanes_for

KNOBS = GEMM_KNOBS
WIDE = 8192  # output columns from which a GEMM takes taller register tiles (`Matmul.defaults`)
SHORT = 16  # a reduction this short (an audio front end's one-channel conv: 10 taps) takes them too
SYMBOLIC_REDUCTION = 1024  # the reduction length assumed for a symbolic one's task sizes


def pack(w: np.ndarray, shape: list[int]) -> np.ndarray:
    """A weight (c, m) in the micro-kernel's layout (m // width, c, m % width), zero-padded to whole
    column tiles: each register tile then streams one contiguous panel; or, bf16 for the dot
    products (`matmul_bf16`), each panel in pairs of its rows (m // width, c / 2, width, 2)."""
    if len(shape) == 4:
        tiles, half, width, pair = shape
        return np.ascontiguousarray(w.reshape(half, pair, tiles, width).transpose(2, 0, 3, 1))
    tiles, c, width = shape
    padded = np.zeros((c, tiles * width), w.dtype)
    padded[:, :w.shape[1]] = w
    return np.ascontiguousarray(padded.reshape(c, tiles, width).transpose(1, 0, 2))


class Matmul(ScheduleRule):
    KNOBS = KNOBS
    passes = (clamp_row_tails(),)  # symbolic rows: the tail's test only on the tile's store
    rows = True  # the GEMM has a row axis (`gemv.Gemv`: it has none)

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool,
              knobs: Mapping[str, int] | None = None) -> Schedule | None:
        """Schedule ``func`` with the default knobs overridden by ``knobs`` (a tuning record's); None if
        it is not a GEMM of this rule's kind."""
        match = self._match(func, target)
        if match is None:
            return None
        sch, infos, at, weight, lanes, defaults = match
        knobs = resolve(KNOBS, {**defaults, **(knobs or {})})
        block = infos[at].block_rv
        for info in reversed(infos[:at]):  # prologue: computed where the GEMM loads it
            try:
                sch.compute_inline(info.block_rv)
            except Exception:  # s_tir.ScheduleError: not inlinable; it keeps a loop nest of its own
                spatial(sch, info.block_rv, target)
        constants = func.attrs.get(CONSTANT_PARAMS, []) if func.attrs else []
        packed = any(weight.same_as(func.params[int(i)]) for i in constants) and len(weight.ty.shape) == 2
        epilogue = _chain(sch, [info.block_rv for info in infos[at + 1:]])
        axes = sch.get(block).iter_vars
        width = int(axes[-2].dom.extent)
        if self.rows and not packed and width > lanes and 2 * lanes_for(width, lanes) < lanes:
            # an activation B of a width no half vector divides (LongT5's 99 keys): its columns padded to
            # whole vectors (as a packed weight's are), not run a lane at a time
            epilogue = pad_axes(sch, block, [1] * (len(axes) - 2) + [lanes, 1], lanes, list(epilogue))
        for rest in self.tiles(sch, block, lanes, knobs, epilogue, padded_columns=packed):
            spatial(sch, rest, target)
        if packed:  # last: a padded layout adds an assume block, which later primitives reject
            _pack_weight(sch, block, weight, knobs["gemm_vecs"] * lanes)
        return sch

    def default_knobs(self, func: tirx.PrimFunc, target: Target) -> dict[str, int] | None:
        """The knobs `apply` uses for ``func`` without a record; None if the rule does not take it."""
        match = self._match(func, target)
        return None if match is None else {k: int(v) for k, v in resolve(KNOBS, match[-1]).items()}

    def _match(self, func: tirx.PrimFunc, target: Target):
        """(schedule, blocks, index of the GEMM block, weight, vector lanes, default knobs) or None."""
        if target.kind.name != "llvm":
            return None
        sch = Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos:
            return None
        reductions = [i for i, info in enumerate(infos) if not info.is_injective()]
        if len(reductions) != 1 or not infos[-1].is_injective() and reductions[0] != len(infos) - 1:
            return None
        at = reductions[0]
        gemm_block = sch.get(infos[at].block_rv)
        operands = gemm_operands(gemm_block)
        if operands is None or operands[2] != self.rows:
            return None
        d_in, weight, _ = operands
        dtype = gemm_block.writes[0].source.dtype
        lanes = vector_lanes(target, str(dtype))
        width = int(gemm_block.iter_vars[-2].dom.extent)
        registers = isa_of(target).registers
        return sch, infos, at, weight, lanes, self.defaults(d_in, width, lanes, dtype.bits, registers)

    tiles = staticmethod(gemm)

    def defaults(self, d_in: int, width: int, lanes: int, bits: int, registers: int = 32) -> dict[str, int]:
        """The projections' tiles; for a wide output (an LM head; measured: the README's "Default
        tiles") with 16-lane vectors and 32 registers 8 rows × 2 vectors, the same 16 accumulators reading half as much
        of the weight panel from L2 per FMA, and for a reduction under `SHORT` (each accumulator is
        stored after a few FMAs, and the tile's store runs faster as 8 rows of two vectors than as 4
        of four: measured in the README's convolution paragraph); with narrower ones 4 × 3 (its
        columns padded to whole tiles where the weight is packed) and 32 tiles of rows per task, so
        that each panel of the weight streams once per 128 rows."""
        knobs = gemm_defaults(d_in, lanes, bits, (width,), registers)
        if (width >= WIDE or d_in < SHORT and "gemm_rows" not in knobs) and lanes >= 16 and registers >= 32:
            knobs.update(gemm_rows=8, gemm_vecs=2)
        elif width >= WIDE:
            knobs.update(gemm_vecs=3, gemm_block_rows=32)
        return knobs


def pad_axes(sch: Schedule, block, factors: list[int], lanes: int, epilogue: list) -> list:
    """``block``'s axes padded to whole multiples of ``factors`` (`pad_einsum`: its operands copied with
    zeros past their ends, each copy parallel over its outer axes and vectorised along its last), the copy
    of the product's real part back joining the ``epilogue``'s first stage, or its only one. Returns the
    epilogue."""
    sch.pad_einsum(block, factors)
    back = sch.get_consumers(block)[0]
    for copy in (b for b in sch.get_producers(block) if sch.get(b).name_hint.endswith("_pad")):
        *outer, inner = sch.get_loops(copy)
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
        sch.vectorize(sch.split(inner, [None, lanes])[1])
    if epilogue:
        sch.compute_inline(back)
        return epilogue
    return [back]


def _chain(sch: Schedule, blocks: list) -> tuple:
    """The epilogue as few blocks as inlining makes it (x · sigmoid(x) reads the GEMM twice: one
    block), so that each reads only its predecessor and can join the tile's store."""
    left = []
    for blk in blocks[:-1]:
        try:
            sch.compute_inline(blk)
        except Exception:  # s_tir.ScheduleError: kept as a block of its own
            left.append(blk)
    return tuple(left + blocks[-1:])


def _pack_weight(sch: Schedule, block, weight, width: int) -> None:
    """Read the constant ``weight`` (c, m) in `pack`'s layout; with a column tail, the tiles compute
    the padding columns too (they are zero and never stored)."""
    index = next(i for i, r in enumerate(sch.get(block).reads) if r.source.same_as(weight))
    padded = int(weight.ty.shape[1]) % width != 0
    sch.transform_layout(block, ("read", index), lambda c, m: (m // width, c, m % width),
                         pad_value=0.0 if padded else None)
    if padded:
        sch.annotate(block, PADDED_AXES, [len(sch.get(block).iter_vars) - 2])


def gemm_operands(block: tirx.SBlock, symbolic_width: bool = False):
    """(c, B's buffer, whether there is a row axis s) when ``block`` is ``C[…, s, m] += A[…, s, c] ·
    B[…, c, m]`` (or, one row, ``C[…, m] += A[…, c] · B[…, c, m]``) with its loops in that order and
    both operands contiguous along their last axis, the width m static (symbolic: ``symbolic_width``);
    else None."""
    store = block.body
    kinds = [iv.iter_type for iv in block.iter_vars]
    if not isinstance(store, tirx.BufferStore) or len(kinds) < 2 or kinds[-1] != tirx.IterVar.CommReduce or \
            any(k != tirx.IterVar.DataPar for k in kinds[:-1]):
        return None
    *spatial_vars, c = [iv.var for iv in block.iter_vars]
    m = spatial_vars[-1]
    indices = [i for i in store.indices if not isinstance(i, tirx.IntImm)]  # unit axes are constants
    if len(indices) != len(spatial_vars) or not all(i.same_as(v) for i, v in zip(indices, spatial_vars)):
        return None
    value = store.value
    if not (isinstance(value, tirx.Add) and isinstance(value.a, TensorLoad)
            and value.a.source.same_as(store.buffer) and isinstance(_uncast(value.b), tirx.Mul)):
        return None
    product = _uncast(value.b)
    loads = [_uncast(product.a), _uncast(product.b)]
    if not all(isinstance(x, TensorLoad) for x in loads):
        return None
    last = [x.indices[-1] for x in loads]
    a, b = (0, 1) if last[0].same_as(c) else (1, 0)
    rows_ok = last[a].same_as(c) and not uses(loads[a], m)
    cols_ok = last[b].same_as(m) and len(loads[b].indices) >= 2 and loads[b].indices[-2].same_as(c)
    s = spatial_vars[-2] if len(spatial_vars) >= 2 else None
    has_rows = s is not None and uses(loads[a], s) and not uses(loads[b], s)
    extent = block.iter_vars[-1].dom.extent
    if not (rows_ok and cols_ok) or isinstance(block.iter_vars[-2].dom.extent, tirx.IntImm) == symbolic_width:
        return None  # a symbolic width: no fixed register tile (`columns.SymbolicColumns`)
    # a symbolic reduction (P·V over a sequence's keys) sizes the task's panels as a long one would
    return int(extent.value) if isinstance(extent, tirx.IntImm) else SYMBOLIC_REDUCTION, loads[b].source, has_rows


def _uncast(expr):
    return expr.value if isinstance(expr, tirx.Cast) else expr

