"""tvmattn's paged decode kernel inside TVM's own paged KV cache (MLC-LLM's ``TIRPagedKVCache``).

TVM's cache (``vm.builtin.paged_attention_kv_cache_create``) takes its attention kernels as PrimFuncs of
fixed signatures; on a CPU target it is handed ``_attention_decode_cpu``'s, a serial scalar loop.
`attention_decode_cpu` builds tvmattn's decode kernel with that signature (`schedules.cpu.paged_decode.
tvm_cache_decode_kernel`), so it drops into the same slot:

    fdecode = tvmattn.compiler.mlc.attention_decode_cpu(num_kv_heads, num_qo_heads, head_dim, dtype, False, {})
    cache = fcreate(..., ["tirx", fattn_prefill], ["tirx", tvm.compile(fdecode, target)["main"]], ...)

(``target`` this CPU's, with its vector features: a bare "llvm" is SSE2), or, for a model built with
``tvm.relax.frontend.nn`` (MLC-LLM's), ``with tvmattn.compiler.mlc.in_tir_paged_kv_cache():``
around the model's construction: every ``TIRPagedKVCache`` made inside takes tvmattn's decode kernel. The
sliding-window decode variant and inline RoPE (``RopeMode.INLINE``) stay TVM's own.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from tvm import tirx
from tvm.target import Target

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.paged import PagedSpec
from tvmattn.compiler.target import host_target
from tvmattn.schedules.cpu.paged_decode import plan_of, tvm_cache_decode_kernel


def attention_decode_cpu(num_kv_heads: int, num_qo_heads: int, head_dim: int, qkv_dtype: str,
                         sliding_window: bool, rope_scaling: dict[str, Any], page_size: int = 16,
                         target: Target | None = None) -> tirx.PrimFunc:
    """TVM's ``_attention_decode_cpu`` arguments → tvmattn's kernel with its signature (``target``: the
    CPU it is built for, this one by default). ``sliding_window`` (attention sinks and a window offset
    per sequence) has no tvmattn kernel yet: TvmAttnError."""
    if sliding_window:
        raise TvmAttnError("tvmattn has no drop-in for TVM's sliding-window decode kernel yet: keep TVM's "
                           "_attention_decode_cpu(..., sliding_window=True, ...)")
    spec = PagedSpec(num_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                     kv_layout="HND", dtype=qkv_dtype, scale=1.0)
    return tvm_cache_decode_kernel(plan_of(spec, target if target is not None else host_target()))


@contextlib.contextmanager
def in_tir_paged_kv_cache(target: Target | None = None) -> Iterator[None]:
    """Inside, every ``TIRPagedKVCache`` built for a CPU takes tvmattn's decode kernel (the
    sliding-window one stays TVM's)."""
    from tvm.relax.frontend.nn.llm import kv_cache

    own = kv_cache._attention_decode_cpu

    def decode(num_kv_heads, num_qo_heads, head_dim, qkv_dtype, sliding_window, rope_scaling, page_size=16):
        if sliding_window:
            return own(num_kv_heads, num_qo_heads, head_dim, qkv_dtype, sliding_window, rope_scaling, page_size)
        return attention_decode_cpu(num_kv_heads, num_qo_heads, head_dim, qkv_dtype, False, rope_scaling,
                                    page_size, target)

    kv_cache._attention_decode_cpu = decode
    try:
        yield
    finally:
        kv_cache._attention_decode_cpu = own
