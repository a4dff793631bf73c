"""From the arguments of a `scaled_dot_product_attention` call to a kernel key and the kernel's tensors.

`plan` reads only shapes, strides and dtypes, so the same checks run on the fake tensors of
`torch.compile` / `torch.export` (the custom op's fake implementation) and on real ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from tvmattn.compiler.build import head_widths
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.target import resolve_target
from tvmattn.torch.cache import KernelKey

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: str
    lead: tuple[int, ...]  # the leading batch dims, flattened into the kernel's B
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    layout: str
    causal: bool
    scale: float | None
    mask: str | None
    mask_dims: str
    # query, key and value are already the kernel's (B, h, n, e) tensors (4-D, contiguous, on the CPU):
    # they cross as they are (the shapes and strides a plan is remembered for make this hold)
    as_given: bool = False
    sinks: bool = False  # a sink logit per head (`scaled_dot_product_attention`'s ``sinks``)
    # the kernel's (d_k, d_v) where the head widths are padded for the tiles or dot products (`build.head_widths`):
    # q, k and v are copied with zero columns, and the output is copied back without them (`unpad`)
    padded: tuple[int, int] | None = None

    @property
    def batch(self) -> int:
        return math.prod(self.lead)

    @property
    def is_empty(self) -> bool:
        return self.batch == 0 or self.heads == 0 or self.q_len == 0 or self.kv_len == 0

    @property
    def key(self) -> KernelKey:
        """The kernel this call runs on: lengths symbolic, except a one-query call's."""
        d_k, d_v = self.padded or (self.head_dim, self.v_head_dim)
        scale = self.head_dim ** -0.5 if self.padded and self.scale is None else self.scale  # the true width's
        return KernelKey(self.device, self.dtype, 1 if self.q_len == 1 else None, self.heads, self.kv_heads,
                         d_k, d_v, self.layout, self.causal, scale, self.mask, self.mask_dims, self.sinks)


def plan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
         is_causal: bool, scale: float | None, enable_gqa: bool, sinks: torch.Tensor | None = None) -> Plan:
    """Check the arguments as PyTorch does (TvmAttnError where it would refuse them) and choose the kernel."""
    _check_tensors(query, key, value)
    q, k, v = (_with_heads(t) for t in (query, key, value))
    heads, q_len, head_dim = q.shape[-3:]
    kv_heads, kv_len, v_head_dim = k.shape[-3], k.shape[-2], v.shape[-1]
    lead = tuple(q.shape[:-3])
    if k.shape[:-3] != q.shape[:-3] or v.shape[:-3] != q.shape[:-3]:
        raise TvmAttnError(f"query, key and value have leading (batch) dims {tuple(q.shape[:-3])}, "
                           f"{tuple(k.shape[:-3])}, {tuple(v.shape[:-3])}: they must be equal (expand them)")
    if k.shape[-1] != head_dim:
        raise TvmAttnError(f"query has head size {head_dim} but key has {k.shape[-1]}: they must match")
    if v.shape[-3:-1] != k.shape[-3:-1]:
        raise TvmAttnError(f"key (…, {kv_heads}, {kv_len}, E) and value {tuple(v.shape)} must have the same "
                           f"heads and length")
    if heads != kv_heads and not enable_gqa:
        raise TvmAttnError(f"query has {heads} heads and key/value {kv_heads}: pass enable_gqa=True for "
                           f"grouped-query attention, or repeat the key/value heads")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise TvmAttnError(f"with enable_gqa the query heads ({heads}) must be a multiple of the key/value "
                           f"heads ({kv_heads})")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise TvmAttnError(f"scale={scale!r}: tvmattn kernels take a positive finite scale (or None: "
                           f"1/sqrt(E)); fold a sign into query instead")
    mask_kind, mask_dims = None, ""
    if attn_mask is not None:
        if is_causal:
            raise TvmAttnError("attn_mask and is_causal=True were both given (PyTorch refuses this too): "
                               "fold the causal mask into attn_mask, or drop attn_mask")
        mask_kind = _mask_kind(attn_mask, query.dtype)
        mask_dims = _mask_dims(attn_mask, (*lead, heads, q_len, kv_len))
    if sinks is not None:
        _check_sinks(sinks, heads, query.device)
    layout = "BSHD" if query.dim() >= 3 and all(_is_bshd(t) for t in (q, k, v)) and not all(
        t.is_contiguous() for t in (q, k, v)) else "BHSD"
    device = "cpu" if query.device.type == "cpu" else str(query.device)
    as_given = device == "cpu" and layout == "BHSD" and all(t.dim() == 4 and t.is_contiguous() for t in (q, k, v))
    p = Plan(device, DTYPES[query.dtype], lead, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim, layout,
             bool(is_causal), None if scale is None else float(scale), mask_kind, mask_dims, as_given,
             sinks is not None)
    # (a traced call's head counts and widths may be symbolic: it pads nothing, and its output's strides
    # are the same either way, `empty_output`)
    static = all(type(x) is int for x in (heads, kv_heads, head_dim, v_head_dim))
    padded = _head_widths(p.key) if device == "cpu" and static else None
    return p if padded is None else dataclasses.replace(p, as_given=False, padded=padded)


@functools.lru_cache(maxsize=1024)
def _head_widths(key: KernelKey) -> tuple[int, int] | None:
    """The kernel's (d_k, d_v) padded for the host's tiles or dot products (`build.head_widths`), once per key: a
    decode loop plans every step anew (its cache grows), and finding the host's target takes ~0.1 ms."""
    padded = head_widths(key.spec(), resolve_target("cpu"))
    return None if padded is None else (padded.d_k, padded.d_v)


def kernel_inputs(p: Plan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None, sinks: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The kernel's (B, …) inputs: views of the tensors where their memory order allows (no copy), else
    contiguous copies; then the mask and the sinks (float32)."""
    tensors = [query, key, value] if p.as_given else [_flat(_with_heads(t), p) for t in (query, key, value)]
    if p.padded:
        widths = (p.padded[0], p.padded[0], p.padded[1])
        tensors = [torch.nn.functional.pad(t, (0, w - t.shape[-1])) for t, w in zip(tensors, widths)]
    if attn_mask is not None:
        tensors.append(_flat_mask(attn_mask, p))
    if sinks is not None:
        tensors.append(_aligned(sinks.detach().to(torch.float32).contiguous()))
    return tensors


def empty_output(p: Plan, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, …) output the kernel writes, allocated by torch, and the (…, h, L, Ev) tensor the caller
    returns: a view of it, or where the head widths are padded a tensor of its own that `unpad` fills,
    strided as without the padding (a traced call's fake output cannot know whether the host pads)."""
    bshd = p.layout == "BSHD"
    shape = (p.batch, p.q_len, p.heads, p.v_head_dim) if bshd else (p.batch, p.heads, p.q_len, p.v_head_dim)
    out = query.new_empty(shape)
    result = _caller_view(p, out, query)
    return (out, result) if p.padded is None else (query.new_empty((*shape[:-1], p.padded[1])), result)


def unpad(p: Plan, out: torch.Tensor, result: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``result`` after the kernel wrote ``out``: its columns past d_v dropped where it is padded."""
    return result if p.padded is None else result.copy_(_caller_view(p, out[..., :p.v_head_dim], query))


def _caller_view(p: Plan, out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The kernel's (B, …) output as the caller's (…, h, L, Ev)."""
    if p.layout == "BSHD":  # the transposed view is what PyTorch's own fused kernels return too
        return out.view(*p.lead, p.q_len, p.heads, p.v_head_dim).transpose(-3, -2)
    return out.view(*query.shape[:-1], p.v_head_dim)


# ---- checks ----------------------------------------------------------------------------------------
def _check_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TvmAttnError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise TvmAttnError(f"{name} has shape {tuple(t.shape)}: it needs at least (L, E)")
    if query.dtype not in DTYPES:
        raise TvmAttnError(f"query is {query.dtype}: tvmattn kernels take float32, float16 or bfloat16")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TvmAttnError(f"query, key and value are {query.dtype}, {key.dtype}, {value.dtype}: give them "
                           f"one dtype")
    if key.device != query.device or value.device != query.device:
        raise TvmAttnError(f"query, key and value are on {query.device}, {key.device}, {value.device}: move "
                           f"them to one device")
    if query.device.type not in ("cpu", "cuda"):
        raise TvmAttnError(f"query is on {query.device}: tvmattn kernels run on cpu and cuda tensors")


def _check_sinks(sinks: torch.Tensor, heads: int, device: torch.device) -> None:
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (heads,) or not sinks.is_floating_point():
        got = f"{tuple(sinks.shape)} {sinks.dtype}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise TvmAttnError(f"sinks must be a floating-point tensor of shape ({heads},), one logit per query "
                           f"head, got {got}")
    if sinks.device != device:
        raise TvmAttnError(f"sinks are on {sinks.device} and query on {device}: move them to one device")


def _mask_kind(mask: torch.Tensor, dtype: torch.dtype) -> str:
    if mask.dtype == torch.bool:
        return "bool"
    if mask.dtype != dtype:
        raise TvmAttnError(f"attn_mask is {mask.dtype}: it must be bool (True = attend) or the query's dtype "
                           f"{dtype} (added to the scores), as in PyTorch")
    return "additive"


def _mask_dims(mask: torch.Tensor, full: tuple[int, ...]) -> str:
    """The kernel mask axes (b, h, s, t) the mask varies along; the others it broadcasts along.

    An axis of size 1 in the scores counts as varying, so that a decode step (one query) and a
    prefill with the same mask layout share a kernel. A stride-0 (expanded) axis is broadcast.
    """
    try:
        torch.broadcast_shapes(mask.shape, full)
    except RuntimeError:
        raise TvmAttnError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
                           f"{full} (…, L, S)") from None
    if mask.dim() > len(full):
        raise TvmAttnError(f"attn_mask has {mask.dim()} dims, more than the scores' {full}")
    m = mask[(None,) * (len(full) - mask.dim())]
    n_lead = len(full) - 3
    lead_varies = math.prod(full[:n_lead]) == 1 or any(
        _varies(m, ax, full[ax]) and full[ax] > 1 for ax in range(n_lead))
    varies = [lead_varies] + [_varies(m, ax, full[ax]) for ax in range(n_lead, len(full))]
    return "".join(a for a, on in zip("bhst", varies) if on)


def _varies(m: torch.Tensor, ax: int, full: int) -> bool:
    return full == 1 or (m.shape[ax] == full and m.stride(ax) != 0)


# ---- conversions ---------------------------------------------------------------------------------
def _with_heads(t: torch.Tensor) -> torch.Tensor:
    """(L, E) as (1, L, E): one head."""
    return t.unsqueeze(0) if t.dim() == 2 else t


def _is_bshd(t: torch.Tensor) -> bool:
    """(…, h, L, E) stored as (…, L, h, E): a transposed view of a contiguous tensor."""
    return t.transpose(-3, -2).is_contiguous()


def _flat(t: torch.Tensor, p: Plan) -> torch.Tensor:
    """(…, h, n, e) as the kernel's (B, h, n, e) (or (B, n, h, e))."""
    h, n, e = t.shape[-3:]
    bshd = p.layout == "BSHD"
    return _aligned(t.transpose(-3, -2).reshape(p.batch, n, h, e) if bshd else t.contiguous().reshape(p.batch, h, n, e))


def _flat_mask(mask: torch.Tensor, p: Plan) -> torch.Tensor:
    """The mask as the kernel's (B|1, h|1, L|1, S|1), 1 on the axes it broadcasts along."""
    n_lead = len(p.lead)
    m = mask[(None,) * (n_lead + 3 - mask.dim())]
    for ax in range(m.dim()):
        kernel_axis = "bhst"[max(0, ax - n_lead + 1)]
        if kernel_axis not in p.mask_dims:
            m = m.narrow(ax, 0, 1)
    if "b" in p.mask_dims:
        m = m.expand(*p.lead, *m.shape[n_lead:])
    m = m.reshape(-1, *m.shape[n_lead:]) if n_lead else m.unsqueeze(0)
    m = m.to(torch.float32 if p.mask == "additive" else torch.bool)
    return _aligned(m.contiguous())


CUDA_ALIGNMENT = 64  # the CUDA kernels' vector loads need TVM's default alignment (CPU ones: an element)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # a CUDA view at an odd offset (a slice) is copied once
    return t.clone() if t.is_cuda and t.data_ptr() % CUDA_ALIGNMENT else t
