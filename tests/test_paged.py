"""The paged decode kernel (`tvmattn.PagedSpec`) against the float64 paged oracle: page sizes, both
layouts, pages in any order and shared between sequences, ragged lengths (empty and 1-token ones
too), GQA/MQA, the variants, dtypes; bad block tables. `tvmattn.torch.flash_attn_with_kvcache`
against a gather-then-SDPA reference in torch."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from helpers import every_other_slow
from hypothesis import given, settings
from hypothesis import strategies as st

import tvmattn
from tvmattn import PagedSpec, TvmAttnError
from tvmattn.compiler import build
from tvmattn.compiler.arguments import numpy_dtype
from tvmattn.compiler.flash import FlashTiles
from tvmattn.compiler.verify import TOLERANCE, errors


@functools.lru_cache(maxsize=64)
def compiled(spec: PagedSpec) -> tvmattn.CompiledPaged:
    return tvmattn.compile(spec, "cpu")


def draw(spec: PagedSpec, lens: list[int], spare: int = 3, shared: int = 0, seed: int = 0) -> dict[str, np.ndarray]:
    """A pool holding every sequence's pages in a random order (``spare`` unused pages among them);
    the first ``shared`` pages of each sequence are one common prefix; unused block-table entries
    hold garbage (-1, or past the pool)."""
    rng = np.random.default_rng(seed)
    own = [max(-(-n // spec.page_size) - shared, 0) for n in lens]
    num_pages = shared + sum(own) + spare
    order = rng.permutation(num_pages).astype(np.int32)
    width = max([-(-n // spec.page_size) for n in lens] + [1]) + 1
    table = rng.choice(np.array([-1, num_pages, 10**6], np.int32), size=(len(lens), width))
    start = shared
    for b, n in enumerate(lens):
        used = -(-n // spec.page_size)
        table[b, :min(shared, used)] = order[:min(shared, used)]
        table[b, min(shared, used):used] = order[start:start + used - min(shared, used)]
        start += used - min(shared, used)
    dtype = numpy_dtype(spec.dtype)
    arrays = {"q": rng.standard_normal((len(lens), spec.q_len, spec.h, spec.head_dim)).astype(dtype),
              "k_cache": rng.standard_normal(spec.cache_shape(num_pages)).astype(dtype),
              "v_cache": rng.standard_normal(spec.cache_shape(num_pages)).astype(dtype),
              "block_table": table, "cache_seqlens": np.array(lens, np.int32)}
    if spec.sinks:
        arrays["sinks"] = rng.standard_normal(spec.h).astype(np.float32)
    if spec.alibi:
        arrays["alibi_slopes"] = (2.0 ** (-8.0 * np.arange(1, spec.h + 1) / spec.h)).astype(np.float32)
    return arrays


def check(spec: PagedSpec, lens: list[int], shared: int = 0, seed: int = 0, kernel=None) -> None:
    """The kernel of ``spec`` (or ``kernel``) on `draw`'s arrays against `tvmattn.paged_reference`, at the
    dtype's tolerance."""
    args = draw(spec, lens, shared=shared, seed=seed)
    positional = [args[n] for n in ("q", "k_cache", "v_cache", "block_table", "cache_seqlens")]
    extras = {n: args[n] for n in ("sinks", "alibi_slopes") if n in args}
    out = (kernel or compiled(spec))(*positional, **extras)
    ref = tvmattn.paged_reference(spec, *positional, **extras)
    max_abs, max_rel = errors(out, ref)
    assert np.isfinite(max_abs) and max_rel <= TOLERANCE[spec.dtype], (spec, lens, max_abs, max_rel)


GQA = dict(num_heads=8, num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("spec, lens, shared", every_other_slow([
    (PagedSpec(**GQA, page_size=16), [37, 0, 1, 100], 0),                          # ragged, empty, 1 token
    (PagedSpec(**GQA, page_size=16, kv_layout="HND"), [37, 0, 1, 100], 0),
    (PagedSpec(**GQA, page_size=1), [5, 1, 9], 0),                                  # a page per key
    (PagedSpec(**GQA, page_size=256, kv_layout="HND"), [300, 3], 0),                # pages larger than a sequence
    (PagedSpec(**GQA, page_size=4), [40, 24, 9], 2),                                # a shared 8-key prefix
    (PagedSpec(num_heads=4, num_kv_heads=1, head_dim=32, page_size=8), [50, 7], 0),  # MQA, d in 2 vectors
    (PagedSpec(num_heads=2, head_dim=24, page_size=2), [13, 6], 0),                 # MHA, d of 8-lane vectors
    (PagedSpec(**GQA, page_size=8, softcap=3.0, alibi="symmetric"), [70, 2], 0),
    (PagedSpec(**GQA, page_size=8, window=9, causal=True), [70, 5, 0], 0),          # only the last 9 keys
    (PagedSpec(**GQA, page_size=8, window=20), [70, 5], 0),
    (PagedSpec(**GQA, page_size=8, sinks=True, alibi="signed"), [70, 0, 3], 0),     # an empty row: 0 with sinks
    (PagedSpec(**GQA, page_size=16, q_len=3, causal=True), [40, 3, 17], 0),        # 3 queries at the end
    (PagedSpec(**GQA, page_size=16, q_len=2, window=5, causal=True, softcap=10.0), [33, 2], 0),
    (PagedSpec(**GQA, page_size=16, dtype="bfloat16"), [100, 1, 37], 1),
    (PagedSpec(**GQA, page_size=32, dtype="float16", kv_layout="HND", alibi="symmetric"), [100, 1, 37], 0),
    (PagedSpec(**GQA, page_size=16, scale=0.3), [2048, 37, 513, 1000], 0),         # the benchmark's batch
]))
def test_paged_decode_matches_oracle(spec, lens, shared):
    check(spec, lens, shared)


@settings(max_examples=6)
@given(page=st.sampled_from([1, 2, 8, 16, 64, 256]), layout=st.sampled_from(["NHD", "HND"]),
       heads=st.sampled_from([(4, 4), (4, 2), (8, 1)]), dtype=st.sampled_from(["float32", "bfloat16"]),
       variant=st.sampled_from([{}, {"softcap": 5.0}, {"window": 7, "causal": True}, {"alibi": "symmetric"},
                                {"sinks": True}]),
       lens=st.lists(st.integers(0, 90), min_size=1, max_size=4), shared=st.integers(0, 2), seed=st.integers(0, 9))
def test_paged_decode_any_pages(page, layout, heads, dtype, variant, lens, shared, seed):
    spec = PagedSpec(num_heads=heads[0], num_kv_heads=heads[1], head_dim=32, page_size=page, kv_layout=layout,
                     dtype=dtype, **variant)
    check(spec, lens, shared=min(shared, min(lens) // page), seed=seed)


@pytest.mark.slow
@settings(max_examples=60)
@given(page=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256]), layout=st.sampled_from(["NHD", "HND"]),
       heads=st.sampled_from([(4, 4), (4, 2), (8, 1), (6, 3)]), d=st.sampled_from([16, 64, 128]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), q_len=st.integers(1, 3),
       variant=st.sampled_from([{}, {"softcap": 5.0}, {"window": 7, "causal": True}, {"alibi": "symmetric"},
                                {"sinks": True}, {"causal": True, "alibi": "signed"}, {"window": 30}]),
       lens=st.lists(st.integers(0, 600), min_size=1, max_size=5), seed=st.integers(0, 99))
def test_paged_decode_sweep(page, layout, heads, d, dtype, q_len, variant, lens, seed):
    spec = PagedSpec(num_heads=heads[0], num_kv_heads=heads[1], head_dim=d, page_size=page, kv_layout=layout,
                     dtype=dtype, q_len=q_len, **variant)
    check(spec, [max(n, q_len) for n in lens], seed=seed)


@pytest.mark.parametrize("change, message", [
    (lambda a: a["block_table"].__setitem__((1, 0), 99), r"block_table\[1, 0\]=99 is outside"),
    (lambda a: a["block_table"].__setitem__((0, 2), -1), r"block_table\[0, 2\]=-1 is outside"),
    (lambda a: a["cache_seqlens"].__setitem__(0, 10_000), r"cache_seqlens\[0\]=10000 is outside \[0, "),
    (lambda a: a["cache_seqlens"].__setitem__(1, -1), r"cache_seqlens\[1\]=-1 is outside"),
])
def test_bad_block_table_is_one_clear_error(change, message):
    spec = PagedSpec(**GQA, page_size=16)
    args = draw(spec, [40, 20])
    change(args)
    with pytest.raises(TvmAttnError, match=message):
        compiled(spec)(*(args[n] for n in ("q", "k_cache", "v_cache", "block_table", "cache_seqlens")))


@pytest.mark.parametrize("fields, message", [
    ({"page_size": 12}, "page_size=12: use a power of two"),
    ({"page_size": 512}, "page_size=512"),
    ({"kv_layout": "HDN"}, "unknown kv_layout"),
    ({"num_heads": 6, "num_kv_heads": 4}, "not a multiple of num_kv_heads"),
    ({"q_len": 0}, "q_len=0"),
])
def test_bad_paged_spec(fields, message):
    with pytest.raises(TvmAttnError, match=message):
        PagedSpec(**{"num_heads": 8, "head_dim": 64, **fields})


# ---- the torch front end ------------------------------------------------------------------------------
torch = pytest.importorskip("torch")


def sdpa_reference(q, k_cache, v_cache, block_table, lens, causal=False, window=(-1, -1), softcap=0.0,
                   alibi_slopes=None, layout="NHD"):
    """Each sequence's keys gathered from its pages, then torch's SDPA (float64) with an explicit
    bottom-right mask: (B, S_q, H, D)."""
    batch, sq, heads, d = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        page = k_cache.shape[1] if layout == "NHD" else k_cache.shape[2]
        rows = [(int(block_table[b, t // page]), t % page) for t in range(n)]
        k, v = ((torch.stack([c[p, r] if layout == "NHD" else c[p, :, r] for p, r in rows]) if rows else
                 c.new_zeros((0, *q.shape[2:3]))) for c in (k_cache, v_cache))
        if n == 0:
            continue
        k, v = (t.double().permute(1, 0, 2).repeat_interleave(heads // t.shape[1], 0) for t in (k, v))
        row, col = torch.arange(sq)[:, None] + n - sq, torch.arange(n)[None, :]
        allowed = torch.ones(sq, n, dtype=torch.bool)
        left, right = window
        if causal:
            right = 0
        if left >= 0:
            allowed &= col >= row - left
        if right >= 0:
            allowed &= col <= row + right
        scores = q[b].double().permute(1, 0, 2) @ k.transpose(1, 2) / math.sqrt(d)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if alibi_slopes is not None:
            scores = scores - alibi_slopes.double()[:, None, None] * (row - col).abs()
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        out[b] = (weights @ v).permute(1, 0, 2)
    return out


def paged_cache(lens, page, kv_heads=2, d=32, layout="NHD", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // page) for n in lens) + 1
    num_pages = len(lens) * width + 2
    table = torch.randperm(num_pages, generator=gen)[:len(lens) * width].view(len(lens), width).to(torch.int32)
    shape = (num_pages, page, kv_heads, d) if layout == "NHD" else (num_pages, kv_heads, page, d)
    return (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype), table)


@pytest.mark.parametrize("lens, new, kw", [
    ([30, 0, 7], 1, {}),                                                           # decode: append one token
    ([30, 5], 1, {"kv_layout": "HND", "softcap": 4.0}),
    ([30, 5], 0, {"causal": True, "window_size": (6, 0)}),
    ([40, 9], 3, {"causal": True, "alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}),
    ([40, 9], 1, {"dtype": torch.bfloat16}),
])
def test_flash_attn_with_kvcache_paged(lens, new, kw):
    from tvmattn.torch import flash_attn_with_kvcache

    dtype, layout = kw.pop("dtype", torch.float32), kw.get("kv_layout", "NHD")
    k_cache, v_cache, table = paged_cache([n + new for n in lens], 8, layout=layout, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), max(new, 1), 4, 32, generator=gen).to(dtype)
    k, v = (torch.randn(len(lens), new, 2, 32, generator=gen).to(dtype) if new else None for _ in range(2))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens_t, block_table=table, **kw)
    total = lens_t + new
    window = kw.pop("window_size", (-1, -1))
    ref = sdpa_reference(q, k_cache, v_cache, table, total, kw.pop("causal", False), window, kw.pop("softcap", 0.0),
                         kw.pop("alibi_slopes", None), layout)
    if new:  # the new keys were written at the sequence's end, in place
        page = 8
        for b, n in enumerate(lens):
            p, r = int(table[b, (n + new - 1) // page]), (n + new - 1) % page
            assert torch.equal(k_cache[p, r] if layout == "NHD" else k_cache[p, :, r], k[b, -1])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()


def test_flash_attn_with_kvcache_contiguous_cache():
    from tvmattn.torch import flash_attn_with_kvcache

    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = (torch.randn(3, 48, 2, 32, generator=gen) for _ in range(2))  # (B, S_cache, H_k, D)
    q, k, v = torch.randn(3, 1, 4, 32, generator=gen), torch.randn(3, 1, 2, 32), torch.randn(3, 1, 2, 32)
    lens = torch.tensor([47, 0, 20], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)
    assert torch.equal(k_cache[2, 20], k[2, 0]) and torch.equal(v_cache[0, 47], v[0, 0])
    table = torch.arange(3 * 3, dtype=torch.int32).view(3, 3)  # (the cache as 16-row pages, in order)
    ref = sdpa_reference(q, k_cache.view(9, 16, 2, 32), v_cache.view(9, 16, 2, 32), table, lens + 1)
    assert (out.double() - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_flash_attn_with_kvcache_int_lengths():
    from tvmattn.torch import flash_attn_with_kvcache

    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(2, 32, 1, 16, generator=gen) for _ in range(2))  # MQA, (B, S_cache, 1, D)
    q = torch.randn(2, 2, 4, 16, generator=gen)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20, causal=True)  # 20 keys, the last 2 queries
    table = torch.arange(2, dtype=torch.int32).view(2, 1)  # (the cache as one 32-row page per sequence)
    ref = sdpa_reference(q, k_cache, v_cache, table, [20, 20], causal=True)
    assert (out.double() - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_flash_attn_with_kvcache_bad_table_writes_nothing():
    from tvmattn.torch import flash_attn_with_kvcache

    k_cache, v_cache, table = paged_cache([20, 9], 8)
    table[1, 1] = 1000
    before = k_cache.clone()
    q, k = torch.randn(2, 1, 4, 32), torch.randn(2, 1, 2, 32)
    with pytest.raises(TvmAttnError, match=r"block_table\[1, 1\]=1000 is outside"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, k, cache_seqlens=torch.tensor([19, 8], dtype=torch.int32),
                                block_table=table)
    assert torch.equal(k_cache, before)


def test_readme_paged_example_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"## Paged KV cache\n\n.*?```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


# ---- the CUDA kernel's numerics: its template, run serially here (tests/test_cuda.py compiles it) --------
@settings(max_examples=6)
@given(page=st.sampled_from([1, 4, 16, 64]), layout=st.sampled_from(["NHD", "HND"]),
       heads=st.sampled_from([(4, 4), (4, 2), (8, 1)]), dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
       q_len=st.integers(1, 3), variant=st.sampled_from([{}, {"causal": True}, {"window": 7, "causal": True},
                                                         {"softcap": 5.0, "alibi": "symmetric"}, {"sinks": True}]),
       tiles=st.sampled_from([(16, 16, 1), (16, 32, 4), (32, 64, 2)]),
       lens=st.lists(st.integers(0, 150), min_size=1, max_size=4), seed=st.integers(0, 9))
def test_cuda_template_reads_through_the_block_table(page, layout, heads, dtype, q_len, variant, tiles, lens, seed):
    spec = PagedSpec(num_heads=heads[0], num_kv_heads=heads[1], head_dim=16, page_size=page, kv_layout=layout,
                     q_len=q_len, dtype=dtype, **variant)
    check(spec, lens, seed=seed, kernel=serial_template(spec, FlashTiles(*tiles)))


@functools.lru_cache(maxsize=16)
def serial_template(spec: PagedSpec, tiles: FlashTiles) -> tvmattn.CompiledPaged:
    return build.build_serial(spec, tiles)


# ---- ragged queries: the prefill kernel -----------------------------------------------------------------
def check_ragged(spec: PagedSpec, lens: list[int], queries: list[int], seed: int = 0) -> None:
    """Sequence b's last ``queries[b]`` keys are its queries (packed, cu_seqlens_q), against the oracle."""
    args = draw(spec.replace(q_len=1), lens, seed=seed)
    rng = np.random.default_rng(seed + 1)
    cu = np.concatenate([[0], np.cumsum(queries)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), spec.h, spec.head_dim)).astype(numpy_dtype(spec.dtype))
    positional = [q, args["k_cache"], args["v_cache"], args["block_table"], args["cache_seqlens"], cu]
    extras = {n: args[n] for n in ("sinks", "alibi_slopes") if n in args}
    out = compiled(spec)(*positional, **extras)
    ref = tvmattn.paged_reference(spec, *positional, **extras)
    max_abs, max_rel = errors(out, ref)
    assert np.isfinite(max_abs) and max_rel <= TOLERANCE[spec.dtype], (spec, lens, queries, max_abs, max_rel)


RAGGED = dict(num_heads=8, num_kv_heads=2, head_dim=32, q_len=None)


@pytest.mark.parametrize("spec, lens, queries", [
    (PagedSpec(**RAGGED, page_size=16, causal=True), [70, 0, 9, 33], [70, 0, 1, 5]),    # prefill, empty, decode
    (PagedSpec(**RAGGED, page_size=1, kv_layout="HND"), [20, 7], [3, 7]),                # not causal: all keys
    (PagedSpec(**RAGGED, page_size=8, causal=True, window=6, softcap=5.0, alibi="symmetric", sinks=True),
     [40, 13], [17, 13]),
    (PagedSpec(**RAGGED, page_size=32, causal=True, dtype="bfloat16"), [90, 31], [50, 6]),
    (PagedSpec(**RAGGED, page_size=16, causal=True, sinks=True, alibi="signed"), [70, 1, 9, 300], [1, 1, 1, 1]),
    (PagedSpec(**RAGGED, page_size=4, causal=True), [40, 13, 5], [0, 2, 1]),  # as many queries as sequences
])
def test_ragged_prefill_matches_oracle(spec, lens, queries):
    check_ragged(spec, lens, queries)


SHAPES = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), min_size=1, max_size=4)


@settings(max_examples=4)
@given(page=st.sampled_from([1, 4, 16, 64]), layout=st.sampled_from(["NHD", "HND"]), causal=st.booleans(),
       shape=SHAPES, seed=st.integers(0, 9))
def test_ragged_prefill_any_lengths(page, layout, causal, shape, seed):
    lens, queries = [max(a, b, 1) for a, b in shape], [min(a, b) for a, b in shape]
    queries[0] = max(queries[0], 1)  # (q has at least one row)
    check_ragged(PagedSpec(**RAGGED, page_size=page, kv_layout=layout, causal=causal), lens, queries, seed)


@pytest.mark.slow
@settings(max_examples=40)
@given(page=st.sampled_from([1, 2, 16, 128]), layout=st.sampled_from(["NHD", "HND"]), shape=SHAPES,
       heads=st.sampled_from([(4, 4), (8, 2), (6, 1)]), dtype=st.sampled_from(["float32", "bfloat16"]),
       variant=st.sampled_from([{}, {"causal": True}, {"causal": True, "window": 9}, {"softcap": 5.0},
                                {"alibi": "symmetric", "causal": True}, {"sinks": True}]), seed=st.integers(0, 99))
def test_ragged_prefill_sweep(page, layout, shape, heads, dtype, variant, seed):
    lens, queries = [max(a, b, 1) for a, b in shape], [min(a, b) for a, b in shape]
    queries[0] = max(queries[0], 1)
    spec = PagedSpec(num_heads=heads[0], num_kv_heads=heads[1], head_dim=32, page_size=page, kv_layout=layout,
                     q_len=None, dtype=dtype, **variant)
    check_ragged(spec, lens, queries, seed)


def test_bad_cu_seqlens_q_is_one_clear_error():
    spec = PagedSpec(**RAGGED, page_size=16)
    args = draw(spec.replace(q_len=1), [20, 10])
    q = np.zeros((5, 8, 32), np.float32)
    with pytest.raises(TvmAttnError, match="cu_seqlens_q=.* must be 3 offsets into q from 0 to its 5 rows"):
        compiled(spec)(q, args["k_cache"], args["v_cache"], args["block_table"], args["cache_seqlens"],
                       np.array([0, 4, 3], np.int32))


def test_flash_attn_varlen_func_packed_and_paged():
    from tvmattn.torch import flash_attn_varlen_func

    gen = torch.Generator().manual_seed(3)
    lens_q, lens_k = [9, 0, 30, 1], [20, 4, 30, 17]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, 32, generator=gen)
    k, v = (torch.randn(int(cu_k[-1]), 2, 32, generator=gen) for _ in range(2))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    for b in (0, 2, 3):  # each sequence on its own (sequence 1 has no query): SDPA, bottom-right causal
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        table = torch.arange(lens_k[b], dtype=torch.int32)[None]
        ref = sdpa_reference(qs[None], ks[:, None], vs[:, None], table, [lens_k[b]], causal=True)[0]
        assert (out[cu_q[b]:cu_q[b + 1]].double() - ref).abs().max() <= 1e-4 * max(ref.abs().max(), 1)
    # the same keys in a shuffled paged cache
    k_cache, v_cache, table = paged_cache(lens_k, 8, seed=4)
    paged = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), block_table=table)
    for b in (0, 2, 3):
        qs = q[cu_q[b]:cu_q[b + 1]]
        ref = sdpa_reference(qs[None], k_cache, v_cache, table[b:b + 1], [lens_k[b]])[0]
        assert (paged[cu_q[b]:cu_q[b + 1]].double() - ref).abs().max() <= 1e-4 * max(ref.abs().max(), 1)


def test_unchecked_run_reads_no_page_outside_the_pool():
    """`run` skips the checks; the kernel clamps every page index into the pool all the same."""
    from tvmattn.compiler.kernel import host_tensor
    from tvmattn.compiler.paged import with_unused

    spec = PagedSpec(**GQA, page_size=16)
    args = draw(spec, [40, 20])
    args["block_table"][:, :] = np.array([[10**8, -(10**8), 7, 7], [2**31 - 1, 0, 1, 2]], np.int32)[:, :4]
    out = np.full(args["q"].shape, np.nan, np.float32)
    compiled(spec).run(*(host_tensor(a) for a in with_unused(spec, args).values()), host_tensor(out))
    assert np.isfinite(out).all()
