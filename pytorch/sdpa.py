"""`scaled_dot_product_attention`: PyTorch's function, computed by tvmattn kernels."""

from __future__ import annotations

import torch

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.torch.op import run_attention


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention` on a tvmattn kernel (forward only).

    query (…, h, L, E), key (…, h_kv, S, E), value (…, h_kv, S, Ev) -> (…, h, L, Ev), on cpu or cuda,
    in float32, float16 or bfloat16. ``attn_mask`` is bool (True = attend) or additive in the query's
    dtype, broadcastable to (…, h, L, S); ``is_causal`` is top-left aligned, as in PyTorch;
    ``enable_gqa`` lets h be a multiple of h_kv. ``sinks`` (h,), a keyword PyTorch's function does not
    have: each head's attention-sink logit (gpt-oss's ``sinks``), a key with no value in every row's
    softmax, so the weights of the keys sum to less than 1.

    One kernel is compiled on first use per (device, dtype, heads, head sizes, memory order, mask
    kind and broadcast, causal, scale, one query or more) and serves every batch size and length.

    Where it differs from PyTorch:
      - a query row that sees no key (all masked, or S = 0) gives zeros, as torch 2.13 does (older
        releases gave NaN);
      - ``dropout_p`` must be 0 and ``scale`` positive; there is no backward (inference only);
      - the result may be a transposed view, as from PyTorch's fused kernels, when the inputs are
        transposed views of (…, L, h, E) tensors (the kernel then reads them in place).
    """
    if dropout_p != 0.0:
        raise TvmAttnError(f"dropout_p={dropout_p}: tvmattn kernels are for inference and have no dropout; "
                           f"pass dropout_p=0.0 (model.eval())")
    if torch.compiler.is_compiling() or not all(type(t) is torch.Tensor for t in (query, key, value)):
        # traced (torch.compile, torch.export, a tensor subclass): the custom op, opaque to the tracer
        return torch.ops.tvmattn.attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, sinks)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks)):
        raise TvmAttnError("tvmattn attention has no backward: run it under torch.no_grad() or "
                           "torch.inference_mode(), or use torch's own for training")
    # eager: straight to the kernel, skipping the op dispatcher's per-call cost
    return run_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, sinks)
