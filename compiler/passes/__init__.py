"""TIR passes tvmattn runs on scheduled PrimFuncs (attention kernels, model functions) before TVM lowers them.

skip_masked_key_tiles  Tighten every key loop to the keys its queries can see (causal, window,
                       padding), so fully masked key tiles are never computed. TE reductions have fixed
                       extents and no schedule primitive can make a loop's extent depend on an outer
                       loop; this pass does it on the scheduled TIR, reading the mask from the spec.
pad_query_tiles        Drop the query-tail predicates (``s < n``) of the stages computed inside a query
                       tile: the tail tile computes all its rows (the padding rows are never stored), so
                       the register tiles and per-row loops vectorise also when n is symbolic.
clamp_row_tails        For a register tile of a GEMM with a row tail (``row < M``, M symbolic): the tile's
                       compute tests only its first row and reads row min(row, M - 1) of its inputs; the
                       store of the tile keeps the full test.
peel_key_tails         In a loop of symbolic extent whose blocks test a tail (``t < n_kv``, from a split by
                       a constant factor), run the iterations before the tail without the tests.
unclamp_whole_vectors  A vectorised loop reading at a clamped index along the vector (``min(t, n_kv - 1)``,
                       a padded copy) runs its whole vectors unclamped: plain loads, not gathers.
element_aligned_arguments
                       Declare the arguments aligned to their elements, not to TVM's 64 bytes: NumPy
                       arrays (16-byte aligned) and views at any element offset then cross without a
                       copy; the code generator emits unaligned vector moves, as fast on aligned data.
interleave_tile_epilogues
                       A tile GEMM's epilogue of one accumulator block computed between the next block's
                       tile products, a slice a reduction step: the vector units and the tiles overlap.
stack_tiles            The register tiles a pass names (`clamp_row_tails`, `register_tiles_on_stack`) on
                       the stack, not in TVM's workspace: LLVM then keeps them in registers.
register_tiles_on_stack
                       Name every local buffer of a scheduled function (a bf16 GEMM's register tiles)
                       for `stack_tiles`.
one_parallel_launch    Start a statement list's consecutive parallel loops in one launch of TVM's thread
                       pool, a barrier between them (each launch wakes the pool's sleeping workers).
polynomial_math        Replace fp32 ``exp``, ``sigmoid``, ``tanh``, ``erf`` and small integer powers by
                       vectorisable polynomials (LLVM would otherwise call scalar libm per lane).
vector_exp2            After vectorisation: fp32 ``exp2`` as a polynomial, on a whole vector register as
                       the target's instruction set lowers it (`Isa.exp2`).
narrow_bf16            Round fp32 vectors to bf16 by the instruction set's conversion (``vcvtneps2bf16``),
                       not TVM's six integer operations.
exact_widenings        Read an fp32 copy of 16-bit values as the copy, not narrowed and widened again.
keep_operands_16bit    Keep a kernel's own bf16 buffers 16 bits wide (TVM's legaliser widens them to fp32)
                       where an instruction reads them as bits or the schedule asks for it.

By module: `key_tiles` (skip_masked_key_tiles, tighten_guarded_loops), `tails` (pad_query_tiles,
clamp_row_tails, peel_key_tails, unclamp_whole_vectors), `launch` (element_aligned_arguments,
one_parallel_launch, stack_tiles, register_tiles_on_stack), `tile_epilogue` (interleave_tile_epilogues),
`polynomials` (polynomial_math, vector_exp2), `storage16` (exact_widenings, keep_operands_16bit), and `ir`,
the helpers they share. A schedule rule declares which of them its kernels need (`passes`).
"""

from tvmattn.compiler.passes.ir import conjuncts, element_dtype, substitute, uses, visit_blocks
from tvmattn.compiler.passes.key_tiles import GUARD_NAME, KEY_BLOCKS, skip_masked_key_tiles, tighten_guarded_loops
from tvmattn.compiler.passes.launch import (
    element_aligned_arguments,
    one_parallel_launch,
    register_tiles_on_stack,
    stack_tiles,
)
from tvmattn.compiler.passes.narrow import narrow_bf16
from tvmattn.compiler.passes.polynomials import (
    EXP2_COEFFICIENTS,
    EXP2_P,
    EXP2_P_BF16,
    SMALL_POWER,
    polynomial_math,
    vector_exp2,
)
from tvmattn.compiler.passes.storage16 import KEEP_16BIT, exact_widenings, keep_operands_16bit
from tvmattn.compiler.passes.tails import (
    PADDED_AXES,
    clamp_row_tails,
    pad_query_tiles,
    peel_key_tails,
    unclamp_whole_vectors,
)
from tvmattn.compiler.passes.tile_epilogue import interleave_tile_epilogues

__all__ = [
    "EXP2_COEFFICIENTS", "EXP2_P", "EXP2_P_BF16", "GUARD_NAME", "KEEP_16BIT", "KEY_BLOCKS", "PADDED_AXES",
    "SMALL_POWER", "clamp_row_tails", "conjuncts", "element_aligned_arguments", "element_dtype", "exact_widenings",
    "interleave_tile_epilogues", "keep_operands_16bit", "narrow_bf16", "one_parallel_launch", "pad_query_tiles",
    "peel_key_tails", "polynomial_math", "register_tiles_on_stack", "skip_masked_key_tiles", "stack_tiles",
    "substitute", "tighten_guarded_loops", "unclamp_whole_vectors", "uses", "vector_exp2", "visit_blocks",
]
