"""The kernel call, and the torch custom op ``tvmattn::attention`` that wraps it for `torch.compile`
(no graph break: the compiler sees one opaque op whose output shape the fake implementation gives)
and `torch.export`."""

from __future__ import annotations

import torch
import tvm_ffi

from tvmattn.torch.cache import KERNELS
from tvmattn.torch.plan import empty_output, kernel_inputs, plan, unpad

MAX_PLANS = 4096  # argument signatures remembered (a growing KV cache adds one per step)


def run_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                  is_causal: bool, scale: float | None, enable_gqa: bool,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention on real tensors: they cross to the kernel by DLPack, and it writes a torch-allocated output."""
    signature = (*(None if t is None else (t.shape, t.stride(), t.dtype, t.device)
                   for t in (query, key, value, attn_mask, sinks)), is_causal, scale, enable_gqa)
    known = KERNELS.plans.get(signature)
    if known is None:
        p = plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, sinks)
        if len(KERNELS.plans) >= MAX_PLANS:
            KERNELS.plans.clear()
        known = KERNELS.plans[signature] = (p, None if p.is_empty else KERNELS.get(p.key))
    p, kernel = known
    out, result = empty_output(p, query)
    if kernel is None:  # no query, or no key to see: zeros, as for a fully masked row
        return result.zero_()
    args = kernel_inputs(p, query, key, value, attn_mask, sinks)
    if query.device.type == "cuda":
        with tvm_ffi.use_torch_stream():  # on torch's current stream, ordered with the ops around it
            kernel.run(*args, out)
    else:
        kernel.run(*args, out)
    return unpad(p, out, result, query)


@torch.library.custom_op("tvmattn::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
              is_causal: bool, scale: float | None, enable_gqa: bool,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    return run_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, sinks)


@attention.register_fake
def _attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                    is_causal: bool, scale: float | None, enable_gqa: bool,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    # the same checks and the same output strides as the real call, on shapes alone
    return empty_output(plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, sinks), query)[1]
