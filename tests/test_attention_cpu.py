"""Compiled CPU kernels against the float64 oracle: sweeps over every spec axis, dtypes, symbolic
lengths, extreme logits, keys outside a window and rows that see no key."""

import numpy as np
import pytest
import tvm
from helpers import assert_matches_oracle, compiled
from hypothesis import given, settings
from strategies import cases, specs

import tvmattn
from tvmattn import AttentionSpec, TvmAttnError
from tvmattn.compiler.oracle import reference
from tvmattn.compiler.verify import random_inputs


@settings(max_examples=10)
@given(cases())
def test_random_specs_fp32(case):
    spec, sizes = case
    assert_matches_oracle(compiled(spec), sizes)


@settings(max_examples=8)
@given(cases(dtype=("float16", "bfloat16")))
def test_random_specs_half(case):
    spec, sizes = case
    assert_matches_oracle(compiled(spec), sizes)


@pytest.mark.slow
@settings(max_examples=150)
@given(cases(max_len=130, max_heads=8, max_head_dim=64))
def test_random_specs_fp32_wide(case):
    spec, sizes = case
    assert_matches_oracle(compiled(spec), sizes)


@settings(max_examples=6)
@given(specs(symbolic=True))
def test_one_symbolic_kernel_serves_every_length(spec):
    kernel = compiled(spec)
    for n in (1, 19, 64, 100):
        assert_matches_oracle(kernel, {name: 2 if name == "B" else n + 3 * i
                                       for i, name in enumerate(spec.symbolic_dims)})


def test_symbolic_batch_and_lengths_full_layer():
    spec = AttentionSpec(batch="B", seq_len="n", d_model=48, num_heads=4, causal=True)
    kernel = compiled(spec)
    for sizes in ({"B": 1, "n": 1}, {"B": 3, "n": 47}, {"B": 2, "n": 130}):
        assert_matches_oracle(kernel, sizes)


def test_softmax_is_stable_for_huge_logits():
    spec = AttentionSpec(batch=1, seq_len=40, num_heads=2, head_dim=16, causal=True, projections=False)
    args = random_inputs(spec)
    q = args["q"] * (2e3 / np.abs(args["q"]).max())  # (B, h, n, d_k): logits reach about ±1e4 after the scale
    k = args["k"] * (2e2 / np.abs(args["k"]).max())
    assert_matches_oracle(compiled(spec), q=q, k=k)


def test_keys_outside_the_window_are_hidden():
    """Changing keys and values a query cannot see leaves its row as it was; changing one it sees does not."""
    W, s = 5, 30
    spec = AttentionSpec(batch=1, seq_len=40, num_heads=2, head_dim=16, causal=True, window=W, projections=False)
    kernel = compiled(spec)
    assert_matches_oracle(kernel)
    q, k, v = random_inputs(spec).values()  # (B, h, n, d_k), (B, h, n_kv, d_k), (B, h, n_kv, d_v)
    row = kernel(q, k, v)[:, :, s]
    hidden = np.r_[0:s - W + 1, s + 1:spec.n_kv]
    k2, v2 = k.copy(), v.copy()
    k2[:, :, hidden] += 3.0
    v2[:, :, hidden] -= 3.0
    np.testing.assert_allclose(kernel(q, k2, v2)[:, :, s], row, rtol=1e-6, atol=1e-6)
    v2[:, :, s - W + 1] += 3.0  # the oldest key in the window
    assert np.abs(kernel(q, k2, v2)[:, :, s] - row).max() > 1e-2


@pytest.mark.parametrize("spec, kv_lens", [
    (AttentionSpec(batch=2, seq_len=20, num_heads=2, head_dim=8, key_padding=True, projections=False), [0, 7]),
    (AttentionSpec(seq_len=9, kv_seq_len=4, num_heads=1, head_dim=8, causal=True, causal_align="bottom_right",
                   projections=False), None),
    (AttentionSpec(batch=2, seq_len=33, num_heads=2, head_dim=8, window=3, key_padding=True, causal=True,
                   projections=False), [0, 33]),
])
def test_rows_that_see_no_key_are_zero(spec, kv_lens):
    kernel = compiled(spec)
    inputs = {} if kv_lens is None else {"kv_lens": np.array(kv_lens, np.int32)}
    assert_matches_oracle(kernel, **inputs)
    args = {**random_inputs(spec), **inputs}
    kw = {"kv_lens": args.pop("kv_lens")} if spec.key_padding else {}
    blind = np.all(reference(spec, *args.values(), **kw) == 0, axis=-1)  # (B, h, n)
    out = kernel(*args.values(), **kw)
    assert blind.any() and np.all(out[blind] == 0)


def test_tvm_tensor_path_and_exported_library(tmp_path):
    spec = AttentionSpec(batch=1, seq_len=24, num_heads=2, head_dim=16, causal=True, projections=False)
    kernel = compiled(spec)
    args = random_inputs(spec, seed=5)
    dev = tvm.cpu()
    out = tvm.runtime.empty(spec.output_shape(), "float32", dev)
    kernel.run(*[tvm.runtime.tensor(a, dev) for a in args.values()], out)
    np.testing.assert_array_equal(out.numpy(), kernel(*args.values()))
    path = tmp_path / "attn.so"
    kernel.export_library(str(path))
    loaded = tvm.runtime.load_module(str(path))
    again = tvm.runtime.empty(spec.output_shape(), "float32", dev)
    loaded["main"](*[tvm.runtime.tensor(a, dev) for a in args.values()], again)
    np.testing.assert_array_equal(again.numpy(), out.numpy())
    assert "vfmadd" in kernel.source()  # fused multiply-adds on vector registers


class TestCallingErrors:
    spec = AttentionSpec(batch=2, seq_len="n", d_model=32, num_heads=4, key_padding=True)

    def call(self, *arrays, **kw):
        return compiled(self.spec)(*arrays, **kw)

    def arrays(self, n=5):
        args = random_inputs(self.spec, {"n": n})
        args.pop("kv_lens")
        return list(args.values())

    def test_wrong_count(self):
        with pytest.raises(TvmAttnError, match="takes 5 arrays"):
            self.call(*self.arrays()[:3], kv_lens=[1, 1])

    def test_wrong_shape_names_the_array(self):
        x, *w = self.arrays()
        with pytest.raises(TvmAttnError, match=r"w_q has shape \(32, 16\)"):
            self.call(x, w[0][:, :16], *w[1:], kv_lens=[1, 1])

    def test_missing_and_bad_kv_lens(self):
        with pytest.raises(TvmAttnError, match="pass kv_lens"):
            self.call(*self.arrays())
        with pytest.raises(TvmAttnError, match=r"kv_lens must lie in \[0, 5\]"):
            self.call(*self.arrays(), kv_lens=[1, 6])

    def test_x_kv_only_for_cross_attention(self):
        with pytest.raises(TvmAttnError, match="x_kv is only for"):
            self.call(*self.arrays(), x_kv=self.arrays()[0], kv_lens=[1, 1])

    def test_cross_attention_needs_x_kv(self):
        spec = AttentionSpec(seq_len=3, kv_seq_len=4, d_model=8, num_heads=2)
        args = random_inputs(spec)
        args.pop("x_kv")
        with pytest.raises(TvmAttnError, match="needs x_kv"):
            compiled(spec)(*args.values())


def test_unknown_target_and_knob():
    spec = AttentionSpec(seq_len=8, d_model=16, num_heads=2)
    with pytest.raises(TvmAttnError, match="unknown target 'tpu'"):
        tvmattn.compile(spec, "tpu")
    with pytest.raises(TvmAttnError, match="unknown schedule knob 'tile'"):
        tvmattn.compile(spec, knobs={"tile": 4})
    with pytest.raises(TvmAttnError, match="q_tile=5 is not one of"):
        tvmattn.compile(spec, knobs={"q_tile": 5})
    with pytest.raises(TvmAttnError, match="unknown CUDA arch"):
        tvmattn.compile(spec, "cuda", arch="ampere")
