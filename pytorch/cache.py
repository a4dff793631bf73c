"""One compiled kernel per kind of call; batch and lengths are symbolic, so it serves every shape.

A one-query call (a decode step) has its own kernel with a static query length of 1: the CPU schedule
then computes the dot products along the head width and splits a long cache over the cores.

CPU kernels run their parallel loops on torch's own OpenMP threads where torch uses OpenMP (the usual
build): two thread pools on the same cores steal from each other (`tvmattn.compiler.openmp`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

import tvmattn
from tvmattn.compiler import openmp
from tvmattn.compiler.kernel import CompiledAttention
from tvmattn.compiler.paged import PagedSpec
from tvmattn.compiler.spec import AttentionSpec


@dataclass(frozen=True)
class KernelKey:
    """Everything a kernel is specialised on; the sizes it is not specialised on are names in `spec`."""

    device: str  # "cpu" or "cuda:0"
    dtype: str
    q_len: int | None  # 1 for a one-query call (decode), None: symbolic
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    layout: str  # "BHSD" or "BSHD": the memory order the tensors already have
    causal: bool
    scale: float | None
    mask: str | None  # None, "bool" or "additive"
    mask_dims: str  # the mask axes (of "bhst") that are not broadcast
    sinks: bool = False  # a sink logit per head (gpt-oss)
    # FlashAttention's `flash_attn_func`: its alignment, sliding window, soft cap and ALiBi
    causal_align: str = "top_left"
    window: int | None = None
    softcap: float | None = None
    alibi: str | None = None

    def spec(self) -> AttentionSpec:
        return AttentionSpec(batch="b", seq_len="n" if self.q_len is None else self.q_len, kv_seq_len="m",
                             num_heads=self.heads,
                             num_kv_heads=self.kv_heads, head_dim=self.head_dim, v_head_dim=self.v_head_dim,
                             causal=self.causal, causal_align=self.causal_align, layout=self.layout,
                             dtype=self.dtype, projections=False, scale=self.scale, attn_mask=self.mask,
                             attn_mask_dims=self.mask_dims if self.mask else "bhst", sinks=self.sinks,
                             window=self.window, softcap=self.softcap, alibi=self.alibi)


class KernelCache:
    """Compiles on the first call of a key (tuning records are used when present), then only looks up."""

    def __init__(self) -> None:
        self._kernels: dict[KernelKey | PagedSpec, CompiledAttention] = {}
        # what a call's argument signature (shapes, strides, dtypes, devices, flags) was planned as:
        # checking the arguments and finding the kernel cost more than the rest of a call
        self.plans: dict[tuple, Any] = {}
        self._lock = threading.Lock()  # two threads missing on one key compile it once

    def get(self, key: KernelKey | PagedSpec) -> CompiledAttention:
        """The kernel of ``key``: a `KernelKey`, or a `PagedSpec` (a CPU kernel over a paged cache)."""
        kernel = self._kernels.get(key)
        if kernel is None:
            with self._lock:
                kernel = self._kernels.get(key)
                if kernel is None:
                    if isinstance(key, PagedSpec):
                        kernel = tvmattn.compile(key, "cpu", thread_pool=cpu_thread_pool())
                    elif key.device.startswith("cuda"):
                        kernel = tvmattn.compile(key.spec(), "cuda")
                    else:
                        kernel = tvmattn.compile(key.spec(), "cpu", thread_pool=cpu_thread_pool())
                    self._kernels[key] = kernel
        return kernel

    def keys(self) -> list[KernelKey]:
        return list(self._kernels)

    def clear(self) -> None:
        self._kernels.clear()
        self.plans.clear()


def cpu_thread_pool() -> str:
    """torch's OpenMP threads where its ATen ops run on OpenMP, else TVM's own pool."""
    uses_openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    return "openmp" if uses_openmp and openmp.available() else "tvm"


KERNELS = KernelCache()
