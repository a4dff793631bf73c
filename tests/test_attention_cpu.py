"""Compiled CPU kernels against the float64 oracle: sweeps over shapes and masks, dtypes, symbolic
lengths, extreme logits and rows that see no key."""

import numpy as np
import pytest
import tvm
import tvmattn
from helpers import compiled
from hypothesis import given, settings
from strategies import specs
from tvmattn import AttentionSpec, TvmAttnError
from tvmattn.compiler.oracle import reference
from tvmattn.compiler.verify import TOLERANCE, check, random_inputs


def assert_matches_oracle(kernel, sizes=None, seed=0):
    result = check(kernel, sizes, seed)
    assert result.ok, result.line() + " for " + kernel.spec.describe()


@given(specs())
def test_random_specs_fp32(spec):
    assert_matches_oracle(tvmattn.compile(spec))


@settings(max_examples=8)
@given(specs(dtype="float16"))
def test_random_specs_fp16(spec):
    assert_matches_oracle(tvmattn.compile(spec))


@settings(max_examples=8)
@given(specs(dtype="bfloat16"))
def test_random_specs_bf16(spec):
    assert_matches_oracle(tvmattn.compile(spec))


@settings(max_examples=6)
@given(specs(symbolic=True))
def test_one_symbolic_kernel_serves_every_length(spec):
    kernel = tvmattn.compile(spec)
    for n in (1, 19, 64, 100):
        assert_matches_oracle(kernel, {name: n + 3 * i for i, name in enumerate(spec.symbolic_dims)})


def test_symbolic_batch_and_lengths_full_layer():
    spec = AttentionSpec(batch="B", seq_len="n", d_model=48, num_heads=4, causal=True)
    kernel = compiled(spec)
    for sizes in ({"B": 1, "n": 1}, {"B": 3, "n": 47}, {"B": 2, "n": 130}):
        assert_matches_oracle(kernel, sizes)


def test_softmax_is_stable_for_huge_logits():
    spec = AttentionSpec(batch=1, seq_len=40, num_heads=2, head_dim=16, causal=True, projections=False)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in spec.input_shapes().values())
    q *= 2e3 / np.abs(q).max()  # logits reach about ±1e4 after the 1/sqrt(d_k) scale
    k *= 2e2 / np.abs(k).max()
    out = compiled(spec)(q, k, v)
    ref = reference(spec, q, k, v)
    assert np.all(np.isfinite(out))
    assert np.abs(out - ref).max() <= TOLERANCE["float32"] * np.abs(ref).max()


@pytest.mark.parametrize("spec, kv_lens", [
    (AttentionSpec(batch=2, seq_len=20, num_heads=2, head_dim=8, key_padding=True, projections=False), [0, 7]),
    (AttentionSpec(seq_len=9, kv_seq_len=4, num_heads=1, head_dim=8, causal=True, causal_align="bottom_right",
                   projections=False), None),
    (AttentionSpec(batch=2, seq_len=33, num_heads=2, head_dim=8, window=3, key_padding=True, causal=True,
                   projections=False), [0, 33]),
])
def test_rows_that_see_no_key_are_zero(spec, kv_lens):
    args = random_inputs(spec)
    args.pop("kv_lens", None)
    kw = {"kv_lens": np.array(kv_lens, np.int32)} if kv_lens is not None else {}
    out = compiled(spec)(*args.values(), **kw)
    ref = reference(spec, *args.values(), **kw)
    blind = np.all(ref == 0, axis=-1)
    assert blind.any() and np.all(out[blind] == 0) and np.all(np.isfinite(out))
    assert np.abs(out - ref).max() <= TOLERANCE["float32"] * np.abs(ref).max()


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
