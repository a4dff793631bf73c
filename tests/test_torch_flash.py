"""`tvmattn.torch.flash_attn_func` against FlashAttention's own test reference (``attention_ref`` in
flash-attention's tests/test_flash_attn.py, restated here in float32 torch): bottom-right causal,
(left, right) windows, soft cap, ALiBi slopes (H,) and (B, H), GQA, decode, dtypes; its custom op
under torch.compile; its errors."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from tvmattn import TvmAttnError  # noqa: E402
from tvmattn.compiler.verify import TOLERANCE  # noqa: E402
from tvmattn.torch import KERNELS, flash_attn_func  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def attention_ref(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, scale=None):
    """FlashAttention's reference: (B, S, H, D) in float32; masks and ALiBi aligned bottom-right."""
    q, k, v = (t.float() for t in (q, k, v))
    (_, sq, heads, d), sk = q.shape, k.shape[1]
    k, v = (t.repeat_interleave(heads // k.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bthd,bshd->bhts", q * (scale or 1 / math.sqrt(d)), k)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        window_size = (window_size[0], 0)
    row, col = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    hidden = torch.zeros(sq, sk, dtype=torch.bool)
    if window_size[0] >= 0 or window_size[1] >= 0:
        right = col > row + sk - sq + window_size[1] if window_size[1] >= 0 else hidden
        left = col < row + sk - sq - window_size[0] if window_size[0] >= 0 else hidden
        hidden = right | left
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().reshape(-1 if alibi_slopes.dim() == 2 else 1, heads)[:, :, None, None]
        if causal:  # (flash-attention's reference: a constant per row off the symmetric distance)
            scores = scores + torch.arange(-sk + 1, 1).float() * slopes
        else:
            scores = scores - slopes * (row + sk - sq - col).abs().float()
    scores = scores.masked_fill(hidden, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees no key: zeros
    return torch.einsum("bhts,bshd->bthd", weights, v)


def case(dtype="float32", batch=2, sq=37, sk=45, heads=4, kv_heads=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, heads, d, generator=gen).to(DTYPES[dtype])
    k, v = (torch.randn(batch, sk, kv_heads, d, generator=gen).to(DTYPES[dtype]) for _ in range(2))
    return q, k, v


def slopes(heads, batch=None):
    s = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)
    return s if batch is None else torch.stack([s * (1 + b) for b in range(batch)])


@pytest.mark.parametrize("shape, dtype, kw", [
    (dict(), "float32", dict(causal=True, alibi_slopes=slopes(4))),
    (dict(), "float32", dict(alibi_slopes=slopes(4, batch=2))),  # per sequence
    (dict(sq=50, sk=30), "float32", dict(causal=True, alibi_slopes=slopes(4))),  # rows before the keys: zeros
    (dict(), "float32", dict(window_size=(3, 3), softcap=5.0, softmax_scale=0.3)),
    (dict(heads=8, kv_heads=1), "bfloat16", dict(causal=True, window_size=(5, 0), alibi_slopes=slopes(8))),
    (dict(sq=1, sk=300), "float16", dict(causal=True, alibi_slopes=slopes(4, batch=2))),  # a decode step
    (dict(sq=1, sk=300), "float32", dict(window_size=(-1, 0), alibi_slopes=slopes(4))),  # (−1, 0) is causal
], ids=["causal-alibi-gqa", "alibi-per-sequence", "more-queries-than-keys", "window-softcap", "bf16-window-mqa",
        "fp16-decode", "decode-window-causal"])
def test_matches_flash_attentions_reference(shape, dtype, kw):
    q, k, v = case(dtype, **shape)
    with torch.no_grad():
        out = flash_attn_func(q, k, v, **kw)
    ref = attention_ref(q, k, v, **{("scale" if a == "softmax_scale" else a): x for a, x in kw.items()})
    assert out.shape == ref.shape and out.dtype == q.dtype
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= TOLERANCE[dtype], err


def test_one_kernel_serves_every_length_in_place():
    KERNELS.clear()
    for sq, sk in ((8, 63), (5, 33), (7, 50)):
        q, k, v = case(sq=sq, sk=sk)
        assert torch.allclose(flash_attn_func(q, k, v, causal=True), attention_ref(q, k, v, causal=True), atol=1e-5)
    (key,) = KERNELS.keys()
    assert (key.layout, key.q_len, key.causal_align) == ("BSHD", None, "bottom_right")


def test_compiles_as_one_custom_op():
    q, k, v = case()
    s = slopes(4)
    attend = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True, alibi_slopes=s), fullgraph=True,
                           backend="aot_eager")
    torch.testing.assert_close(attend(q, k, v), attention_ref(q, k, v, causal=True, alibi_slopes=s), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("kw, message", [
    (dict(window_size=(3, 1)), r"windows are symmetric"),
    (dict(dropout_p=0.1), "no dropout"),
    (dict(return_attn_probs=True), "output only"),
    (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes must be float32 of shape \(4,\) or \(2, 4\)"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), "must be float32"),
    (dict(softcap=-1.0), "softcap=-1.0"),
])
def test_refusals_are_clear(kw, message):
    with pytest.raises(TvmAttnError, match=message):
        flash_attn_func(*case(), **kw)
