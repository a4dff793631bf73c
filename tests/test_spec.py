"""AttentionSpec: derived sizes, the calling convention, and every validation error."""

import pytest

from tvmattn import AttentionSpec, TvmAttnError


def test_derived_sizes_follow_the_seeds():
    spec = AttentionSpec(batch=2, seq_len=10, d_model=768, num_heads=12)
    assert (spec.n_q, spec.n_kv, spec.h, spec.h_kv, spec.d_k, spec.d_v, spec.d) == (10, 10, 12, 12, 64, 64, 768)
    assert spec.softmax_scale == pytest.approx(1 / 8)
    assert not spec.is_cross


def test_gqa_cross_and_head_dim():
    spec = AttentionSpec(seq_len=4, kv_seq_len=9, num_heads=8, num_kv_heads=2, head_dim=16, v_head_dim=8,
                         projections=False, layout="bshd")
    assert spec.layout == "BSHD" and spec.group == 4 and spec.d == 128 and spec.is_cross
    assert spec.input_shapes() == {"q": (1, 4, 8, 16), "k": (1, 9, 2, 16), "v": (1, 9, 2, 8)}
    assert spec.output_shape() == (1, 4, 8, 8)


def test_full_layer_calling_convention():
    spec = AttentionSpec(batch="B", seq_len="n", kv_seq_len="m", d_model=64, num_heads=4, num_kv_heads=2,
                         key_padding=True)
    assert list(spec.input_shapes()) == ["x", "x_kv", "w_q", "w_k", "w_v", "w_o", "kv_lens"]
    assert spec.input_shapes()["w_k"] == (64, 32)
    assert spec.input_shapes()["w_o"] == (64, 64)
    assert spec.output_shape() == ("B", "n", 64)
    assert spec.symbolic_dims == ("B", "n", "m")


def test_dtype_aliases_and_round_trip():
    spec = AttentionSpec(d_model=64, num_heads=4, dtype="bf16", causal=True, window=8)
    assert spec.dtype == "bfloat16"
    assert AttentionSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("fields, words", [
    (dict(d_model=100, num_heads=8), ["d_model=100", "num_heads=8", "head_dim"]),
    (dict(d_model=64, num_heads=8, num_kv_heads=3), ["num_kv_heads=3", "multiple"]),
    (dict(num_heads=8), ["d_model or head_dim"]),
    (dict(d_model=64, num_heads=0), ["num_heads=0", "positive"]),
    (dict(d_model=64, num_heads=4, seq_len=0), ["seq_len=0", "positive"]),
    (dict(d_model=64, num_heads=4, batch=-1), ["batch=-1"]),
    (dict(d_model=64, num_heads=4, seq_len="2n"), ["symbolic size"]),
    (dict(d_model=64, num_heads=4, head_dim=2.5), ["head_dim=2.5"]),
    (dict(d_model=64, num_heads=4, window=0), ["window=0"]),
    (dict(d_model=64, num_heads=4, dtype="int8"), ["unknown dtype", "float16"]),
    (dict(d_model=64, num_heads=4, layout="BSH"), ["unknown layout", "BHSD"]),
    (dict(d_model=64, num_heads=4, causal_align="middle"), ["causal_align", "bottom_right"]),
    (dict(d_model=64, num_heads=4, scale=-1.0), ["scale=-1.0", "positive"]),
    (dict(d_model=64, num_heads=4, scale=float("nan")), ["scale=nan"]),
])
def test_validation_names_the_problem_and_the_fix(fields, words):
    with pytest.raises(TvmAttnError) as err:
        AttentionSpec(**fields)
    for word in words:
        assert word in str(err.value)


def test_replace_revalidates():
    spec = AttentionSpec(d_model=64, num_heads=4)
    with pytest.raises(TvmAttnError, match="num_heads=5"):
        spec.replace(num_heads=5)


def test_unknown_field_in_dict():
    with pytest.raises(TvmAttnError, match="unknown AttentionSpec field"):
        AttentionSpec.from_dict({"d_model": 64, "num_heads": 4, "heads": 4})
