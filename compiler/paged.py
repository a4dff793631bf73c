"""`PagedSpec`: attention over a paged KV cache (vLLM, FlashAttention's ``block_table``), as a value.

Each sequence's keys and values live in fixed-size pages of one shared pool, addressed through a
block table, and the sequences of a batch have their own lengths (no padding):

    q             (B, n, h, d)                      the spec's dtype   n new tokens per sequence (decode: 1)
    k_cache       NHD (pages, P, h_kv, d)           the spec's dtype   FlashAttention's, FlashInfer's NHD
                  HND (pages, h_kv, P, d)                              vLLM's CPU backend, TVM's cache
    v_cache       as k_cache
    block_table   (B, max_pages) int32              page j of sequence b is k_cache[block_table[b, j]]
    cache_seqlens (B,) int32                        sequence b's keys: 0 … cache_seqlens[b] − 1
    sinks, alibi_slopes (h,) float32                as in `arguments.TABLE`
    out           (B, n, h, d)

Key t of sequence b is row t % P of page block_table[b, t // P]. Entries of the block table past a
sequence's length are never read (they may hold anything). The n queries sit at the end of their
sequence (bottom-right: query s at position L − n + s), as a decode step's do after appending.

The variants (GQA/MQA, causal, window, softcap, ALiBi, sinks) are the dense spec's: `attention` is
the `AttentionSpec` of the same attention over the gathered cache, which `variant`'s hooks and the
oracle's paged reference read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from tvmattn.compiler import arguments
from tvmattn.compiler.arguments import Argument, numpy_dtype
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.kernel import CompiledAttention
from tvmattn.compiler.spec import DTYPES, AttentionSpec, Heads

KV_LAYOUTS = ("NHD", "HND")
MAX_PAGE = 256


@dataclass(frozen=True)
class PagedSpec(Heads):
    """One attention over a paged KV cache (see the module docstring). The batch, the pool's page
    count and the block table's width are symbolic: one kernel serves every batch and cache."""

    num_heads: int = 8
    num_kv_heads: int | None = None  # None: num_heads
    head_dim: int = 128
    page_size: int = 16  # a power of two from 1 to 256
    kv_layout: str = "NHD"
    q_len: int | None = 1  # queries per sequence (a decode step: 1); None: ragged, packed (`cu_seqlens_q`)
    dtype: str = "float32"
    causal: bool = False
    window: int | None = None
    softcap: float | None = None
    alibi: str | None = None  # None, "signed" or "symmetric"
    sinks: bool = False
    scale: float | None = None

    ARGUMENTS: ClassVar[tuple[Argument, ...]]  # the kernel's arguments (set below: `TABLE`)

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str) and self.dtype.lower() in DTYPES:
            object.__setattr__(self, "dtype", DTYPES[self.dtype.lower()])
        if isinstance(self.kv_layout, str):
            object.__setattr__(self, "kv_layout", self.kv_layout.upper())
        self.validate()

    @property
    def attention(self) -> AttentionSpec:
        """The same attention over the gathered (dense, padded) cache: what the variant hooks and the
        oracle read. Keys past a sequence's length are padding (``kv_lens``)."""
        return AttentionSpec(batch="b", seq_len="n" if self.q_len is None else self.q_len, kv_seq_len="m",
                             num_heads=self.num_heads,
                             num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, causal=self.causal,
                             causal_align="bottom_right", window=self.window, key_padding=True, layout="BSHD",
                             dtype=self.dtype, projections=False, scale=self.scale, softcap=self.softcap,
                             sinks=self.sinks, alibi=self.alibi)

    def cache_shape(self, pages: Any = "num_pages") -> tuple:
        if self.kv_layout == "NHD":
            return (pages, self.page_size, self.h_kv, self.head_dim)
        return (pages, self.h_kv, self.page_size, self.head_dim)

    def input_shapes(self) -> dict[str, tuple]:
        return {a.name: a.shape(self) for a in arguments.taken(self)}

    def input_dtype(self, name: str) -> str:
        return next(a for a in TABLE if a.name == name).dtype(self)

    @property
    def ragged(self) -> bool:
        """Queries packed as (total_q, h, d), sequence b's from cu_seqlens_q[b] (a ragged prefill)."""
        return self.q_len is None

    def output_shape(self) -> tuple:
        return self.query_shape()

    def query_shape(self) -> tuple:
        return ("total_q", self.h, self.head_dim) if self.ragged else ("b", self.q_len, self.h, self.head_dim)

    def validate(self) -> "PagedSpec":
        """Raise TvmAttnError naming the first impossible field and how to fix it."""
        p = self.page_size
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= MAX_PAGE or p & (p - 1):
            raise TvmAttnError(f"page_size={p!r}: use a power of two from 1 to {MAX_PAGE} (vLLM's and "
                               f"FlashAttention's caches use 16)")
        if self.kv_layout not in KV_LAYOUTS:
            raise TvmAttnError(f"unknown kv_layout {self.kv_layout!r}: use NHD (pages, page_size, h_kv, d) or "
                               f"HND (pages, h_kv, page_size, d)")
        if self.q_len is not None and (isinstance(self.q_len, bool) or not isinstance(self.q_len, int)
                                       or self.q_len <= 0):
            raise TvmAttnError(f"q_len={self.q_len!r} must be a positive integer (a decode step: 1), or None "
                               f"(ragged queries, packed, with cu_seqlens_q)")
        self.attention.validate()  # heads, head_dim, dtype, variants: the dense spec's own checks
        return self

    def replace(self, **changes: Any) -> "PagedSpec":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        dense = self.attention.describe()
        queries = "ragged queries" if self.ragged else f"n={self.q_len}"
        return f"paged {self.kv_layout} page={self.page_size} {queries} " + dense[dense.index(" d=") + 1:]


# ---- the kernel's arguments (`arguments.Argument` rows, as the dense spec's table) -----------------
def _cache_draw(spec: PagedSpec, rng: np.random.Generator, shape: tuple, sizes) -> np.ndarray:
    return rng.standard_normal(shape).astype(numpy_dtype(spec.dtype))


def _lengths(spec: PagedSpec, rng: np.random.Generator, shape: tuple, sizes) -> np.ndarray:
    return rng.integers(0, sizes["max_pages"] * spec.page_size + 1, size=shape).astype(np.int32)


def _pages(spec: PagedSpec, rng: np.random.Generator, shape: tuple, sizes) -> np.ndarray:
    return rng.integers(0, sizes["num_pages"], size=shape).astype(np.int32)


def _offsets(spec: PagedSpec, rng: np.random.Generator, shape: tuple, sizes) -> np.ndarray:
    cuts = np.sort(rng.integers(0, sizes["total_q"] + 1, size=shape[0] - 2))
    return np.concatenate([[0], cuts, [sizes["total_q"]]]).astype(np.int32)


_INT32 = lambda s: "int32"  # noqa: E731
_FP32 = lambda s: "float32"  # noqa: E731
TABLE: tuple[Argument, ...] = (
    Argument("q", lambda s: True, lambda s: s.query_shape(), _cache_draw, keyword=False, data=True),
    Argument("k_cache", lambda s: True, lambda s: s.cache_shape(), _cache_draw, keyword=False, data=True),
    Argument("v_cache", lambda s: True, lambda s: s.cache_shape(), _cache_draw, keyword=False, data=True),
    Argument("block_table", lambda s: True, lambda s: ("b", "max_pages"), _pages, _INT32, keyword=False,
             what="each sequence's pages, in order"),
    Argument("cache_seqlens", lambda s: True, lambda s: ("b",), _lengths, _INT32, keyword=False,
             what="each sequence's key count"),
    Argument("cu_seqlens_q", lambda s: s.ragged, lambda s: ("b1",), _offsets, _INT32, keyword=False,
             what="where each sequence's queries start in q, and the end (B + 1)", asked_by="q_len=None"),
    arguments.BY_NAME["sinks"],  # (the dense rows: they read the spec's h, sinks and alibi)
    arguments.BY_NAME["alibi_slopes"],
)
PagedSpec.ARGUMENTS = TABLE


def check_queries(cu_seqlens_q: np.ndarray, batch: int, total_q: int) -> None:
    """A TvmAttnError unless cu_seqlens_q is (B + 1,) offsets from 0 to total_q, never decreasing."""
    cu = np.asarray(cu_seqlens_q).reshape(-1)
    if cu.shape != (batch + 1,) or cu[0] != 0 or cu[-1] != total_q or (np.diff(cu) < 0).any():
        raise TvmAttnError(f"cu_seqlens_q={cu.tolist()[:8]}{'…' if cu.size > 8 else ''} must be {batch + 1} "
                           f"offsets into q from 0 to its {total_q} rows, never decreasing (sequence b's "
                           f"queries are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]])")


def check_pages(spec: PagedSpec, block_table: np.ndarray, cache_seqlens: np.ndarray, num_pages: int) -> None:
    """A TvmAttnError naming what is wrong where a call would read outside the cache: a length below
    0 or above the block table's reach (max_pages·page_size), or a page that a sequence's length
    reaches outside [0, num_pages). Entries past a sequence's length are not looked at."""
    lens = np.asarray(cache_seqlens).reshape(-1)
    table = np.asarray(block_table)
    reach = table.shape[1] * spec.page_size
    if lens.size and (lens.min() < 0 or lens.max() > reach):
        b = int(np.flatnonzero((lens < 0) | (lens > reach))[0])
        raise TvmAttnError(f"cache_seqlens[{b}]={int(lens[b])} is outside [0, {reach}]: the block table has "
                           f"{table.shape[1]} pages of {spec.page_size} per sequence; widen block_table "
                           f"(max_pages ≥ ceil(length / page_size)) or fix the length")
    used = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // spec.page_size)
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])
        raise TvmAttnError(f"block_table[{b}, {j}]={int(table[b, j])} is outside the cache's pages [0, {num_pages}) "
                           f"and sequence {b} (length {int(lens[b])}) reaches it: point it at a page of k_cache "
                           f"and v_cache, or shorten cache_seqlens[{b}]")


# ---- the compiled kernel ---------------------------------------------------------------------------
class CompiledPaged(CompiledAttention):
    """A paged kernel: ``kernel(q, k_cache, v_cache, block_table, cache_seqlens, sinks=…, alibi_slopes=…)``
    → (B, n, h, d), NumPy in and out as `CompiledAttention`; every call checks the block table against
    the lengths (`check_pages`). `run` (device tensors, no checks) reads no page outside the cache
    either: the kernel clamps each page index into it."""

    def _arguments(self, arrays: tuple, extras: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        args, sizes = super()._arguments(arrays, extras)
        check_pages(self.spec, args["block_table"], args["cache_seqlens"], sizes["num_pages"])
        if self.spec.ragged:
            check_queries(args["cu_seqlens_q"], sizes["b"], sizes["total_q"])
        return with_unused(self.spec, args), sizes


_ZEROS: dict[int, np.ndarray] = {}


def with_unused(spec: PagedSpec, args: dict[str, Any], zeros: Any = None) -> dict[str, Any]:
    """``args`` as the PrimFunc takes them: it always has sinks and alibi_slopes (h,) float32, zeros
    (``zeros``, else a NumPy array kept per h) where the spec has not."""
    fill = zeros if zeros is not None else _ZEROS.setdefault(spec.h, np.zeros(spec.h, np.float32))
    names = ("q", "k_cache", "v_cache", "block_table", "cache_seqlens") + (("cu_seqlens_q",) if spec.ragged else ()) \
        + ("sinks", "alibi_slopes")
    return {name: args[name] if name in args else fill for name in names}
