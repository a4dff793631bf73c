"""The float64 NumPy reference every generated kernel is checked against.

Written from the seeds, independently of the tensor expression: plain array operations, its own mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.spec import AttentionSpec

if TYPE_CHECKING:
    from tvmattn.compiler.paged import PagedSpec


def reference(spec: AttentionSpec, *arrays: np.ndarray, x_kv: np.ndarray | None = None,
              kv_lens: np.ndarray | None = None, attn_mask: np.ndarray | None = None,
              sinks: np.ndarray | None = None, alibi_slopes: np.ndarray | None = None,
              alibi_keys_only: bool = False) -> np.ndarray:
    """Attention of ``spec`` on ``arrays`` and the keywords, as a kernel of ``spec`` is called, in float64.

    For ``spec.output`` other than "attn", the requested (B, h, n, n_kv) stage instead.
    ``alibi_keys_only``: a signed ALiBi as BLOOM writes it, slope·j (`alibi_bias`).
    """
    a = [np.asarray(x, dtype=np.float64) for x in arrays]
    if spec.projections:
        x, (w_q, w_k, w_v, w_o) = a[0], a[1:]
        x_kv = x if x_kv is None else np.asarray(x_kv, dtype=np.float64)
        q = _split_heads(x @ w_q, spec.h)        # (B, h, n, d_k)
        k = _split_heads(x_kv @ w_k, spec.h_kv)  # (B, h_kv, n_kv, d_k)
        v = _split_heads(x_kv @ w_v, spec.h_kv)  # (B, h_kv, n_kv, d_v)
    else:
        q, k, v = a
        if spec.layout == "BSHD":
            q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    o = core(spec, q, k, v, kv_lens, attn_mask, sinks, alibi_slopes, alibi_keys_only)  # (B, h, n, d_v)
    if spec.output != "attn":
        return o
    if spec.projections:
        B, h, n, d_v = o.shape
        return o.transpose(0, 2, 1, 3).reshape(B, n, h * d_v) @ w_o
    return o.transpose(0, 2, 1, 3) if spec.layout == "BSHD" else o


def core(spec: AttentionSpec, q: np.ndarray, k: np.ndarray, v: np.ndarray,
         kv_lens: np.ndarray | None = None, attn_mask: np.ndarray | None = None,
         sinks: np.ndarray | None = None, alibi_slopes: np.ndarray | None = None,
         alibi_keys_only: bool = False) -> np.ndarray:
    """softmax(cap(scale·q·kᵀ) + alibi + mask)·v for q (B,h,n,d_k), k (B,h_kv,n_kv,d_k), v (B,h_kv,n_kv,d_v).

    ``attn_mask`` broadcasts to (B, h, n, n_kv): True/False for a bool mask, a float bias otherwise.
    ``sinks`` (h,): each head's sink logit, a column of the softmax whose weight multiplies no value.
    ``alibi_slopes`` (h,): each head's ALiBi slope (`alibi_bias`).
    """
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = spec.softmax_scale * (q @ k.transpose(0, 1, 3, 2))  # (B, h, n, n_kv)
    if spec.softcap is not None:
        scores = spec.softcap * np.tanh(scores / spec.softcap)
    allowed = allowed_keys(spec, q.shape[0], q.shape[2], k.shape[2], kv_lens)  # (B, 1, n, n_kv)
    logits = scores
    if spec.alibi is not None:
        logits = scores + alibi_bias(spec, alibi_slopes, q.shape[0], q.shape[2], k.shape[2], kv_lens, alibi_keys_only)
    if spec.attn_mask == "bool":
        allowed = allowed & np.asarray(attn_mask, dtype=bool)
    elif spec.attn_mask == "additive":
        bias = np.asarray(attn_mask, dtype=np.float64)
        allowed = allowed & (bias != -np.inf)
        with np.errstate(invalid="ignore"):  # inf - inf where hidden; np.where drops it
            logits = logits + bias
    logits = np.where(allowed, logits, -np.inf)
    if spec.sinks:  # the sink as one more key, always visible, dropped after the softmax
        sink = np.broadcast_to(np.asarray(sinks, np.float64).reshape(1, -1, 1, 1), logits.shape[:3] + (1,))
        logits = np.concatenate([logits, sink], axis=-1)
    row_max = logits.max(axis=-1, keepdims=True)  # NaN where a NaN is in the row: it propagates
    row_max = np.where(np.isneginf(row_max), 0.0, row_max)  # a row with no visible key
    with np.errstate(invalid="ignore"):  # inf - inf where a logit is +inf: NaN, as the references give
        weights = np.exp(logits - row_max)
    total = weights.sum(axis=-1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total != 0)
    if spec.sinks:
        logits, weights = logits[..., :-1], weights[..., :-1]
    stage = {"scaled_scores": scores, "logits": logits, "weights": weights}.get(spec.output)
    return weights @ v if stage is None else stage


def allowed_keys(spec: AttentionSpec, batch: int, n: int, n_kv: int,
                 kv_lens: np.ndarray | None) -> np.ndarray:
    """Boolean (B, 1, n, n_kv): may query row i attend to key column j."""
    lens = np.full(batch, n_kv) if kv_lens is None else np.asarray(kv_lens).reshape(batch)
    i = np.arange(n)[None, :, None]
    j = np.arange(n_kv)[None, None, :]
    L = lens[:, None, None]
    pos = i + (L - n if spec.causal_align == "bottom_right" else 0)  # where query i sits among keys
    ok = np.ones((batch, n, n_kv), dtype=bool)
    if spec.causal:
        ok &= j <= pos
    if spec.window is not None:
        ok &= j > pos - spec.window
        if not spec.causal:
            ok &= j < pos + spec.window
    if spec.key_padding:
        ok &= j < L
    return ok[:, None]


def alibi_bias(spec: AttentionSpec, slopes: np.ndarray, batch: int, n: int, n_kv: int,
               kv_lens: np.ndarray | None, keys_only: bool = False) -> np.ndarray:
    """(B, h, n, n_kv): ALiBi's bias, slope_h·(j − pos(i)) ("signed") or −slope_h·|j − pos(i)|
    ("symmetric"), pos(i) query i's position among the keys (bottom-right: i + L − n); ``keys_only``:
    the signed bias as BLOOM computes it, slope_h·j (the same softmax: a constant per row)."""
    lens = np.full(batch, n_kv) if kv_lens is None else np.asarray(kv_lens).reshape(batch)
    i = np.arange(n)[None, :, None]
    j = np.arange(n_kv)[None, None, :]
    pos = i + (lens[:, None, None] - n if spec.causal_align == "bottom_right" else 0)
    if keys_only and spec.alibi != "signed":
        raise TvmAttnError("only a signed ALiBi has a key-position form (slope·j)")
    if keys_only:
        distance = np.broadcast_to(j, (batch, n, n_kv))
    else:
        distance = j - pos if spec.alibi == "signed" else -np.abs(j - pos)
    return np.asarray(slopes, np.float64).reshape(1, -1, 1, 1) * distance[:, None].astype(np.float64)


def paged_reference(spec: "PagedSpec", q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_table: np.ndarray, cache_seqlens: np.ndarray, cu_seqlens_q: np.ndarray | None = None,
                    sinks: np.ndarray | None = None, alibi_slopes: np.ndarray | None = None) -> np.ndarray:
    """Attention over a paged cache (`paged.PagedSpec`) in float64, (B, n, h, d): each sequence's
    pages gathered into a dense cache padded to the longest, then `core` with its length as kv_lens.
    Ragged queries (``q_len=None``): (total_q, h, d), each sequence on its own, its queries
    q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]."""
    if spec.ragged:
        out = np.zeros(np.shape(q))
        for b in range(len(cache_seqlens)):
            lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            if hi > lo:
                out[lo:hi] = paged_reference(spec.replace(q_len=hi - lo), np.asarray(q)[None, lo:hi], k_cache,
                                             v_cache, block_table[b:b + 1], cache_seqlens[b:b + 1], None, sinks,
                                             alibi_slopes)[0]
        return out
    lens = np.asarray(cache_seqlens, np.int64).reshape(-1)
    batch, longest = len(lens), max(int(lens.max(initial=0)), 1)
    dense = [np.zeros((batch, spec.h_kv, longest, spec.head_dim)) for _ in range(2)]
    for b, length in enumerate(lens):
        for cache, out in zip((k_cache, v_cache), dense):
            out[b, :, :length] = _gathered(spec, np.asarray(cache, np.float64), block_table[b], int(length))
    q = np.asarray(q, np.float64).transpose(0, 2, 1, 3)  # (B, h, n, d)
    o = core(spec.attention, q, *dense, lens, None, sinks, alibi_slopes)
    return o.transpose(0, 2, 1, 3)


def _gathered(spec: "PagedSpec", cache: np.ndarray, pages: np.ndarray, length: int) -> np.ndarray:
    """(h_kv, length, d): key t is row t % P of page pages[t // P], as a Python loop over keys."""
    out = np.zeros((spec.h_kv, length, spec.head_dim))
    for t in range(length):
        page, row = int(pages[t // spec.page_size]), t % spec.page_size
        out[:, t] = cache[page, row] if spec.kv_layout == "NHD" else cache[page, :, row]
    return out


def _split_heads(y: np.ndarray, heads: int) -> np.ndarray:
    """(B, n, heads·w) → (B, heads, n, w)."""
    B, n, m = y.shape
    return y.reshape(B, n, heads, m // heads).transpose(0, 2, 1, 3)
