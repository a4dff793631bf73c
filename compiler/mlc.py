"""tvmattn's paged kernels inside TVM's own paged KV cache (MLC-LLM's ``TIRPagedKVCache``).

TVM's cache (``vm.builtin.paged_attention_kv_cache_create``) takes its attention kernels as PrimFuncs of
fixed signatures; on a CPU target it is handed ``_attention_decode_cpu``'s, ``_attention_prefill_cpu``'s
and ``_attention_prefill_ragged_cpu``'s, serial scalar loops. The functions here build tvmattn's paged
kernels with those signatures (`schedules.cpu.tvm_cache`), so they drop into the same slots:

    fdecode = tvmattn.compiler.mlc.attention_decode_cpu(num_kv_heads, num_qo_heads, head_dim, dtype, False, {})
    cache = fcreate(..., ["tirx", fattn_prefill], ["tirx", tvm.compile(fdecode, target)["main"]], ...)

(``target`` this CPU's, with its vector features: a bare "llvm" is SSE2), or, for a model built with
``tvm.relax.frontend.nn`` (MLC-LLM's), ``with tvmattn.compiler.mlc.in_tir_paged_kv_cache():`` around the
model's construction: every ``TIRPagedKVCache`` made inside takes them. The sliding-window variants, the
tree-attention kernels and inline RoPE (``RopeMode.INLINE``) stay TVM's own.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from tvm import tirx
from tvm.target import Target

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.paged import PagedSpec
from tvmattn.compiler.target import host_target
from tvmattn.schedules.cpu import tvm_cache
from tvmattn.schedules.cpu.paged_decode import PagedPlan, plan_of


def _plan(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, page_size: int, q_len: int | None,
          causal: bool, target: Target | None, layout: str = "HND") -> PagedPlan:
    spec = PagedSpec(num_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                     kv_layout=layout, q_len=q_len, dtype=dtype, causal=causal, scale=1.0)
    return plan_of(spec, target if target is not None else host_target())


def _no_window(sliding_window: bool, which: str) -> None:
    if sliding_window:
        raise TvmAttnError(f"tvmattn has no drop-in for TVM's sliding-window {which} kernel yet: keep TVM's "
                           f"_attention_{which}_cpu(..., sliding_window=True, ...)")


def attention_decode_cpu(num_kv_heads: int, num_qo_heads: int, head_dim: int, qkv_dtype: str,
                         sliding_window: bool, rope_scaling: dict[str, Any], page_size: int = 16,
                         target: Target | None = None) -> tirx.PrimFunc:
    """TVM's ``_attention_decode_cpu`` arguments → tvmattn's decode kernel with its signature (``target``:
    the CPU it is built for, this one by default). ``sliding_window`` (attention sinks and a window
    offset per sequence) has no tvmattn kernel yet: TvmAttnError."""
    _no_window(sliding_window, "decode")
    return tvm_cache.decode_kernel(_plan(num_kv_heads, num_qo_heads, head_dim, qkv_dtype, page_size, 1, False,
                                         target))


def attention_prefill_cpu(h_kv: int, h_q: int, d: int, dtype: str, sliding_window: bool,
                          rope_scaling: dict[str, Any], page_size: int = 16, sliding_window_size: int = 1024,
                          target: Target | None = None) -> tirx.PrimFunc:
    """TVM's ``_attention_prefill_cpu`` (new queries over a sequence's pages) → tvmattn's ragged kernel."""
    _no_window(sliding_window, "prefill")
    plans = (_plan(h_kv, h_q, d, dtype, page_size, None, causal, target) for causal in (True, False))
    return tvm_cache.prefill_kernel(*plans)


def attention_prefill_ragged_cpu(h_kv: int, h_q: int, d_qk: int, d_v: int, dtype: str,
                                 rope_scaling: dict[str, Any], target: Target | None = None) -> tirx.PrimFunc:
    """TVM's ``_attention_prefill_ragged_cpu`` (new queries over the new keys, packed) → tvmattn's ragged
    kernel on one-key pages."""
    if d_qk != d_v:
        raise TvmAttnError(f"tvmattn's kernels take one head width for keys and values, not {d_qk} and {d_v}")
    plans = (_plan(h_kv, h_q, d_qk, dtype, 1, None, causal, target, "NHD") for causal in (True, False))
    return tvm_cache.ragged_kernel(*plans)


@contextlib.contextmanager
def in_tir_paged_kv_cache(target: Target | None = None) -> Iterator[None]:
    """Inside, every ``TIRPagedKVCache`` built for a CPU takes tvmattn's decode, prefill and ragged
    prefill kernels (the sliding-window ones stay TVM's)."""
    from tvm.relax.frontend.nn.llm import kv_cache

    own = {name: getattr(kv_cache, name) for name in
           ("_attention_decode_cpu", "_attention_prefill_cpu", "_attention_prefill_ragged_cpu")}

    def decode(h_kv, h_q, d, dtype, sliding_window, rope_scaling, page_size=16):
        if sliding_window:
            return own["_attention_decode_cpu"](h_kv, h_q, d, dtype, sliding_window, rope_scaling, page_size)
        return attention_decode_cpu(h_kv, h_q, d, dtype, False, rope_scaling, page_size, target)

    def prefill(h_kv, h_q, d, dtype, sliding_window, rope_scaling, page_size=16, sliding_window_size=1024):
        if sliding_window:
            return own["_attention_prefill_cpu"](h_kv, h_q, d, dtype, sliding_window, rope_scaling, page_size,
                                                 sliding_window_size)
        return attention_prefill_cpu(h_kv, h_q, d, dtype, False, rope_scaling, page_size, target=target)

    def ragged(h_kv, h_q, d_qk, d_v, dtype, rope_scaling):
        return attention_prefill_ragged_cpu(h_kv, h_q, d_qk, d_v, dtype, rope_scaling, target)

    for name, fn in zip(own, (decode, prefill, ragged)):
        setattr(kv_cache, name, fn)
    try:
        yield
    finally:
        for name, fn in own.items():
            setattr(kv_cache, name, fn)
