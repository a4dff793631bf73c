"""Hypothesis strategies for attention specs: every axis of `AttentionSpec`, drawn within its rules.

`specs` draws a spec; `cases` a spec with values for its symbolic lengths (one compiled kernel is
checked at lengths it was not built for). The size limits keep a compile and an oracle run cheap.
"""

from __future__ import annotations

from hypothesis import strategies as st

from tvmattn.compiler.flash import FlashTiles
from tvmattn.compiler.spec import ALIBI_KINDS, CAUSAL_ALIGNS, LAYOUTS, MASK_KINDS, OUTPUTS, AttentionSpec
from tvmattn.compiler.variant import MASK_AXES

HEAD_DIMS = (3, 4, 8, 12, 16, 24, 32, 64)


@st.composite
def specs(draw, dtype: str | tuple[str, ...] = "float32", projections: bool | None = None,
          symbolic: bool | None = None, intermediate: bool = True, max_len: int = 70, max_heads: int = 4,
          max_head_dim: int = 32) -> AttentionSpec:
    """A valid spec. ``dtype``: one, or a tuple to draw from; ``projections``, ``symbolic``: None draws
    them; ``intermediate``: the kernel may return a stage before the attention (scores, logits,
    weights: core kernels only)."""
    heads = draw(st.integers(1, max_heads))
    kv_heads = draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0]))  # MHA, GQA, MQA
    head_dims = [d for d in HEAD_DIMS if d <= max_head_dim]
    head_dim = draw(st.sampled_from(head_dims))
    seq = draw(st.integers(1, max_len))
    kv_seq = draw(st.one_of(st.none(), st.integers(1, max_len)))  # None: self-attention, n_kv = n
    with_projections = draw(st.booleans()) if projections is None else projections
    attn_mask = draw(st.sampled_from((None, *MASK_KINDS)))
    spec = AttentionSpec(
        batch=draw(st.integers(1, 2)), seq_len=seq, kv_seq_len=kv_seq,
        d_model=heads * head_dim if draw(st.booleans()) else draw(st.sampled_from([8, 24, 40])),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        v_head_dim=draw(st.one_of(st.none(), st.sampled_from(head_dims))),
        causal=draw(st.booleans()), causal_align=draw(st.sampled_from(CAUSAL_ALIGNS)),
        window=draw(st.one_of(st.none(), st.integers(1, max_len // 2))), key_padding=draw(st.booleans()),
        attn_mask=attn_mask,
        attn_mask_dims="".join(a for a in MASK_AXES if draw(st.booleans())) if attn_mask else MASK_AXES,
        softcap=draw(st.sampled_from([None, 1.0, 5.0])),
        output="attn" if with_projections or not intermediate else draw(st.sampled_from(OUTPUTS)),
        layout=draw(st.sampled_from(LAYOUTS)),
        dtype=draw(st.sampled_from(dtype)) if isinstance(dtype, tuple) else dtype, projections=with_projections)
    if draw(st.booleans()) if symbolic is None else symbolic:
        spec = spec.replace(batch=draw(st.sampled_from([spec.batch, "B"])), seq_len="n",
                            kv_seq_len=None if kv_seq is None else draw(st.sampled_from(["n", "n_kv"])))
    # (drawn last: the draws before them stay as they were)
    return spec.replace(sinks=draw(st.booleans()), alibi=draw(st.sampled_from((None, *ALIBI_KINDS))))


def lengths(spec: AttentionSpec, max_len: int = 70) -> st.SearchStrategy[dict[str, int]]:
    """Values for the symbolic sizes of ``spec`` ({} when it has none)."""
    return st.fixed_dictionaries({name: st.integers(1, 3 if name == "B" else max_len)
                                  for name in spec.symbolic_dims})


def cases(**kw) -> st.SearchStrategy[tuple[AttentionSpec, dict[str, int]]]:
    """(spec, sizes): a spec from `specs` and values for its symbolic lengths."""
    return specs(**kw).flatmap(lambda spec: st.tuples(st.just(spec), lengths(spec, kw.get("max_len", 70))))


def tiles(q_rows=(1, 16, 32), kv_tile=(8, 16), kv_splits=(1, 2)) -> st.SearchStrategy[FlashTiles]:
    """The online-softmax template's shape (rows per instance, keys per step, split-K)."""
    return st.builds(FlashTiles, q_rows=st.sampled_from(q_rows), kv_tile=st.sampled_from(kv_tile),
                     kv_splits=st.sampled_from(kv_splits))
