"""One compiled kernel per kind of call and length bucket; the batch size is symbolic.

Why buckets and not symbolic lengths: in this TVM build the CPU schedule of a kernel with a symbolic
query length runs 13× slower at (1, 8, 512, 64) and 90× slower for a decode step (one query, 1024
keys) than the same kernel with static lengths (padded tiles and predicated loops; symbolic batch
costs nothing). So a call's lengths are rounded up to a bucket (`bucket`), the kernel is compiled
for the bucket, and shorter keys are hidden with ``key_padding`` (kv_lens): a KV cache that grows by
one token per step reaches a new kernel only at each bucket boundary.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import tvmattn
from tvmattn.compiler.kernel import CompiledAttention
from tvmattn.compiler.spec import AttentionSpec


@dataclass(frozen=True)
class KernelKey:
    """Everything a kernel is specialised on; the sizes it is not specialised on are names in `spec`."""

    device: str  # "cpu" or "cuda:0"
    dtype: str
    q_len: int  # a bucket (`bucket`) the call's query length is padded to
    kv_len: int  # likewise for the keys
    key_padding: bool  # keys past the call's length are padding, hidden by kv_lens
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    layout: str  # "BHSD" or "BSHD": the memory order the tensors already have
    causal: bool
    scale: float | None
    mask: str | None  # None, "bool" or "additive"
    mask_dims: str  # the mask axes (of "bhst") that are not broadcast

    def spec(self) -> AttentionSpec:
        return AttentionSpec(batch="b", seq_len=self.q_len, kv_seq_len=self.kv_len, num_heads=self.heads,
                             num_kv_heads=self.kv_heads, head_dim=self.head_dim, v_head_dim=self.v_head_dim,
                             causal=self.causal, causal_align="top_left", layout=self.layout, dtype=self.dtype,
                             key_padding=self.key_padding, projections=False, scale=self.scale, attn_mask=self.mask,
                             attn_mask_dims=self.mask_dims if self.mask else "bhst")


def bucket(n: int) -> int:
    """The static length a length-n call runs at: the next power of two up to 256 (a decode step's one
    query is 1), then the next multiple of 256 (at most a third more work past 512)."""
    return 1 << (n - 1).bit_length() if n <= 256 else -(-n // 256) * 256


class KernelCache:
    """Compiles on the first call of a key (tuning records are used when present), then only looks up."""

    def __init__(self) -> None:
        self._kernels: dict[KernelKey, CompiledAttention] = {}
        # what a call's argument signature (shapes, strides, dtypes, devices, flags) was planned as:
        # checking the arguments and finding the kernel cost more than the rest of a call
        self.plans: dict[tuple, Any] = {}
        self._lock = threading.Lock()  # two threads missing on one key compile it once

    def get(self, key: KernelKey) -> CompiledAttention:
        kernel = self._kernels.get(key)
        if kernel is None:
            with self._lock:
                kernel = self._kernels.get(key)
                if kernel is None:
                    target = "cuda" if key.device.startswith("cuda") else "cpu"
                    kernel = self._kernels[key] = tvmattn.compile(key.spec(), target)
        return kernel

    def keys(self) -> list[KernelKey]:
        return list(self._kernels)

    def clear(self) -> None:
        self._kernels.clear()
        self.plans.clear()


KERNELS = KernelCache()
