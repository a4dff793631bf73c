"""Hypothesis strategies for attention specs: the shapes and masks the foundation must handle."""

from __future__ import annotations

from hypothesis import strategies as st
from tvmattn.compiler.spec import AttentionSpec


@st.composite
def specs(draw, dtype: str = "float32", projections: bool | None = None, symbolic: bool = False) -> AttentionSpec:
    heads = draw(st.integers(1, 8))
    kv_heads = draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0]))
    head_dim = draw(st.sampled_from([3, 4, 8, 12, 16, 32, 64]))
    seq = draw(st.integers(1, 130))
    kv_seq = draw(st.one_of(st.none(), st.integers(1, 130)))
    with_projections = draw(st.booleans()) if projections is None else projections
    d_model = heads * head_dim if draw(st.booleans()) else draw(st.sampled_from([8, 24, 40]))
    spec = AttentionSpec(
        batch=draw(st.integers(1, 3)), seq_len=seq, kv_seq_len=kv_seq, d_model=d_model, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, causal=draw(st.booleans()),
        causal_align=draw(st.sampled_from(["top_left", "bottom_right"])),
        window=draw(st.one_of(st.none(), st.integers(1, 40))), key_padding=draw(st.booleans()),
        layout=draw(st.sampled_from(["BHSD", "BSHD"])), dtype=dtype, projections=with_projections)
    if symbolic:
        spec = spec.replace(seq_len="n", kv_seq_len=None if kv_seq is None else "n_kv")
    return spec
