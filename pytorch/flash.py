"""`flash_attn_func`: FlashAttention's function (``flash_attn.flash_attn_func``), computed by tvmattn kernels.

It has what SDPA has not: bottom-right causal alignment, sliding windows as (left, right), a soft cap and
ALiBi (``alibi_slopes``), on FlashAttention's (B, S, H, D) layout, which the kernel reads in place.
"""

from __future__ import annotations

import math

import torch
import tvm_ffi

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.torch.cache import KERNELS, KernelKey
from tvmattn.torch.plan import DTYPES, _aligned, _check_tensors


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> torch.Tensor:
    """FlashAttention's ``flash_attn_func`` on a tvmattn kernel (forward only).

    q (B, S_q, H, D), k (B, S_k, H_k, D), v (B, S_k, H_k, D_v) -> (B, S_q, H, D_v), H a multiple of H_k (GQA),
    float32, float16 or bfloat16 on cpu or cuda. As in FlashAttention: ``causal`` and the window are
    aligned bottom-right (query i sits at i + S_k − S_q); ``window_size`` (left, right) lets query i see
    keys [i − left, i + right] of that position (-1: unbounded); ``softcap`` > 0 caps the scaled scores,
    softcap·tanh(s / softcap); ``alibi_slopes`` (H,) or (B, H) float32 adds −slope·|i + S_k − S_q − j|
    to the score of query i and key j. ``deterministic`` changes nothing (the forward pass is).

    Where it differs: ``dropout_p`` must be 0, ``return_attn_probs`` False, and a window must be
    symmetric or causal (left, 0) (the kernel's window is |distance| < W, or causal's).
    """
    if dropout_p != 0.0:
        raise TvmAttnError(f"dropout_p={dropout_p}: tvmattn kernels are for inference and have no dropout")
    if return_attn_probs:
        raise TvmAttnError("return_attn_probs=True: tvmattn kernels return the attention output only")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, alibi_slopes)):
        raise TvmAttnError("tvmattn attention has no backward: run it under torch.no_grad() or "
                           "torch.inference_mode()")
    if torch.compiler.is_compiling() or not all(type(t) is torch.Tensor for t in (q, k, v)):
        # traced (torch.compile, torch.export, a tensor subclass): the custom op, opaque to the tracer
        return torch.ops.tvmattn.flash_attention(q, k, v, softmax_scale, causal, list(window_size), softcap,
                                                 alibi_slopes)
    key = _key(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    _run(key, q, k, v, alibi_slopes, out)
    return out


def _key(q, k, v, softmax_scale, causal: bool, window_size, softcap: float, alibi_slopes) -> KernelKey:
    """Check the arguments as FlashAttention does (TvmAttnError where it would refuse them); the kernel."""
    _check_tensors(q, k, v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise TvmAttnError(f"q, k, v have shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}: "
                           f"flash_attn_func takes (batch, seqlen, nheads, headdim) tensors")
    batch, q_len, heads, head_dim = q.shape
    if k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != head_dim:
        raise TvmAttnError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}: k is "
                           f"(B, S_k, H_k, D), v (B, S_k, H_k, D_v)")
    kv_heads = k.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise TvmAttnError(f"q has {heads} heads, k and v {kv_heads}: the query heads must be a multiple of them")
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise TvmAttnError(f"softmax_scale={softmax_scale!r}: a positive finite scale (or None: 1/sqrt(D))")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise TvmAttnError(f"softcap={softcap!r}: 0 (none) or a positive cap")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32 or \
                alibi_slopes.shape not in ((heads,), (batch, heads)):
            got = f"{tuple(alibi_slopes.shape)} {alibi_slopes.dtype}" if isinstance(alibi_slopes, torch.Tensor) \
                else type(alibi_slopes).__name__
            raise TvmAttnError(f"alibi_slopes must be float32 of shape ({heads},) or ({batch}, {heads}), got {got}")
        if alibi_slopes.device != q.device:
            raise TvmAttnError(f"alibi_slopes are on {alibi_slopes.device} and q on {q.device}: move them")
    causal, window = _window(causal, window_size)
    device = "cpu" if q.device.type == "cpu" else str(q.device)
    return KernelKey(device, DTYPES[q.dtype], 1 if q_len == 1 else None, heads, kv_heads, head_dim, v.shape[3],
                     "BSHD", causal, None if softmax_scale is None else float(softmax_scale), None, "", False,
                     "bottom_right", window, float(softcap) if softcap else None,
                     "symmetric" if alibi_slopes is not None else None)


def _window(causal: bool, window_size) -> tuple[bool, int | None]:
    """FlashAttention's (causal, (left, right)) as the spec's (causal, window)."""
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise TvmAttnError(f"window_size={tuple(window_size)}: each side is -1 (unbounded) or a key count ≥ 0")
    if causal or right == 0:  # (FlashAttention's causal is window (-1, 0))
        return True, None if left < 0 else left + 1
    if left == right:
        return False, None if left < 0 else left + 1
    raise TvmAttnError(f"window_size={tuple(window_size)}: tvmattn's windows are symmetric (W − 1, W − 1) or "
                       f"causal (W − 1, 0)")


def _run(key: KernelKey, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: torch.Tensor | None,
         out: torch.Tensor) -> None:
    if out.numel() == 0 or k.shape[1] == 0:  # no query, or no key to see: zeros, as for a row that sees none
        out.zero_()
        return
    kernel = KERNELS.get(key)
    q, k, v = (_aligned(t.contiguous()) for t in (q, k, v))
    slopes = None if alibi_slopes is None else alibi_slopes.detach().contiguous()
    # (B, H) slopes: one call per sequence where they differ (the kernel's slopes are per head)
    per_sequence = slopes is not None and slopes.dim() == 2 and not bool((slopes == slopes[:1]).all())
    if slopes is not None and slopes.dim() == 2 and not per_sequence:
        slopes = slopes[0]
    calls = [(slice(b, b + 1), slopes[b]) for b in range(q.shape[0])] if per_sequence else [(slice(None), slopes)]
    for rows, s in calls:
        args = [q[rows], k[rows], v[rows]] + ([] if s is None else [_aligned(s.contiguous())])
        if q.device.type == "cuda":
            with tvm_ffi.use_torch_stream():  # on torch's current stream, ordered with the ops around it
                kernel.run(*args, out[rows])
        else:
            kernel.run(*args, out[rows])


@torch.library.custom_op("tvmattn::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, causal: bool,
                    window_size: list[int], softcap: float, alibi_slopes: torch.Tensor | None) -> torch.Tensor:
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    _run(_key(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes), q, k, v, alibi_slopes, out)
    return out


@flash_attention.register_fake
def _flash_attention_fake(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes) -> torch.Tensor:
    _key(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes)  # the same checks, on shapes
    return q.new_empty((*q.shape[:-1], v.shape[-1]))
