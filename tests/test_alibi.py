"""ALiBi as a variant (`AttentionSpec.alibi`): compiled CPU kernels against the float64 oracle with every
axis it meets (causal tile skipping, windows, GQA, decode, sinks, softcap, 16-bit, symbolic lengths),
against BLOOM's own formulation (slope·j), and its skipped key tiles. The hypothesis sweeps of
test_attention_cpu.py and test_cuda.py draw it as any other axis."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from helpers import assert_matches_oracle, compiled

from tvmattn import AttentionSpec, TvmAttnError, schedules
from tvmattn.compiler import arguments, passes
from tvmattn.compiler.oracle import reference
from tvmattn.compiler.target import resolve_target
from tvmattn.compiler.verify import TOLERANCE, errors, random_inputs

CORE = dict(num_heads=4, head_dim=16, projections=False)


@pytest.mark.parametrize("spec, sizes", [
    (AttentionSpec(seq_len=70, causal=True, num_kv_heads=2, window=20, alibi="signed", **CORE), {}),
    (AttentionSpec(batch=2, seq_len=1, kv_seq_len=300, causal=True, causal_align="bottom_right", key_padding=True,
                   alibi="signed", **CORE), {}),  # a decode step: one query after each sequence's keys
    (AttentionSpec(seq_len=1, kv_seq_len="n_kv", causal=True, causal_align="bottom_right", alibi="symmetric",
                   num_kv_heads=1, **CORE), {"n_kv": 517}),
    (AttentionSpec(seq_len="n", causal=True, sinks=True, softcap=5.0, alibi="signed", layout="BSHD", **CORE),
     {"n": 45}),
    (AttentionSpec(batch=2, seq_len=33, kv_seq_len=40, key_padding=True, causal_align="bottom_right", alibi="symmetric",
                   attn_mask="additive", attn_mask_dims="bt", **CORE), {}),
    (AttentionSpec(seq_len=50, d_model=64, num_heads=4, causal=True, alibi="signed", dtype="bfloat16"), {}),
    (AttentionSpec(seq_len=64, kv_seq_len=80, causal=True, causal_align="bottom_right", alibi="symmetric",
                   dtype="float16", **CORE), {}),
], ids=["window-gqa", "decode-padded", "decode-symbolic", "sinks-softcap-bshd", "mask-padded", "layer-bf16",
        "fp16-bottom-right"])
def test_alibi_kernels_match_oracle(spec, sizes):
    assert_matches_oracle(compiled(spec), sizes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_signed_alibi_is_blooms_slope_times_key_position(dtype):
    """The kernel adds slope·(j − i); BLOOM adds slope·j (`reference(…, alibi_keys_only=True)`): one softmax."""
    spec = AttentionSpec(batch=2, seq_len=90, causal=True, key_padding=True, alibi="signed", dtype=dtype, **CORE)
    args = random_inputs(spec, seed=3)
    arrays, named = arguments.split(spec, args)
    want = reference(spec, *arrays, **named, alibi_keys_only=True)
    assert errors(compiled(spec)(*arrays, **named), want)[1] <= TOLERANCE[dtype]


def test_the_slopes_change_the_result():
    """Slopes of 0 are plain attention, and steep ones are not."""
    spec = AttentionSpec(seq_len=40, causal=True, alibi="signed", **CORE)
    plain = compiled(spec.replace(alibi=None))
    q, k, v, slopes = random_inputs(spec).values()
    np.testing.assert_allclose(compiled(spec)(q, k, v, alibi_slopes=np.zeros(4)), plain(q, k, v), rtol=1e-6, atol=1e-6)
    assert np.abs(compiled(spec)(q, k, v, alibi_slopes=slopes * 8) - plain(q, k, v)).max() > 0.1


def _key_loops(spec: AttentionSpec) -> list[str]:
    """The loop extents of the scheduled kernel after tile skipping, and its guards (symbolic lengths)."""
    sch, _ = schedules.schedule(spec, resolve_target("cpu"))
    mod = passes.skip_masked_key_tiles(spec)(sch.mod)
    found = []
    tvm_ffi.structural_walk(mod["main"].body, [(tvm.tirx.For, lambda f: found.append(str(f.extent)))])
    return found + [line.strip() for line in mod.script().splitlines() if passes.GUARD_NAME in line]


@pytest.mark.parametrize("fields", [dict(seq_len=256, causal=True), dict(seq_len="n", causal=True, window=64)])
def test_alibi_keeps_tile_skipping(fields):
    """The key loops of an ALiBi kernel are tightened exactly as those of the same spec without it."""
    spec = AttentionSpec(**fields, **CORE)
    assert _key_loops(spec.replace(alibi="signed")) == _key_loops(spec)
    assert _key_loops(spec) != _key_loops(spec.replace(causal=False, window=None))


def test_alibi_arguments_are_checked():
    spec = AttentionSpec(seq_len=8, alibi="signed", **CORE)
    q, k, v, slopes = random_inputs(spec).values()
    with pytest.raises(TvmAttnError, match=r"needs alibi_slopes: pass alibi_slopes=\(4\)"):
        compiled(spec)(q, k, v)
    with pytest.raises(TvmAttnError, match=r"alibi_slopes has shape \(3,\)"):
        compiled(spec)(q, k, v, alibi_slopes=slopes[:3])
    with pytest.raises(TvmAttnError, match="alibi_slopes is only for a spec with alibi"):
        compiled(spec.replace(alibi=None))(q, k, v, alibi_slopes=slopes)
    with pytest.raises(TvmAttnError, match="unknown alibi 'bloom'"):
        spec.replace(alibi="bloom")
