"""`tvmattn.torch.scaled_dot_product_attention` against `torch.nn.functional.scaled_dot_product_attention`
itself: shapes, leading batch dims, masks and their broadcasts, causal, GQA, dtypes, non-contiguous views
and tensors at an element offset into their storage (they cross without a copy)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
F = torch.nn.functional

from helpers import every_other_slow  # noqa: E402

import tvmattn  # noqa: E402
from tvmattn.compiler.verify import TOLERANCE  # noqa: E402
from tvmattn.torch import KERNELS, scaled_dot_product_attention  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def reference(query, key, value, attn_mask=None, **kw):
    """torch's SDPA on float32 copies of the inputs."""
    up = [t if t is None or t.dtype == torch.bool else t.float() for t in (query, key, value, attn_mask)]
    return F.scaled_dot_product_attention(*up[:3], attn_mask=up[3], **kw)


def assert_close(out, ref, dtype: str) -> None:
    assert out.shape == ref.shape and out.dtype == DTYPES[dtype]
    err = (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
    assert err <= TOLERANCE[dtype], f"max rel error {err:.3g} > {TOLERANCE[dtype]} ({dtype})"


def view(t, how: str):
    """The same values as ``t`` (…, h, L, E), in the memory order ``how`` names."""
    if how == "transposed":  # a (…, L, h, E) tensor seen as (…, h, L, E), as after .transpose(1, 2)
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)
    if how == "strided":  # every other element of a wider last axis: no layout reads it in place
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if how == "offset":  # contiguous, one element into its storage (as a slice of a bigger tensor)
        shifted = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
        return shifted.copy_(t)
    return t


@st.composite
def calls(draw):
    dtype = draw(st.sampled_from(list(DTYPES)))
    lead = draw(st.sampled_from([(), (2,), (2, 3)]))
    heads, kv_heads = draw(st.sampled_from([(2, 2), (4, 2), (4, 1)]))
    q_len, kv_len = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    head_dim = draw(st.sampled_from([8, 16]))
    v_head_dim = draw(st.sampled_from([head_dim, 8]))
    masking = draw(st.sampled_from(["none", "causal", "bool", "additive"]))
    full = (*lead, heads, q_len, kv_len)
    # which score axes the mask has (size 1 elsewhere), and how many leading axes it leaves out (torch
    # wants at least (L, S))
    keep = draw(st.lists(st.booleans(), min_size=len(full), max_size=len(full)))
    mask_shape = tuple(n if on else 1 for n, on in zip(full, keep))[draw(st.integers(0, len(lead) + 1)):]
    return dict(dtype=dtype, lead=lead, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
                head_dim=head_dim, v_head_dim=v_head_dim, masking=masking, mask_shape=mask_shape,
                how=draw(st.sampled_from(["contiguous", "transposed", "strided", "offset"])),
                seed=draw(st.integers(0, 99)))


def make(c: dict):
    gen = torch.Generator().manual_seed(c["seed"])
    dt = DTYPES[c["dtype"]]

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dt)

    q = rand(*c["lead"], c["heads"], c["q_len"], c["head_dim"])
    k = rand(*c["lead"], c["kv_heads"], c["kv_len"], c["head_dim"])
    v = rand(*c["lead"], c["kv_heads"], c["kv_len"], c["v_head_dim"])
    mask = None
    if c["masking"] in ("bool", "additive"):
        hidden = torch.rand(*c["mask_shape"], generator=gen) < 0.2
        mask = ~hidden if c["masking"] == "bool" else torch.randn(*c["mask_shape"], generator=gen).masked_fill(
            hidden, float("-inf")).to(dt)
    return q, k, v, mask


@settings(max_examples=12)  # (-m slow: 200, below)
@given(calls())
def test_matches_torch_sdpa(c):
    check_against_torch(c)


@pytest.mark.slow
@settings(max_examples=200)
@given(calls())
def test_matches_torch_sdpa_wide(c):
    check_against_torch(c)


def check_against_torch(c: dict) -> None:
    q, k, v, mask = make(c)
    kw = dict(is_causal=c["masking"] == "causal", enable_gqa=c["heads"] != c["kv_heads"])
    with torch.no_grad():
        out = scaled_dot_product_attention(*(view(t, c["how"]) for t in (q, k, v)), attn_mask=mask, **kw)
    assert_close(out, reference(q, k, v, mask, **kw), c["dtype"])


def test_explicit_scale_and_two_dim_inputs():
    q, k, v = torch.randn(7, 16), torch.randn(5, 16), torch.randn(5, 8)
    out = scaled_dot_product_attention(q, k, v, scale=0.3)
    assert_close(out, reference(q, k, v, scale=0.3), "float32")


def test_transposed_views_are_read_in_place_and_one_kernel_serves_every_length():
    KERNELS.clear()
    for batch, n, m in ((1, 8, 63), (3, 5, 33), (2, 7, 50)):
        q, k, v = (torch.randn(batch, length, 4, 16).transpose(1, 2) for length in (n, m, m))
        out = scaled_dot_product_attention(q, k, v)
        assert_close(out, reference(q, k, v), "float32")
    (key,) = KERNELS.keys()
    assert (key.layout, key.q_len) == ("BSHD", None)
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_head_widths_padded_for_the_tiles(force, layout, monkeypatch, request):
    """bf16 heads of 80 (Phi-2's) run on a kernel of 96 where the host has tile registers
    (`build.head_widths`): q, k and v copied with zero columns, the output copied without them (its
    strides as unpadded), the scale 1/√80. ``force`` pads on any CPU, so that the padding is checked
    everywhere against torch's SDPA."""
    from tvmattn.compiler.build import head_widths
    from tvmattn.compiler.target import resolve_target
    from tvmattn.torch import plan as torch_plan
    if force:
        monkeypatch.setattr(torch_plan, "head_widths", lambda spec, _target: spec.replace(
            head_dim=96, v_head_dim=96, scale=spec.softmax_scale))
    torch_plan._head_widths.cache_clear()  # (decided once per key: neither decision may outlive the test)
    request.addfinalizer(torch_plan._head_widths.cache_clear)
    KERNELS.clear()
    for batch, n in ((2, 40), (1, 70)):
        q, k, v = (torch.randn(batch, n, 4, 80).to(torch.bfloat16) for _ in range(3))
        if layout == "BHSD":
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        with torch.no_grad():
            out = scaled_dot_product_attention(q, k, v, is_causal=True)
        assert_close(out, reference(q, k, v, is_causal=True), "bfloat16")
        assert (out.transpose(1, 2) if layout == "BSHD" else out).is_contiguous()  # strided as unpadded
    (key,) = KERNELS.keys()
    unpadded = tvmattn.AttentionSpec(batch="b", seq_len="n", kv_seq_len="m", num_heads=4, head_dim=80,
                                     causal=True, layout=layout, dtype="bfloat16", projections=False)
    assert key.head_dim == (96 if force or head_widths(unpadded, resolve_target("cpu")) else 80)
    assert key.spec().softmax_scale == pytest.approx(80 ** -0.5)


def test_a_row_that_sees_no_key_gives_zeros_as_torch_does():
    # torch 2.13 gives zeros too (its older releases gave NaN); tvmattn's kernels always did
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1] = False
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (out[:, :, 1] == 0).all() and (F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[:, :, 1] == 0).all()
    assert_close(out, reference(q, k, v, mask), "float32")


@pytest.mark.parametrize("q_len, kv_len", [(0, 5), (3, 0)])
def test_empty_lengths(q_len, kv_len):
    out = scaled_dot_product_attention(torch.randn(2, q_len, 8), torch.randn(2, kv_len, 8), torch.randn(2, kv_len, 4))
    assert out.shape == (2, q_len, 4) and (out == 0).all()


Q, K = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)


@pytest.mark.parametrize("args, kwargs, message", [
    ((Q, K, K), dict(dropout_p=0.1), "dropout_p=0.1"),
    ((Q, K, K), {}, "enable_gqa=True"),
    ((Q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8)), dict(enable_gqa=True), "multiple"),
    ((Q, Q, Q), dict(attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True), "is_causal"),
    ((Q, Q, Q), dict(attn_mask=torch.ones(3, 4, dtype=torch.bool)), "does not broadcast"),
    ((Q, Q, Q), dict(attn_mask=torch.zeros(3, 3, dtype=torch.float64)), "bool .* or the query's dtype"),
    ((Q, Q.half(), Q), {}, "one dtype"),
    ((Q.double(), Q.double(), Q.double()), {}, "float32, float16 or bfloat16"),
    ((Q, torch.randn(1, 4, 5, 4), torch.randn(1, 4, 5, 8)), {}, "head size"),
    ((Q, torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)), {}, "leading"),
    ((Q, Q, Q), dict(scale=-1.0), "positive"),
    ((Q.clone().requires_grad_(), Q, Q), {}, "no backward"),
    ((Q, Q, Q), dict(sinks=torch.zeros(3)), r"sinks must be .* shape \(4,\)"),
])
def test_refused_arguments(args, kwargs, message):
    with pytest.raises(tvmattn.TvmAttnError, match=message):
        scaled_dot_product_attention(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_matches_torch_sdpa(dtype):
    q, k, v = (torch.randn(2, 8, n, 64, device="cuda", dtype=DTYPES[dtype]) for n in (100, 130, 130))
    assert_close(scaled_dot_product_attention(q, k, v, is_causal=True), reference(q, k, v, is_causal=True), dtype)


def sinks_reference(q, k, v, sinks, mask):
    """gpt-oss's attention with sinks, on torch's ops: the sink as one more column of the softmax, dropped."""
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, -torch.inf)
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return weights @ v.repeat_interleave(group, 1)


@pytest.mark.parametrize("causal,dtype", every_other_slow([False, True], ["float32", "bfloat16"]))
def test_sinks_keyword_as_gpt_oss_computes_them(causal, dtype):
    """``sinks=`` (h,): as gpt-oss's eager attention; a zero-weight test: without the sinks the result
    differs by far more than the tolerance."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g).to(DTYPES[dtype]) for n in (9, 11, 11))
    sinks = torch.randn(4, generator=g) + 1.0
    mask = torch.ones(9, 11, dtype=torch.bool).tril(2) if causal else torch.ones(9, 11, dtype=torch.bool)
    want = sinks_reference(*(t.float() for t in (q, k, v)), sinks, mask)
    kw = dict(attn_mask=mask) if causal else {}
    assert_close(scaled_dot_product_attention(q, k[:, ::2], v[:, ::2], enable_gqa=True, sinks=sinks, **kw),
                 sinks_reference(*(t.float() for t in (q, k[:, ::2], v[:, ::2])), sinks, mask), dtype)
    out = scaled_dot_product_attention(q, k, v, sinks=sinks, **kw)
    assert_close(out, want, dtype)
    assert (scaled_dot_product_attention(q, k, v, **kw).float() - want).abs().max() > 0.1
