"""The table of kernel arguments (`compiler.arguments`): what each caller reads from it agrees with the
kernel built from the same spec."""

import numpy as np
import pytest
from helpers import compiled

from tvmattn import AttentionSpec, TvmAttnError
from tvmattn.compiler import arguments
from tvmattn.compiler.tuning import measure

EVERYTHING = AttentionSpec(batch="B", seq_len="n", kv_seq_len="n_kv", d_model=32, num_heads=4, num_kv_heads=2,
                           key_padding=True, causal=True, causal_align="bottom_right", sinks=True, alibi="signed")


@pytest.mark.parametrize("spec", [EVERYTHING, EVERYTHING.replace(projections=False, attn_mask="bool",
                                                                 attn_mask_dims="bt", layout="BSHD")])
def test_the_built_kernel_takes_the_tables_arguments(spec):
    """Names, order, shapes and dtypes of the PrimFunc's parameters are the table's; the draws fit them."""
    func = compiled(spec).module["main"]
    params = func.params[:-1]  # (the last is the output)
    assert [p.name for p in params] == [a.name for a in arguments.taken(spec)]
    for p, (name, shape) in zip(params, spec.input_shapes().items()):
        assert [str(d) for d in p.ty.shape] == [str(d) for d in shape] and p.ty.dtype == spec.input_dtype(name)
    sizes = {"B": 2, "n": 3, "n_kv": 5}
    for name, a in arguments.draw(spec, sizes).items():
        want = tuple(arguments.size_of(d, sizes) for d in spec.input_shapes()[name])
        assert a.shape == want and a.dtype == arguments.numpy_dtype(spec.input_dtype(name)), name


def test_measurement_fills_kv_lens_with_the_key_length():
    """The tuner's runner sets kv_lens to the key count, read from K's shape where it is symbolic."""
    core = EVERYTHING.replace(projections=False)
    assert measure._fills(core) == [(3, (1, 2))]  # kv_lens ← K (B, h_kv, n_kv, d_k)'s axis 2
    assert measure._fills(core.replace(kv_seq_len=64)) == [(3, 64)]
    assert measure._fills(core.replace(key_padding=False)) == []


def test_calls_are_checked_by_the_table():
    spec = EVERYTHING.replace(projections=False, batch=1, seq_len=2, kv_seq_len=3)
    args = arguments.draw(spec)
    arrays, named = arguments.split(spec, args)
    assert [a.shape for a in arrays] == [(1, 4, 2, 8), (1, 2, 3, 8), (1, 2, 3, 8)]
    assert list(named) == ["kv_lens", "sinks", "alibi_slopes"]
    assert list(arguments.arrange(spec, tuple(arrays), named)) == list(args)
    with pytest.raises(TvmAttnError, match="unknown keyword argument 'slopes'"):
        arguments.arrange(spec, tuple(arrays), {**named, "slopes": np.ones(4)})
    with pytest.raises(TvmAttnError, match=r"\(sinks\) needs sinks: pass sinks=\(4\)"):
        arguments.arrange(spec, tuple(arrays), {**named, "sinks": None})
    with pytest.raises(TvmAttnError, match="takes 3 arrays"):
        arguments.arrange(spec, tuple(arrays[:2]), named)
