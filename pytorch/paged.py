"""`flash_attn_with_kvcache`: FlashAttention's decode function (``flash_attn.flash_attn_with_kvcache``)
on tvmattn's paged decode kernel (`paged.PagedSpec`), and `flash_attn_varlen_func` (ragged batches, no
padding) on its ragged prefill kernel; CPU tensors read in place.

The cache is paged (``block_table`` given: k_cache (num_blocks, page_size, H_k, D)) or contiguous
(k_cache (B, S_cache, H_k, D), read as pages of its rows: a view, no copy).
"""

from __future__ import annotations

import functools
import math

import torch

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.paged import MAX_PAGE, PagedSpec, check_pages, check_queries, with_unused
from tvmattn.torch.cache import KERNELS
from tvmattn.torch.flash import _window
from tvmattn.torch.plan import DTYPES


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                            cache_seqlens: int | torch.Tensor | None = None,
                            cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                            block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
                            num_splits: int = 0, return_softmax_lse: bool = False,
                            kv_layout: str = "NHD") -> torch.Tensor:
    """FlashAttention 2's ``flash_attn_with_kvcache`` on a tvmattn kernel (CPU, forward only).

    q (B, S_q, H, D); k_cache, v_cache (num_blocks, page_size, H_k, D) with ``block_table`` (B,
    max_blocks) int32, or (B, S_cache, H_k, D) without; ``cache_seqlens`` (B,) int32 or an int: each
    sequence's keys before this call (None: the whole cache). ``k``, ``v`` (B, S_new, H_k, D), if given,
    are written into the cache in place at cache_seqlens (the caller advances cache_seqlens after, as
    with FlashAttention); the queries then attend to cache_seqlens + S_new keys, the last S_q of them
    their own positions (``causal`` and ``window_size`` are aligned bottom-right). ``softcap`` > 0,
    ``alibi_slopes`` (H,) or (B, H) float32 and ``softmax_scale`` as in `flash_attn_func`.
    ``kv_layout="HND"`` (tvmattn's, not FlashAttention's): a paged cache (num_blocks, H_k, page_size, D),
    vLLM's CPU layout.

    Where it differs: no rotary embedding, ``cache_batch_idx`` or ``cache_leftpad`` (apply them before),
    ``return_softmax_lse`` False; ``num_splits`` is ignored (the kernel splits the keys over the cores
    itself). A page index that a sequence's length reaches outside the cache is a TvmAttnError.
    """
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_batch_idx", cache_batch_idx),
                        ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise TvmAttnError(f"{name} is not supported by tvmattn's flash_attn_with_kvcache: apply it to q, k "
                               f"and the cache before the call, and leave {name}=None")
    if return_softmax_lse:
        raise TvmAttnError("return_softmax_lse=True: tvmattn's kernels return the attention output only")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v)):
        raise TvmAttnError("tvmattn attention has no backward: run it under torch.no_grad() or torch.inference_mode()")
    _check(q, k_cache, v_cache, k, v, block_table, kv_layout)
    batch, q_len, heads, head_dim = q.shape
    k_pages, v_pages, table = _pages(k_cache, v_cache, block_table, batch, kv_layout)
    lens = _lengths(cache_seqlens, batch, table.shape[1] * (k_pages.shape[1 if kv_layout == "NHD" else 2]))
    new = 0 if k is None else k.shape[1]
    spec = _spec(q, k_pages, kv_layout, causal, window_size, softcap, alibi_slopes, softmax_scale)
    total = lens + new
    check_pages(spec, table.numpy(), total.numpy(), k_pages.shape[0])  # before anything is written
    if new:
        _append(spec, k_pages, v_pages, table, lens, k, v)
    out = q.new_empty(q.shape)
    kernel = KERNELS.get(spec)
    q_in = q.contiguous()
    slopes = None if alibi_slopes is None else alibi_slopes.detach().to(torch.float32).contiguous()
    if slopes is not None and slopes.dim() == 2 and bool((slopes == slopes[:1]).all()):
        slopes = slopes[0]
    rows = [slice(b, b + 1) for b in range(batch)] if slopes is not None and slopes.dim() == 2 else [slice(None)]
    for r in rows:  # (B, H) slopes that differ: a call per sequence (the kernel's slopes are per head)
        s = None if slopes is None else slopes[r.start] if slopes.dim() == 2 else slopes
        args = with_unused(spec, {"q": q_in[r], "k_cache": k_pages, "v_cache": v_pages, "block_table": table[r],
                                  "cache_seqlens": total[r], **({} if s is None else {"alibi_slopes": s})},
                           _zeros(heads))
        kernel.run(*args.values(), out[r])
    return out


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: torch.Tensor | None = None,
                           kv_layout: str = "NHD", sinks: torch.Tensor | None = None) -> torch.Tensor:
    """FlashAttention 2's ``flash_attn_varlen_func`` on tvmattn's ragged prefill kernel (CPU, forward only).

    q (total_q, H, D) holds sequence b's queries at rows cu_seqlens_q[b] … cu_seqlens_q[b + 1] − 1;
    k, v (total_k, H_k, D) its keys at cu_seqlens_k[b] …, or, with ``block_table`` (B, max_blocks)
    int32, a paged cache (num_blocks, page_size, H_k, D) holding cu_seqlens_k[b + 1] − cu_seqlens_k[b]
    keys of sequence b. No padding: each sequence attends to its own keys, ``causal`` and windows
    aligned bottom-right; ``softcap``, ``alibi_slopes`` (H,) float32 and ``softmax_scale`` as in
    `flash_attn_func`. → (total_q, H, D). ``max_seqlen_k`` sizes the block table of packed keys.
    ``sinks`` (H,), tvmattn's own keyword: each head's attention-sink logit (gpt-oss's ``s_aux``).
    """
    if dropout_p != 0.0 or return_attn_probs:
        raise TvmAttnError("dropout_p > 0 and return_attn_probs=True: tvmattn's kernels are for inference and "
                           "return the attention output only")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v)):
        raise TvmAttnError("tvmattn attention has no backward: run it under torch.no_grad() or torch.inference_mode()")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
            raise TvmAttnError(f"{name} must be int32 (B + 1,) offsets, got {getattr(cu, 'shape', type(cu))}")
    if alibi_slopes is not None and alibi_slopes.dim() != 1:
        raise TvmAttnError("alibi_slopes must be (H,) float32 here: one slope per head for every sequence")
    if q.dim() != 3 or k.dim() != (3 if block_table is None else 4):
        raise TvmAttnError(f"q {tuple(q.shape)} must be (total_q, H, D) and k {tuple(k.shape)} (total_k, H_k, D), "
                           f"or with block_table a paged cache (num_blocks, page_size, H_k, D)")
    batch = cu_seqlens_q.shape[0] - 1
    lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).contiguous()
    _check(q[None], k if k.dim() == 4 else k[None], v if v.dim() == 4 else v[None], None, None, None, kv_layout)
    if block_table is not None and (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32
                                    or block_table.dim() != 2 or block_table.shape[0] != batch):
        raise TvmAttnError(f"block_table must be int32 (B={batch}, max_blocks), got "
                           f"{getattr(block_table, 'shape', type(block_table))}")
    if block_table is None:  # packed keys: a pool of one-key pages, sequence b's from cu_seqlens_k[b] on
        if kv_layout != "NHD":
            raise TvmAttnError("kv_layout='HND' is for a paged cache: pass block_table")
        width = max(int(max_seqlen_k), 1)
        block_table = (cu_seqlens_k[:-1, None] + torch.arange(width, dtype=torch.int32)[None, :]).contiguous()
        k, v = k.unsqueeze(1), v.unsqueeze(1)
    k_pages, v_pages, table = _pages(k, v, block_table, batch, kv_layout)
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (q.shape[1],)):
        raise TvmAttnError(f"sinks must be one logit per query head, ({q.shape[1]},)")
    spec = _spec(q[None], k_pages, kv_layout, causal, window_size, softcap, alibi_slopes, softmax_scale,
                 sinks is not None).replace(q_len=None)
    check_pages(spec, table.numpy(), lens.numpy(), k_pages.shape[0])
    check_queries(cu_seqlens_q.numpy(), batch, q.shape[0])
    out = q.new_empty(q.shape)
    args = with_unused(spec, {"q": q.contiguous(), "k_cache": k_pages, "v_cache": v_pages, "block_table": table,
                              "cache_seqlens": lens, "cu_seqlens_q": cu_seqlens_q.contiguous(),
                              **({} if alibi_slopes is None else {"alibi_slopes": alibi_slopes.detach().to(
                                  torch.float32).contiguous()}),
                              **({} if sinks is None else {"sinks": sinks.detach().to(torch.float32).contiguous()})},
                      _zeros(q.shape[1]))
    KERNELS.get(spec).run(*args.values(), out)
    return out


_ZERO_SLOPES: dict[int, torch.Tensor] = {}


def _zeros(heads: int) -> torch.Tensor:
    return _ZERO_SLOPES.setdefault(heads, torch.zeros(heads, dtype=torch.float32))


def _check(q, k_cache, v_cache, k, v, block_table, kv_layout: str) -> None:
    """FlashAttention's refusals, as TvmAttnErrors."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise TvmAttnError(f"{name} must be a 4-D torch.Tensor, got {got}")
        if t.device.type != "cpu":
            raise TvmAttnError(f"{name} is on {t.device}: tvmattn's paged kernel runs on the CPU")
        if t.dtype != q.dtype or q.dtype not in DTYPES:
            raise TvmAttnError(f"{name} is {t.dtype} and q {q.dtype}: give them one dtype of float32, float16, "
                               f"bfloat16")
    if (k is None) != (v is None):
        raise TvmAttnError("give both k and v (the new tokens to append), or neither")
    kv_heads = k_cache.shape[1 if kv_layout == "HND" else 2]
    if k is not None and (k.shape[0] != q.shape[0] or k.shape[2:] != (kv_heads, k_cache.shape[3])
                          or v.shape != k.shape):
        raise TvmAttnError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (B, S_new, H_k, D) as q "
                           f"{tuple(q.shape)} and the cache {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise TvmAttnError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    if block_table is not None and (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32
                                    or block_table.dim() != 2 or block_table.shape[0] != q.shape[0]):
        got = f"{tuple(block_table.shape)} {block_table.dtype}" if isinstance(block_table, torch.Tensor) else \
            type(block_table).__name__
        raise TvmAttnError(f"block_table must be int32 (B={q.shape[0]}, max_blocks), got {got}")


def _pages(k_cache, v_cache, block_table, batch: int, kv_layout: str):
    """The cache as pages and the block table: a paged cache as it is, a contiguous one (B, S, H_k, D)
    viewed as B·S/P pages of P rows (P the largest power of two to 256 dividing S), in order."""
    if kv_layout not in ("NHD", "HND"):
        raise TvmAttnError(f"kv_layout={kv_layout!r}: use NHD (FlashAttention's) or HND (vLLM's CPU layout)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise TvmAttnError("k_cache and v_cache must be contiguous: the kernel reads them in place and the new "
                           "tokens are written into them")
    if block_table is not None:
        return k_cache, v_cache, block_table.contiguous()
    if kv_layout != "NHD" or k_cache.shape[0] != batch:
        raise TvmAttnError(f"without block_table the cache is (B={batch}, S_cache, H_k, D) (NHD), got "
                           f"{tuple(k_cache.shape)} {kv_layout}")
    length = k_cache.shape[1]
    page = math.gcd(length, MAX_PAGE) if length else 1
    table = torch.arange(batch * length // page, dtype=torch.int32).view(batch, length // page)
    shape = (batch * length // page, page, *k_cache.shape[2:])
    return k_cache.view(shape), v_cache.view(shape), table


def _lengths(cache_seqlens, batch: int, reach: int) -> torch.Tensor:
    if cache_seqlens is None:
        return torch.full((batch,), reach, dtype=torch.int32)
    if isinstance(cache_seqlens, int):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32)
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.shape != (batch,) or \
            cache_seqlens.dtype != torch.int32:
        got = f"{tuple(cache_seqlens.shape)} {cache_seqlens.dtype}" if isinstance(cache_seqlens, torch.Tensor) \
            else type(cache_seqlens).__name__
        raise TvmAttnError(f"cache_seqlens must be an int or int32 ({batch},), got {got}")
    return cache_seqlens


def _spec(q, k_pages, kv_layout, causal, window_size, softcap, alibi_slopes, softmax_scale,
          sinks: bool = False) -> PagedSpec:
    batch, q_len, heads, head_dim = q.shape
    page = k_pages.shape[1] if kv_layout == "NHD" else k_pages.shape[2]
    kv_heads = k_pages.shape[2] if kv_layout == "NHD" else k_pages.shape[1]
    if not (math.isfinite(softcap) and softcap >= 0):
        raise TvmAttnError(f"softcap={softcap!r}: 0 (none) or a positive cap")
    if alibi_slopes is not None and (not isinstance(alibi_slopes, torch.Tensor)
                                     or alibi_slopes.shape not in ((heads,), (batch, heads))):
        raise TvmAttnError(f"alibi_slopes must be float32 of shape ({heads},) or ({batch}, {heads})")
    return _spec_of(heads, kv_heads, head_dim, page, kv_layout, q_len, DTYPES[q.dtype], bool(causal),
                    tuple(int(w) for w in window_size), float(softcap), alibi_slopes is not None,
                    None if softmax_scale is None else float(softmax_scale), sinks)


@functools.lru_cache(maxsize=256)
def _spec_of(heads: int, kv_heads: int, head_dim: int, page: int, kv_layout: str, q_len: int, dtype: str, causal: bool,
             window_size: tuple[int, int], softcap: float, alibi: bool, scale: float | None,
             sinks: bool = False) -> PagedSpec:
    """The spec of a call, made once per kind of call (building and validating one costs more than a
    small decode step's kernel)."""
    causal, window = _window(causal, window_size)
    return PagedSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page, kv_layout=kv_layout,
                     q_len=q_len, dtype=dtype, causal=causal, window=window, softcap=softcap or None,
                     alibi="symmetric" if alibi else None, scale=scale, sinks=sinks)


def _append(spec: PagedSpec, k_pages, v_pages, table, lens, k, v) -> None:
    """k, v (B, S_new, H_k, D) written at positions lens … lens + S_new − 1 of each sequence."""
    pos = lens.to(torch.int64)[:, None] + torch.arange(k.shape[1])[None, :]  # (B, S_new)
    page = table.to(torch.int64).gather(1, pos // spec.page_size)
    row = pos % spec.page_size
    for cache, new in ((k_pages, k), (v_pages, v)):
        if spec.kv_layout == "NHD":
            cache[page, row] = new
        else:
            cache[page, :, row] = new
