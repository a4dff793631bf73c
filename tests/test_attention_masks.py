"""The spec fields ONNX needs, on the compiled CPU kernel against the oracle: attn_mask tensors (bool
and additive, broadcast along any axes), softcap, and kernels returning an intermediate stage."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, compiled

import tvmattn

BASE = dict(batch=2, seq_len=5, kv_seq_len=7, num_heads=4, num_kv_heads=2, head_dim=8, projections=False)


@pytest.mark.parametrize("fields", [
    dict(attn_mask="bool"),
    dict(attn_mask="additive", attn_mask_dims="st"),
    dict(attn_mask="additive", attn_mask_dims="bt", causal=True),
    dict(attn_mask="bool", attn_mask_dims="hst", layout="BSHD", dtype="float16"),
    dict(softcap=2.0),
    dict(softcap=1.5, attn_mask="additive", key_padding=True, causal=True, causal_align="bottom_right"),
    dict(output="scaled_scores", softcap=2.0),
    dict(output="logits", attn_mask="additive", causal=True),
    dict(output="weights", attn_mask="bool", attn_mask_dims="st", window=3),
], ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_kernel_matches_oracle(fields):
    assert_matches_oracle(compiled(tvmattn.AttentionSpec(**{**BASE, **fields})))


# the mask's tile transposed in registers in blocks of 16 × 16 (`packing.pack_mask`): static lengths in
# whole blocks, or symbolic ones (rows padded to whole blocks, copied first)
@pytest.mark.parametrize("dtype, dims, lengths", [("float32", "bhst", (64, 48)), ("bfloat16", "bst", (64, 48)),
                                                  ("float32", "st", (64, 48)), ("bfloat16", "bhst", ("n", "m"))])
def test_a_mask_tile_in_registers(dtype, dims, lengths):
    kernel = compiled(tvmattn.AttentionSpec(**{**BASE, "seq_len": lengths[0], "kv_seq_len": lengths[1], "dtype": dtype,
                                               "head_dim": 16, "attn_mask": "additive", "attn_mask_dims": dims}))
    assert_matches_oracle(kernel, {"n": 37, "m": 50} if lengths[0] == "n" else None)


def test_symbolic_lengths_with_an_additive_mask():
    spec = tvmattn.AttentionSpec(**{**BASE, "seq_len": "n", "kv_seq_len": "m", "attn_mask": "additive"})
    kernel = compiled(spec)
    for n in (1, 9):
        assert_matches_oracle(kernel, {"n": n, "m": n + 2})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_filled_with_the_lowest_float_sees_every_key_alike(dtype):
    """finfo.min, the fill exporters write, hides nothing in a row it fills entirely: the weights are
    uniform, as in the oracle (and torch, ONNX Runtime); the kernel's base-2 logits must not overflow it
    to -inf (a row that sees no key). Elsewhere it hides its keys."""
    spec = tvmattn.AttentionSpec(**{**BASE, "attn_mask": "additive", "attn_mask_dims": "st", "dtype": dtype})
    bias = np.zeros((1, 1, 5, 7), np.float32)
    bias[0, 0, 2] = np.finfo(np.float32).min
    bias[0, 0, 3, :4] = np.finfo(np.float32).min
    assert_matches_oracle(compiled(spec), attn_mask=bias)


def test_a_row_with_every_key_masked_gives_zeros():
    spec = tvmattn.AttentionSpec(**{**BASE, "attn_mask": "additive", "attn_mask_dims": "st"})
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)))
    bias = np.zeros((1, 1, 5, 7), np.float32)
    bias[0, 0, 2] = -np.inf
    out = tvmattn.compile(spec)(q, k, v, attn_mask=bias)
    assert np.all(out[:, :, 2] == 0) and np.all(np.isfinite(out))


@pytest.mark.parametrize("dims", ["st", "hst"])
def test_non_finite_biases_as_the_oracle_has_them(dims):
    """A NaN bias shows its key (the row turns NaN, as in ONNX Runtime), -inf hides it, +inf is a
    logit of +inf: on the vectorised mask tile too (its test is on -inf's bits: see `variant`)."""
    spec = tvmattn.AttentionSpec(**{**BASE, "seq_len": 37, "kv_seq_len": 37, "attn_mask": "additive",
                                    "attn_mask_dims": dims})
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 4, 37, 8), (2, 2, 37, 8), (2, 2, 37, 8)))
    bias = rng.standard_normal((1, 4 if "h" in dims else 1, 37, 37)).astype(np.float32)
    bias[0, 0, 3, 5], bias[0, -1, 4], bias[0, -1, 6, ::2], bias[0, 0, 7, 9] = np.nan, -np.inf, -np.inf, np.inf
    got = tvmattn.compile(spec)(q, k, v, attn_mask=bias)
    want = tvmattn.reference(spec, q, k, v, attn_mask=bias)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[:, 0, 3]).all()
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fields, message", [
    (dict(attn_mask="maybe"), "unknown attn_mask"),
    (dict(attn_mask="bool", attn_mask_dims="bx"), "attn_mask_dims"),
    (dict(softcap=-1.0), "softcap"),
    (dict(output="probs"), "unknown output"),
    (dict(output="weights", projections=True, d_model=32), "projections=False"),
])
def test_invalid_fields(fields, message):
    with pytest.raises(tvmattn.TvmAttnError, match=message):
        tvmattn.AttentionSpec(**{**BASE, **fields})


def test_calling_without_the_mask_says_what_to_pass():
    kernel = tvmattn.compile(tvmattn.AttentionSpec(**{**BASE, "attn_mask": "bool", "attn_mask_dims": "st"}))
    q = np.zeros((2, 4, 5, 8), np.float32)
    kv = np.zeros((2, 2, 7, 8), np.float32)
    with pytest.raises(tvmattn.TvmAttnError, match=r"attn_mask=\(1, 1, 5, 7\)"):
        kernel(q, kv, kv)
