"""The NumPy calling path: arrays cross by DLPack without a copy, the kernel writes its result in place
(``out=`` reuses an array), and misaligned or foreign-dtype arrays still give the oracle's answer."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import compiled

import tvmattn
from tvmattn.compiler.kernel import ALIGNMENT, aligned_empty
from tvmattn.compiler.verify import TOLERANCE, errors, random_inputs

SPEC = tvmattn.AttentionSpec(batch="b", seq_len="n", num_heads=2, head_dim=16, projections=False, causal=True)
SIZES = {"b": 2, "n": 21}


def _misaligned(arr: np.ndarray) -> np.ndarray:
    """A copy of ``arr`` whose data starts one element past an aligned boundary."""
    buf = aligned_empty((arr.size + 1,), arr.dtype)
    out = buf[1:].reshape(arr.shape)
    out[...] = arr
    assert out.ctypes.data % ALIGNMENT != 0
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_out_is_written_in_place_and_matches_the_oracle(dtype):
    spec = SPEC.replace(dtype=dtype)
    kernel = compiled(spec)
    q, k, v = random_inputs(spec, SIZES).values()
    out = np.full(q.shape, np.nan, q.dtype)
    got = kernel(q, k, v, out=out)
    assert got is out
    ref = tvmattn.reference(spec, q, k, v)
    assert errors(out, ref)[1] <= TOLERANCE[dtype]


def test_a_new_output_is_aligned_and_misaligned_inputs_give_the_same_result():
    kernel = compiled(SPEC)
    q, k, v = random_inputs(SPEC, SIZES).values()
    fresh = kernel(q, k, v)
    assert fresh.ctypes.data % ALIGNMENT == 0
    # the generated code uses aligned loads: misaligned arrays must be copied, not passed (a crash)
    out = _misaligned(np.zeros_like(fresh))
    got = kernel(*map(_misaligned, (q, k, v)), out=out)
    assert got is out and np.array_equal(out, fresh)


def test_other_dtypes_and_memory_orders_are_converted():
    kernel = compiled(SPEC)
    q, k, v = random_inputs(SPEC, SIZES).values()
    got = kernel(np.asfortranarray(q.astype(np.float64)), k, v)
    assert errors(got, tvmattn.reference(SPEC, q, k, v))[1] <= TOLERANCE["float32"]


@pytest.mark.parametrize("out, message", [
    (np.empty((2, 2, 21, 8), np.float32), "shape"),
    (np.empty((2, 2, 21, 16), np.float64), "dtype float32"),
    (np.empty((2, 2, 16, 21), np.float32).transpose(0, 1, 3, 2), "C-contiguous"),
])
def test_a_wrong_out_is_refused(out, message):
    q, k, v = random_inputs(SPEC, SIZES).values()
    with pytest.raises(tvmattn.TvmAttnError, match=message):
        compiled(SPEC)(q, k, v, out=out)
