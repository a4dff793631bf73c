"""ONNX Runtime's MultiHeadAttention and Attention (domain com.microsoft) → tvmattn kernels.

Their masks are ONNX Runtime's: mask_filter_value (-10000) is added to a masked key's logit rather than
hiding it, so a row whose keys are all masked attends to every key alike, as ORT's does; the converters
write each mask so (`ort_masks`). GroupQueryAttention is in `gqa`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import relax, tirx

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx.converters import (
    Node,
    _inputs,
    _refuse,
    _unsupported,
    bhsd,
    merge_heads,
    split_heads,
    with_past,
)
from tvmattn.compiler.onnx.kernels import Mask, Sizes, shape_of, static

INT32_MAX = 2**31 - 1


def ort_masks(node: Node, key_mask: relax.Expr | None, bias: relax.Expr | None, filter_value: float, n_kv,
              at_cache: bool = False) -> tuple[relax.Expr | None, Mask | None]:
    """ONNX Runtime's key mask and attention bias → the kernel's ``kv_lens`` and mask, over ``n_kv`` keys.

    key_mask (B,) holds valid key counts (right padding: keys from the count on get ``filter_value``; a
    count of 0 or less, or past the keys, leaves every key alike: all of them are seen); (B, T) or (B, S, T)
    holds 1 = attend, 0 = add ``filter_value``. ``at_cache`` (causal after a cache, where ORT aligns the
    queries at the cache's length, not at each sequence's count as kv_lens would): counts become a bool mask.
    """
    kv_lens, mask = None, None
    if key_mask is not None:
        shape = shape_of(key_mask, "mask_index")
        if len(shape) == 1:
            counts = key_counts(node, key_mask, n_kv)
            if at_cache:
                keys = node.emit(relax.op.arange(n_kv, dtype="int32"))
                mask = Mask(node.emit(relax.op.less(keys, node.emit(relax.op.reshape(counts, [shape[0], 1, 1, 1])))),
                            "bool")
            else:
                kv_lens = counts
        elif len(shape) in (2, 3):
            four_d = [shape[0], 1, 1, shape[1]] if len(shape) == 2 else [shape[0], 1, shape[1], shape[2]]
            hidden = relax.op.equal(key_mask, relax.const(0, str(key_mask.ty.dtype)))
            additive = relax.op.where(hidden, relax.const(filter_value, "float32"), relax.const(0.0, "float32"))
            mask = Mask(node.emit(relax.op.reshape(node.emit(additive), four_d)), "additive")
        else:
            raise TvmAttnError(f"a mask_index of rank {len(shape)} is not supported: use (B,) lengths, (B, T) or "
                               f"(B, S, T) 0/1 masks")
    if bias is not None:
        if str(bias.ty.dtype) != "float32":
            bias = node.emit(relax.op.astype(bias, "float32"))
        if mask is not None and mask.kind == "bool":
            bias = node.emit(relax.op.where(mask.value, bias, relax.const(-np.inf, "float32")))
        elif mask is not None:
            bias = node.emit(relax.op.add(mask.value, bias))
        mask = Mask(bias, "additive")
    return kv_lens, mask


def key_counts(node: Node, counts: relax.Expr, n_kv) -> relax.Var:
    """(B,) key counts as the kernel's kv_lens: a count of 0 or less (every key masked, so every key alike)
    and one past the keys become n_kv."""
    counts = node.emit(relax.op.astype(counts, "int32"))
    full = node.emit(relax.op.add(node.emit(relax.op.zeros_like(counts)), relax.prim_value(tirx.Cast("int32", n_kv))))
    none_left = node.emit(relax.op.less_equal(counts, relax.const(0, "int32")))
    return node.emit(relax.op.where(none_left, full, node.emit(relax.op.minimum(counts, full))))


def end_start_mask(node: Node, mask_index: relax.Expr, batch, n_kv, filter_value: float) -> Mask:
    """A (2·B,) mask_index, the keys' exclusive ends then their inclusive starts (left and right padding),
    as an additive (B, 1, 1, n_kv) mask: ``filter_value`` outside [start, end)."""
    mask_index = node.emit(relax.op.astype(mask_index, "int32"))
    halves = node.emit(relax.op.split(mask_index, 2, axis=0))
    end, start = (node.emit(relax.op.reshape(node.emit(relax.TupleGetItem(halves, i)), [batch, 1, 1, 1]))
                  for i in (0, 1))
    keys = node.emit(relax.op.arange(n_kv, dtype="int32"))
    keep = node.emit(relax.op.logical_and(node.emit(relax.op.greater_equal(keys, start)),
                                          node.emit(relax.op.less(keys, end))))
    return Mask(node.emit(relax.op.where(keep, relax.const(0.0, "float32"), relax.const(filter_value, "float32"))),
                "additive")


def _causal(on: bool, past: relax.Expr | None, window: int | None = None) -> dict[str, Any]:
    """ORT's causal rule: query i sits at position past + i (the new tokens follow the cache)."""
    if not on:
        return {}
    return {"causal": True, "causal_align": "bottom_right" if past is not None else "top_left", "window": window}


def ms_multi_head_attention(node: Node, inputs: list) -> list:
    """ORT MultiHeadAttention: 3-D Q/K/V (or 4-D BNSH K/V), packed QKV (B, S, N, 3, H) or packed KV
    (B, L, N, 2, H), projection bias (on Q only where K, V are BNSH: those are taken as they are, as ORT
    does), key padding mask, attention bias and KV cache."""
    a = node.attrs({"num_heads": None, "scale": None, "mask_filter_value": -10000.0, "unidirectional": 0})
    q, k, v, bias, key_mask, attn_bias, past_k, past_v = _inputs(inputs, 10)[:8]
    _unsupported(node, inputs, {8: "past_sequence_length", 9: "cache_indirection"})
    if a["num_heads"] is None:
        raise TvmAttnError("the num_heads attribute is required")
    heads = a["num_heads"]
    packed = None
    if k is None and v is None and len(shape_of(q, "query")) == 5:  # packed QKV
        q, k, v = _unpack(node, q, 3, heads, "the packed QKV")
        packed = "qkv"
    elif k is not None and v is None and len(shape_of(k, "key")) == 5:  # packed KV
        k, v = _unpack(node, k, 2, heads, "the packed KV")
        packed = "kv"
    if k is None or v is None:
        raise TvmAttnError("needs key and value, packed QKV (B, S, N, 3, H) in query or packed KV "
                           "(B, L, N, 2, H) in key")
    rank_q = len(shape_of(q, "query"))
    if rank_q != (4 if packed == "qkv" else 3) or len(shape_of(k, "key")) not in (3, 4):
        raise TvmAttnError("query must be (B, S, hidden) and key/value (B, L, hidden) or (B, N, L, H)")
    kv_3d = len(shape_of(k, "key")) == 3 or packed is not None  # packed K/V are (B, L, N, H): BSHD
    if bias is not None:
        q, k, v = _add_projection_bias(node, bias, heads, q, k, v, kv_3d)
    q = split_heads(node, q, heads, "query") if packed != "qkv" else q
    k = split_heads(node, k, heads, "key") if kv_3d and not packed else k
    v = split_heads(node, v, heads, "value") if kv_3d and not packed else v
    layout = "BSHD"
    if not kv_3d or past_k is not None or node.wants(1) or node.wants(2):
        q = bhsd(node, q)
        k, v = (bhsd(node, k), bhsd(node, v)) if kv_3d else (k, v)
        k, v, layout = with_past(node, past_k, k), with_past(node, past_v, v), "BHSD"
    if node.wants(3):
        raise TvmAttnError("the qk output is not supported by tvmattn's converter")
    causal = bool(a["unidirectional"])
    n_kv = shape_of(k, "the keys")[2 if layout == "BHSD" else 1]
    kv_lens, mask = ort_masks(node, key_mask, attn_bias, float(a["mask_filter_value"]), n_kv,
                              at_cache=causal and past_k is not None)
    y, = node.attend(q, k, v, layout=layout, mask=mask, kv_lens=kv_lens,
                     scale=None if a["scale"] is None else float(a["scale"]), **_causal(causal, past_k))
    return [merge_heads(node, y, layout), k if node.wants(1) else None, v if node.wants(2) else None]


def _unpack(node: Node, x: relax.Expr, parts: int, heads: int, what: str) -> list[relax.Var]:
    """(B, n, N, parts, H) → ``parts`` tensors (B, n, N, H), the BSHD layout."""
    shape = shape_of(x, what)
    if static(shape[2], f"the head count of {what}") != heads or static(shape[3], f"axis 3 of {what}") != parts:
        raise TvmAttnError(f"{what} has shape {tuple(shape)}: it must be (B, n, num_heads={heads}, {parts}, H)")
    return [node.emit(relax.op.squeeze(node.emit(relax.op.strided_slice(x, [3], [i], [i + 1])), [3]))
            for i in range(parts)]


def _add_projection_bias(node: Node, bias: relax.Expr, heads: int, q, k, v, kv_biased: bool) -> tuple:
    """bias (hidden_q + hidden_k + hidden_v) added to q, k, v, each 3-D (B, n, N·H) or unpacked
    (B, n, N, H); to q alone where not ``kv_biased`` (K, V given as BNSH (B, N, L, H), taken as they are)."""
    shapes = [shape_of(x, name) for x, name in ((q, "query"), (k, "key"), (v, "value"))]
    heads_axis = [2, 2 if kv_biased else 1, 2 if kv_biased else 1]  # (B, n, N, H), or BNSH (B, N, L, H)
    widths = [static(s[2], "a hidden size") if len(s) == 3 else
              static(s[axis], "a head count") * static(s[3], "a head size") for s, axis in zip(shapes, heads_axis)]
    if sum(widths) != static(shape_of(bias, "bias")[0], "the bias' length"):
        raise TvmAttnError(f"bias has length {shape_of(bias, 'bias')[0]}, not the hidden sizes {widths} added up")
    parts = node.emit(relax.op.split(bias, [widths[0], widths[0] + widths[1]], axis=0))
    out = [q, k, v]
    for i in range(3 if kv_biased else 1):
        part = node.emit(relax.TupleGetItem(parts, i))
        if len(shapes[i]) == 4:  # unpacked (B, n, N, H)
            part = node.emit(relax.op.reshape(part, [heads, widths[i] // heads]))
        out[i] = node.emit(relax.op.add(out[i], part))
    return tuple(out)


def ms_attention(node: Node, inputs: list) -> list:
    """ORT Attention: X·W (+ bias) split into Q, K, V, then attention with mask_index, bias and past.
    A 1-D mask_index is (B,) key counts, or (2·B,) ends then starts: where its length is not provably B,
    the second, checked when the model runs."""
    a = node.attrs({"num_heads": None, "unidirectional": 0, "scale": None, "mask_filter_value": -10000.0,
                    "qkv_hidden_sizes": None, "do_rotary": 0, "past_present_share_buffer": 0,
                    "rotary_embedding_dim": 0})
    _refuse(node, a, {"do_rotary": 0, "past_present_share_buffer": 0})
    x, weights, bias, mask_index, past, attn_bias = _inputs(inputs, 7)[:6]
    _unsupported(node, inputs, {6: "past_sequence_length"})
    heads = a["num_heads"]
    if heads is None:
        raise TvmAttnError("the num_heads attribute is required")
    total = static(shape_of(weights, "weights")[1], "the weights' width")
    sizes = list(a["qkv_hidden_sizes"] or [total // 3] * 3)
    if sum(sizes) != total or any(s % heads for s in sizes):
        raise TvmAttnError(f"qkv_hidden_sizes {sizes} must add up to the weights' width {total} and divide "
                           f"by num_heads={heads}")
    qkv = node.emit(relax.op.matmul(x, weights))
    if bias is not None:
        qkv = node.emit(relax.op.add(qkv, bias))
    parts = node.emit(relax.op.split(qkv, [sizes[0], sizes[0] + sizes[1]], axis=2))
    q, k, v = (split_heads(node, node.emit(relax.TupleGetItem(parts, i)), heads, n)
               for i, n in enumerate(("Q", "K", "V")))
    layout = "BSHD"
    if past is not None or node.wants(1):
        q, k, v = bhsd(node, q), bhsd(node, k), bhsd(node, v)
        if past is not None:
            k = with_past(node, node.emit(relax.op.take(past, relax.const(0, "int64"), axis=0)), k)
            v = with_past(node, node.emit(relax.op.take(past, relax.const(1, "int64"), axis=0)), v)
        layout = "BHSD"
    batch, n_kv = shape_of(x, "input")[0], shape_of(k, "the keys")[2 if layout == "BHSD" else 1]
    causal, filter_value = bool(a["unidirectional"]), float(a["mask_filter_value"])
    if mask_index is not None and len(shape_of(mask_index, "mask_index")) == 1:
        mask_index = node.in_range(mask_index, "input 'mask_index' (key counts or positions) must not be "
                                               "negative", 0, INT32_MAX)
    if mask_index is not None and len(shape_of(mask_index, "mask_index")) == 1 and \
            not Sizes().equal(shape_of(mask_index, "mask_index")[0], batch):
        mask_index = node.bb.match_cast(mask_index, relax.TensorType([2 * batch], str(mask_index.ty.dtype)))
        positions = end_start_mask(node, mask_index, batch, n_kv, filter_value)
        _, mask = ort_masks(node, None, attn_bias, filter_value, n_kv)
        mask = Mask(node.emit(relax.op.add(positions.value, mask.value)), "additive") if mask else positions
        kv_lens = None
    else:
        kv_lens, mask = ort_masks(node, mask_index, attn_bias, filter_value, n_kv, at_cache=causal and past is not None)
    y, = node.attend(q, k, v, layout=layout, mask=mask, kv_lens=kv_lens,
                     scale=None if a["scale"] is None else float(a["scale"]), **_causal(causal, past))
    present = node.emit(relax.op.stack([k, v], axis=0)) if node.wants(1) else None
    return [merge_heads(node, y, layout), present]
