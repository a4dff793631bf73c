"""A bf16 GEMM (``import_onnx(dtype="bfloat16")``: bf16 activations · a bf16 weight, fp32 accumulation)
on the target's bf16 dot product (its record's `Isa.dot`: AVX512-BF16's ``vdpbf16ps``, two products per
fp32 lane), in the register tiles of `micro_kernels.gemm` as the attention layer's projections run them: the weight, a
constant, packed at compile time into pairs of its rows (c/2, m, 2), each step broadcasting a pair of
x's reduction. The instruction takes no tail predicate: symbolic rows run in whole blocks of 16
(``pad_einsum``: x copied with zero rows past its end); the reduction must be whole pairs and the
width whole vectors. Elsewhere (a record without a dot product, odd sizes, an activation cast inside the
function) the `matmul` rule widens the operands to fp32 FMAs.
"""

from __future__ import annotations

from typing import Mapping

from tvm import tirx
from tvm.s_tir import Schedule
from tvm.target import Target

from tvmattn.compiler.isa import RECORDS
from tvmattn.compiler.passes import keep_operands_16bit
from tvmattn.compiler.target import isa_of
from tvmattn.schedules.cpu.plan import MIN_PAIR_ROWS
from tvmattn.schedules.knobs import resolve
from tvmattn.schedules.micro_kernels import PADDED_ROW_BLOCK, gemm
from tvmattn.schedules.ops.injective import spatial
from tvmattn.schedules.ops.matmul import CONSTANT_PARAMS, KNOBS, Matmul, _chain
from tvmattn.schedules.primitives import divisor_at_most

# x's padded copy keeps its bf16 bits for the instruction (whichever record's dot product reads it)
_READERS = tuple(sorted({reader for isa in RECORDS for reader in isa.packed_readers}))


class MatmulPairs(Matmul):
    passes = (keep_operands_16bit(_READERS),)

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
        *_, rows, width, depth = [iv.dom.extent for iv in stmt.iter_vars]
        constants = func.attrs.get(CONSTANT_PARAMS, []) if func.attrs else []
        if not (any(weight.same_as(func.params[int(i)]) for i in constants) and len(weight.ty.shape) == 2
                and int(depth) % dot.pair == 0 and int(width) % dot.lanes == 0):
            return None
        if isinstance(rows, tirx.IntImm) and rows.value < MIN_PAIR_ROWS:
            return None  # a few rows: the widened tiles read the weight once, as fast
        knobs = resolve(KNOBS, {**defaults, **(knobs or {})})
        tile = knobs["gemm_rows"] if isinstance(knobs["gemm_rows"], int) else defaults["gemm_rows"]
        static = isinstance(rows, tirx.IntImm)
        if not static or divisor_at_most(rows.value, tile) < tile:
            # symbolic rows, or static ones without the tile's rows as a divisor (ViT's 2·197): padded
            _whole_row_blocks(sch, block, len(stmt.iter_vars), lanes)
        steps: list = []
        epilogue = _chain(sch, [info.block_rv for info in infos[at + 1:]])
        for rest in gemm(sch, block, lanes, knobs, epilogue, dot=dot, later=steps):
            spatial(sch, rest, target)
        index = next(i for i, r in enumerate(sch.get(block).reads) if r.source.same_as(weight))
        pair = dot.pair
        sch.transform_layout(block, ("read", index), lambda c, m: (c // pair, m, c % pair))
        sch.annotate(sch.get_loops(block)[0], "pragma_import_llvm", dot.llvm)  # the instruction's definition
        for step in steps:  # last: a tensorized stage leaves the others no stage pipeline
            step()
        return sch


def _bf16_operands(block) -> bool:
    """Both operands bf16, the accumulator fp32."""
    reads = [r.source.dtype for r in block.reads if not r.source.same_as(block.writes[0].source)]
    return str(block.writes[0].source.dtype) == "float32" and len(reads) == 2 and \
        all(str(d) == "bfloat16" for d in reads)


def _whole_row_blocks(sch: Schedule, block, axes: int, lanes: int) -> None:
    """Symbolic rows in whole blocks of `PADDED_ROW_BLOCK` (x padded with zero rows, the extra rows never
    stored), each copy parallel over its rows and vectorised along its columns."""
    sch.pad_einsum(block, [1] * (axes - 3) + [PADDED_ROW_BLOCK, 1, 1])
    for copy in [*sch.get_producers(block), *sch.get_consumers(block)]:
        if sch.get(copy).name_hint.endswith("_pad") or sch.get(copy).name_hint.startswith(sch.get(block).name_hint):
            *outer, inner = sch.get_loops(copy)
            sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
            sch.vectorize(sch.split(inner, [None, lanes])[1])
