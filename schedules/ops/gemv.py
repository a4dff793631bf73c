"""One-row GEMM (a decode step's projections with a static batch of one): ``C[…, m] = Σ_c A[…, c] ·
B[…, c, m]``, fused as `matmul` fuses. Parallel over column tiles, each a few vectors of accumulators
streaming its panel of the (packed) weight; the weight's rows are contiguous, so the vectors run along
columns, not along the reduction (TVM dlight's CPU GEMV, later in the list, takes that layout)."""

from __future__ import annotations

from tvmattn.schedules.micro_kernels import gemv
from tvmattn.schedules.ops.matmul import Matmul


class Gemv(Matmul):
    rows = False
    tiles = staticmethod(gemv)

