"""One-row GEMM (a decode step's projections with a static batch of one): ``C[…, m] = Σ_c A[…, c] ·
B[…, c, m]``, fused as `matmul` fuses. Parallel over column tiles, each a few vectors of accumulators
streaming its panel of the (packed) weight; the weight's rows are contiguous, so the vectors run along
columns, not along the reduction (TVM dlight's CPU GEMV, later in the list, takes that layout)."""

from __future__ import annotations

from tvmattn.schedules import cpu
from tvmattn.schedules.ops.matmul import Matmul


class Gemv(Matmul):
    passes = ()
    rows = False
    tiles = staticmethod(cpu.gemv)

    def defaults(self, d_in: int, lanes: int, bits: int) -> dict[str, int]:
        """Two vectors per column tile: twice the parallel tasks of four, and measured faster here for
        both cache-resident and streamed weights (768 × 3072: 0.09 vs 0.12 ms; 768 × 50257: 5.1 vs 8.9 ms)."""
        return {"gemm_vecs": 2}
