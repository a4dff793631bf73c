"""The NumPy calling path: arrays cross by DLPack without a copy, the kernel writes its result in place
(``out=`` reuses an array), at any element offset, and foreign-dtype arrays still give the oracle's answer."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import compiled

import tvmattn
from tvmattn.compiler.verify import TOLERANCE, errors, random_inputs

SPEC = tvmattn.AttentionSpec(batch="b", seq_len="n", num_heads=2, head_dim=16, projections=False, causal=True)
SIZES = {"b": 2, "n": 21}
# static, so that bf16 takes the vdpbf16ps path (where the CPU has it) and fp32 the packed panels
STATIC = tvmattn.AttentionSpec(batch=1, seq_len=32, num_heads=2, head_dim=16, projections=False)


def _one_element_past_a_cache_line(arr: np.ndarray) -> np.ndarray:
    """A copy of ``arr`` whose data starts one element past a 64-byte boundary (as a slice of a bigger
    array can): TVM's own buffers are 64-byte aligned, and code assuming that would crash on it."""
    buf = np.empty(arr.nbytes + 64 + arr.itemsize, np.uint8)
    start = -buf.ctypes.data % 64 + arr.itemsize
    out = buf[start:start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
    out[...] = arr
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


@pytest.mark.parametrize("spec", [SPEC, STATIC, STATIC.replace(dtype="bfloat16"), STATIC.replace(causal=True)],
                         ids=["symbolic", "static", "static-bf16", "static-causal"])
def test_arrays_at_any_element_offset_cross_without_a_copy(spec):
    kernel = compiled(spec)
    arrays = [_one_element_past_a_cache_line(a) for a in random_inputs(spec, SIZES).values()]
    crossing, _ = kernel._arguments(tuple(arrays), {})
    assert all(np.shares_memory(a, b) for a, b in zip(arrays, crossing.values()))
    ref = tvmattn.reference(spec, *arrays)
    out = _one_element_past_a_cache_line(np.zeros(ref.shape, arrays[0].dtype))
    assert kernel(*arrays, out=out) is out
    assert errors(out, ref)[1] <= TOLERANCE[spec.dtype]


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


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_tensor_comes_back_to_numpy_without_a_copy(dtype):
    """``host_array`` (an imported model's outputs: a 16-bit cache's present_*) views a tensor's memory,
    bf16 included, which NumPy's DLPack does not know."""
    from tvmattn.compiler.kernel import host_array, host_tensor, numpy_dtype

    x = np.random.default_rng(0).standard_normal((3, 5, 7)).astype(numpy_dtype(dtype))
    back = host_array(host_tensor(x))
    assert back.dtype == x.dtype and back.shape == x.shape and np.shares_memory(back, x)
    assert np.array_equal(back.view(np.uint8), x.view(np.uint8))
