"""ONNX attention ops → tvmattn kernels: one converter per op, in a table keyed by (domain, op type).

A converter gets the `Node` (its proto, attributes, the BlockBuilder and the module's kernels) and the
node's inputs as Relax expressions (None where absent), and returns its outputs (None where the node
does not ask for one). The attention itself always becomes `kernels.attend`: the converters
only reshape heads, concatenate caches and translate masks into AttentionSpec fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import onnx
import tvm
from tvm import relax, tirx

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx.kernels import Kernels, Mask, Sizes, attend, shape_of, static

Converter = Callable[["Node", list], list]
CONVERTERS: dict[tuple[str, str], Converter] = {}


def converter(domain: str, op_type: str) -> Callable[[Converter], Converter]:
    def register(fn: Converter) -> Converter:
        CONVERTERS[(domain, op_type)] = fn
        return fn

    return register


def find(node: onnx.NodeProto) -> Converter | None:
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    return CONVERTERS.get((domain, node.op_type))


@dataclass
class Node:
    """The node being converted, and where its conversion goes."""

    proto: onnx.NodeProto
    bb: relax.BlockBuilder
    kernels: Kernels

    @property
    def name(self) -> str:
        return self.proto.name

    @property
    def op(self) -> str:
        return f"{self.proto.domain}.{self.proto.op_type}" if self.proto.domain else self.proto.op_type

    def attrs(self, allowed: dict[str, Any]) -> dict[str, Any]:
        """The node's attributes over ``allowed``'s defaults; an attribute not in ``allowed`` is an error."""
        given = {a.name: onnx.helper.get_attribute_value(a) for a in self.proto.attribute}
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            raise TvmAttnError(f"attribute {unknown[0]!r} is not supported by tvmattn's {self.op} converter "
                               f"(it knows {', '.join(sorted(allowed))})")
        for name, value in given.items():
            _check_attribute(name, value)
        return {**allowed, **given}

    def wants(self, i: int) -> bool:
        """Whether the graph uses output ``i``."""
        return i < len(self.proto.output) and self.proto.output[i] != ""

    def emit(self, expr: relax.Expr) -> relax.Var:
        return self.bb.emit(expr)

    def attend(self, q, k, v, **kw) -> list[relax.Var]:
        return attend(self.bb, self.kernels, q, k, v, nodes=(self.name,), source=f"{self.op} converter", **kw)


# The attribute values the attention ops' specifications allow (ONNX, ONNX Runtime's contrib ops):
# anything else is a malformed node, never a value with a meaning of our own.
_FLAGS = ("is_causal", "unidirectional", "do_rotary", "rotary_interleaved", "past_present_share_buffer",
          "smooth_softmax", "qk_output", "sliding_window_cache")
_HEAD_COUNTS = ("num_heads", "kv_num_heads", "q_num_heads")
_WINDOWS = ("left_window_size", "right_window_size", "local_window_size")  # -1: unbounded


def _check_attribute(name: str, value: Any) -> None:
    if name in _FLAGS and value not in (0, 1):
        raise TvmAttnError(f"attribute {name}={value!r} is out of range: it is a flag, 0 or 1")
    if name in _HEAD_COUNTS and not (isinstance(value, int) and value > 0):
        raise TvmAttnError(f"attribute {name}={value!r} is out of range: a head count is a positive integer")
    if name in _WINDOWS and not (isinstance(value, int) and value >= -1):
        raise TvmAttnError(f"attribute {name}={value!r} is out of range: a window size is -1 (unbounded) or ≥ 0")
    if name in ("scale", "softcap", "mask_filter_value") and isinstance(value, float) and np.isnan(value):
        raise TvmAttnError(f"attribute {name}=nan is not a number")


def _inputs(inputs: list, count: int) -> list:
    return list(inputs) + [None] * (count - len(inputs))


def split_heads(node: Node, x: relax.Expr, heads: int, what: str) -> relax.Var:
    """(B, n, heads·w) → (B, n, heads, w), a reshape: the BSHD layout."""
    batch, seq, hidden = shape_of(x, what)
    width = static(hidden, f"the hidden size of {what}")
    if width % heads:
        raise TvmAttnError(f"{what} has hidden size {width}, not a multiple of its {heads} heads")
    return node.emit(relax.op.reshape(x, [batch, seq, heads, width // heads]))


def merge_heads(node: Node, o: relax.Expr, layout: str) -> relax.Var:
    """O in ``layout`` → (B, n, h·d_v)."""
    if layout == "BHSD":
        o = node.emit(relax.op.permute_dims(o, [0, 2, 1, 3]))
    batch, seq, heads, width = shape_of(o, "the attention output")
    return node.emit(relax.op.reshape(o, [batch, seq, heads * width]))


def bhsd(node: Node, x: relax.Expr) -> relax.Var:
    """(B, n, h, d) ↔ (B, h, n, d)."""
    return node.emit(relax.op.permute_dims(x, [0, 2, 1, 3]))


def with_past(node: Node, past: relax.Expr | None, new: relax.Expr) -> relax.Expr:
    """The present cache (B, h_kv, past + n_new, d): ``new`` (BHSD) appended to ``past``."""
    return new if past is None else node.emit(relax.op.concat([past, new], axis=2))


# ---- ONNX Attention (opset 23, 24; windows of 25) ------------------------------------------------------
QK_OUTPUTS = {0: "scaled_scores", 1: "scaled_scores", 2: "logits", 3: "weights"}


@converter("", "Attention")
def onnx_attention(node: Node, inputs: list) -> list:
    """ONNX ``Attention``: Y = softmax(softcap(scale·Q·Kᵀ) + mask)·V, with caches, GQA and masks.

    Its causal mask and windows are aligned at the cache: query i sits at position past + i (internal
    cache), nonpad_kv_seqlen[b] - n + i (external cache) or i. Where that is the spec's top-left or
    bottom-right alignment it becomes spec fields; otherwise (a query block shorter than the new keys
    after a cache, or a one-sided window without causal) the rule is written out as a constant mask.
    """
    a = node.attrs({"is_causal": 0, "q_num_heads": None, "kv_num_heads": None, "qk_matmul_output_mode": 0,
                    "scale": None, "softcap": 0.0, "softmax_precision": None, "left_window_size": -1,
                    "right_window_size": -1})
    q, k, v, attn_mask, past_k, past_v, nonpad = _inputs(inputs, 7)
    if (past_k is None) != (past_v is None):
        raise TvmAttnError("past_key and past_value must be given together")
    if a["qk_matmul_output_mode"] not in QK_OUTPUTS:
        raise TvmAttnError(f"qk_matmul_output_mode={a['qk_matmul_output_mode']} is not 0, 1, 2 or 3")
    rank = len(shape_of(q, "Q"))
    if rank == 3:
        if a["q_num_heads"] is None or a["kv_num_heads"] is None:
            raise TvmAttnError("3-D Q, K, V need the q_num_heads and kv_num_heads attributes")
        q = split_heads(node, q, a["q_num_heads"], "Q")
        k = split_heads(node, k, a["kv_num_heads"], "K")
        v = split_heads(node, v, a["kv_num_heads"], "V")
        layout = "BSHD"
    elif rank == 4:
        layout = "BHSD"
    else:
        raise TvmAttnError(f"Q has rank {rank}: ONNX Attention takes 3-D (B, n, h·d) or 4-D (B, h, n, d)")
    n_new = shape_of(k, "K")[1 if layout == "BSHD" else 2]
    if past_k is not None or node.wants(1) or node.wants(2):  # the caches are BHSD
        if layout == "BSHD":
            q, k, v = bhsd(node, q), bhsd(node, k), bhsd(node, v)
            layout = "BHSD"
        k, v = with_past(node, past_k, k), with_past(node, past_v, v)

    sizes = Sizes()
    n_q = shape_of(q, "Q")[1 if layout == "BSHD" else 2]
    n_kv = shape_of(k, "K")[1 if layout == "BSHD" else 2]
    mask = _onnx_mask(node, attn_mask, n_kv, sizes)
    kv_lens = node.emit(relax.op.astype(nonpad, "int32")) if nonpad is not None else None
    positions = _Positions(bool(a["is_causal"]), a["left_window_size"], a["right_window_size"])
    if past_k is not None:
        offset, aligned = n_kv - n_new, sizes.equal(n_q, n_new)  # bottom-right iff the query block is the new keys
    else:
        offset, aligned = None, True  # external cache: bottom-right at kv_lens; none: top-left
    options = positions.as_spec(bottom_right=past_k is not None or nonpad is not None)
    if options is None or (options and not aligned):
        if nonpad is not None:
            raise TvmAttnError("this window, with nonpad_kv_seqlen, has no fixed alignment: tvmattn cannot "
                               "express it")
        mask = _and(node, mask, positions.constant(n_q, n_kv, offset))
        options = {}
    scale = a["scale"]
    outputs = ("attn",) + ((QK_OUTPUTS[a["qk_matmul_output_mode"]],) if node.wants(3) else ())
    y, *qk = node.attend(q, k, v, layout=layout, mask=mask, kv_lens=kv_lens, outputs=outputs,
                         scale=None if scale is None else float(scale),
                         softcap=float(a["softcap"]) if a["softcap"] else None, **options)
    if rank == 3:
        y = merge_heads(node, y, layout)
    return [y, k if node.wants(1) else None, v if node.wants(2) else None, qk[0] if qk else None]


@dataclass
class _Positions:
    """ONNX's causal flag and window sizes (-1: unbounded), relative to each query's position."""

    causal: bool
    left: int
    right: int

    def as_spec(self, bottom_right: bool) -> dict[str, Any] | None:
        """The AttentionSpec fields for this rule, or None where the spec's window cannot say it."""
        window = None
        if self.causal and self.left >= 0:
            window = self.left + 1  # causal already bounds the right side
        elif not self.causal and self.left >= 0 and self.left == self.right:
            window = self.left + 1
        elif not self.causal and (self.left >= 0 or self.right >= 0):
            return None
        if not self.causal and window is None:
            return {}
        return {"causal": self.causal, "window": window,
                "causal_align": "bottom_right" if bottom_right else "top_left"}

    def constant(self, n_q, n_kv, offset) -> np.ndarray:
        """(n_q, n_kv) bool: query i (at position offset + i) may attend to key j."""
        n_q, n_kv = static(n_q, "the query length"), static(n_kv, "the key length")
        offset = 0 if offset is None else static(offset, "the cache length")
        pos = np.arange(n_q)[:, None] + offset
        j = np.arange(n_kv)[None, :]
        ok = np.ones((n_q, n_kv), dtype=bool)
        if self.causal:
            ok &= j <= pos
        if self.left >= 0:
            ok &= pos - j <= self.left
        if self.right >= 0:
            ok &= j - pos <= self.right
        return ok


def _onnx_mask(node: Node, mask: relax.Expr | None, n_kv, sizes: Sizes) -> Mask | None:
    """ONNX's attn_mask: bool (True attends) or float (added); a key axis shorter than the keys is
    padded with False / -inf."""
    if mask is None:
        return None
    dtype = str(mask.ty.dtype)
    kind = "bool" if dtype == "bool" else "additive"
    shape = shape_of(mask, "attn_mask")
    if not sizes.equal(shape[-1], n_kv):
        fill = relax.const(False if kind == "bool" else -np.inf, dtype)
        # broadcast_to, not full: TVM 0.27 cannot legalize relax.op.full
        pad = node.emit(relax.op.broadcast_to(fill, shape[:-1] + [n_kv - shape[-1]]))
        mask = node.emit(relax.op.concat([mask, pad], axis=-1))
    return Mask(mask, kind)


def _and(node: Node, mask: Mask | None, allowed: np.ndarray) -> Mask:
    """``mask`` restricted to the keys ``allowed`` (a constant bool (n, n_kv))."""
    allowed_const = relax.const(allowed)
    if mask is None:
        return Mask(allowed_const, "bool")
    if mask.kind == "bool":
        return Mask(node.emit(relax.op.logical_and(mask.value, allowed_const)), "bool")
    hidden = relax.const(-np.inf, str(mask.value.ty.dtype))
    return Mask(node.emit(relax.op.where(allowed_const, mask.value, hidden)), "additive")


# ---- ONNX Runtime's contrib ops (domain com.microsoft) -------------------------------------------------
def _unsupported(node: Node, inputs: list, names: dict[int, str]) -> None:
    """TvmAttnError for the first input in ``names`` (index → name) the node gives."""
    for i, name in names.items():
        if i < len(inputs) and inputs[i] is not None:
            raise TvmAttnError(f"input {name!r} ({node.proto.input[i]!r}) is not supported by tvmattn's "
                               f"{node.op} converter")


def _refuse(node: Node, attrs: dict[str, Any], forbidden: dict[str, Any]) -> None:
    """TvmAttnError for the first attribute set to a value other than its default in ``forbidden``."""
    for name, default in forbidden.items():
        if attrs[name] not in (default, None):
            raise TvmAttnError(f"attribute {name}={attrs[name]!r} is not supported by tvmattn's {node.op} "
                               f"converter (only {default!r})")


def _ort_masks(node: Node, key_mask: relax.Expr | None, bias: relax.Expr | None, filter_value: float,
               n_kv=None) -> tuple[relax.Expr | None, Mask | None]:
    """ONNX Runtime's key mask and attention bias → the kernel's ``kv_lens`` and additive mask.

    key_mask (B,) holds valid key counts (right padding); (B, T) or (B, S, T) holds 1 = attend,
    0 = add ``filter_value`` (-10000 by default: ORT adds it rather than hiding the key, and so does
    the kernel, so rows with every key masked agree too). Given ``n_kv`` (causal after a cache, where
    ORT aligns queries at the cache length, not at each sequence's length as kv_lens would), counts
    become a bool mask instead of kv_lens.
    """
    kv_lens, mask = None, None
    if key_mask is not None:
        rank = len(shape_of(key_mask, "mask_index"))
        if rank == 1 and n_kv is None:
            kv_lens = node.emit(relax.op.astype(key_mask, "int32"))
        elif rank == 1:
            keys = node.emit(relax.op.arange(n_kv, dtype=str(key_mask.ty.dtype)))
            lens = node.emit(relax.op.reshape(key_mask, [shape_of(key_mask, "mask_index")[0], 1, 1, 1]))
            mask = Mask(node.emit(relax.op.less(keys, lens)), "bool")
        elif rank in (2, 3):
            shape = shape_of(key_mask, "mask_index")
            four_d = [shape[0], 1, 1, shape[1]] if rank == 2 else [shape[0], 1, shape[1], shape[2]]
            hidden = relax.op.equal(key_mask, relax.const(0, str(key_mask.ty.dtype)))
            additive = relax.op.where(hidden, relax.const(filter_value, "float32"), relax.const(0.0, "float32"))
            mask = Mask(node.emit(relax.op.reshape(node.emit(additive), four_d)), "additive")
        elif rank != 1:
            raise TvmAttnError(f"a mask_index of rank {rank} is not supported: use (B,) lengths, (B, T) or "
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


def _keys_after_cache(causal: bool, past: relax.Expr | None, k: relax.Expr):
    """The key count when ORT's causal rule is aligned at a cache (see `_ort_masks`), else None."""
    return shape_of(k, "the keys")[2] if causal and past is not None else None


def _causal(on: bool, past: relax.Expr | None, window: int | None = None) -> dict[str, Any]:
    """ORT's causal rule: query i sits at position past + i (the new tokens follow the cache)."""
    if not on:
        return {}
    return {"causal": True, "causal_align": "bottom_right" if past is not None else "top_left", "window": window}


@converter("com.microsoft", "MultiHeadAttention")
def ms_multi_head_attention(node: Node, inputs: list) -> list:
    """ORT MultiHeadAttention: 3-D Q/K/V (or 4-D BNSH K/V), packed QKV (B, S, N, 3, H) or packed KV
    (B, L, N, 2, H), optional projection bias, key padding mask, attention bias and KV cache."""
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
    if packed and bias is not None:
        raise TvmAttnError("a projection bias with packed QKV/KV is not supported")
    rank_q = len(shape_of(q, "query"))
    if rank_q != (4 if packed == "qkv" else 3) or len(shape_of(k, "key")) not in (3, 4):
        raise TvmAttnError("query must be (B, S, hidden) and key/value (B, L, hidden) or (B, N, L, H)")
    if bias is not None:
        q, k, v = _add_projection_bias(node, bias, q, k, v)
    q = split_heads(node, q, heads, "query") if packed != "qkv" else q
    kv_3d = len(shape_of(k, "key")) == 3 or packed is not None  # packed K/V are (B, L, N, H): BSHD
    k = split_heads(node, k, heads, "key") if kv_3d and not packed else k
    v = split_heads(node, v, heads, "value") if kv_3d and not packed else v
    layout = "BSHD"
    if not kv_3d or past_k is not None or node.wants(1) or node.wants(2):
        q = bhsd(node, q)
        k, v = (bhsd(node, k), bhsd(node, v)) if kv_3d else (k, v)
        k, v, layout = with_past(node, past_k, k), with_past(node, past_v, v), "BHSD"
    if node.wants(3):
        raise TvmAttnError("the qk output is not supported by tvmattn's converter")
    kv_lens, mask = _ort_masks(node, key_mask, attn_bias, float(a["mask_filter_value"]),
                               _keys_after_cache(bool(a["unidirectional"]), past_k, k))
    y, = node.attend(q, k, v, layout=layout, mask=mask, kv_lens=kv_lens,
                     scale=None if a["scale"] is None else float(a["scale"]),
                     **_causal(bool(a["unidirectional"]), past_k))
    return [merge_heads(node, y, layout), k if node.wants(1) else None, v if node.wants(2) else None]


def _unpack(node: Node, x: relax.Expr, parts: int, heads: int, what: str) -> list[relax.Var]:
    """(B, n, N, parts, H) → ``parts`` tensors (B, n, N, H), the BSHD layout."""
    shape = shape_of(x, what)
    if static(shape[2], f"the head count of {what}") != heads or static(shape[3], f"axis 3 of {what}") != parts:
        raise TvmAttnError(f"{what} has shape {tuple(shape)}: it must be (B, n, num_heads={heads}, {parts}, H)")
    return [node.emit(relax.op.squeeze(node.emit(relax.op.strided_slice(x, [3], [i], [i + 1])), [3]))
            for i in range(parts)]


def _add_projection_bias(node: Node, bias: relax.Expr, q, k, v) -> tuple:
    """bias (hidden_q + hidden_k + hidden_v) split over 3-D q, k, v."""
    if len(shape_of(k, "key")) != 3:
        raise TvmAttnError("a projection bias needs 3-D key and value")
    widths = [static(shape_of(x, name)[2], f"the hidden size of {name}") for x, name in ((q, "query"), (k, "key"),
                                                                                         (v, "value"))]
    parts = node.emit(relax.op.split(bias, [widths[0], widths[0] + widths[1]], axis=0))
    return tuple(node.emit(relax.op.add(x, node.emit(relax.TupleGetItem(parts, i)))) for i, x in enumerate((q, k, v)))


@converter("com.microsoft", "Attention")
def ms_attention(node: Node, inputs: list) -> list:
    """ORT Attention: X·W (+ bias) split into Q, K, V, then attention with mask_index, bias and past."""
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
    if mask_index is not None and len(shape_of(mask_index, "mask_index")) == 1:
        batch = shape_of(x, "input")[0]
        if not Sizes().equal(shape_of(mask_index, "mask_index")[0], batch):
            raise TvmAttnError("a (2·B,) mask_index (left padding) is not supported: use (B,) lengths or a "
                               "(B, T) mask")
    layout = "BSHD"
    if past is not None or node.wants(1):
        q, k, v = bhsd(node, q), bhsd(node, k), bhsd(node, v)
        if past is not None:
            k = with_past(node, node.emit(relax.op.take(past, relax.const(0, "int64"), axis=0)), k)
            v = with_past(node, node.emit(relax.op.take(past, relax.const(1, "int64"), axis=0)), v)
        layout = "BHSD"
    kv_lens, mask = _ort_masks(node, mask_index, attn_bias, float(a["mask_filter_value"]),
                               _keys_after_cache(bool(a["unidirectional"]), past, k))
    y, = node.attend(q, k, v, layout=layout, mask=mask, kv_lens=kv_lens,
                     scale=None if a["scale"] is None else float(a["scale"]),
                     **_causal(bool(a["unidirectional"]), past))
    present = node.emit(relax.op.stack([k, v], axis=0)) if node.wants(1) else None
    return [merge_heads(node, y, layout), present]


@converter("com.microsoft", "GroupQueryAttention")
def ms_group_query_attention(node: Node, inputs: list) -> list:
    """ORT GroupQueryAttention: GQA with a KV cache, causal, local window, softcap, attention bias, packed
    QKV when key is absent, per-sequence lengths and rotary embedding (do_rotary, cos/sin caches).

    Sequence b holds seqlens_k[b] + 1 valid keys after this step: with a cache, its past fills the first
    seqlens_k[b] + 1 - S rows of the past buffer and the S new keys are written right after them (the
    present is the past buffer plus S rows, zeros after each sequence's keys, as ORT writes it); query i
    sits at position seqlens_k[b] + 1 - S + i (bottom-right causal at each sequence's length, the
    kernel's key_padding). Without a cache (a prompt), query i sits at position i and keys past
    seqlens_k[b] are padding.
    """
    a = node.attrs({"num_heads": None, "kv_num_heads": None, "scale": None, "softcap": 0.0,
                    "local_window_size": -1, "do_rotary": 0, "rotary_interleaved": 0, "smooth_softmax": 0,
                    "qk_output": 0, "causal": 1, "sliding_window_cache": 0, "kv_cache_bit_width": 0,
                    "k_quant_type": "NONE", "v_quant_type": "NONE", "qk_norm_epsilon": 1e-6,
                    "q_norm_epsilon": None, "k_norm_epsilon": None})
    _refuse(node, {k: (v.decode() if isinstance(v, bytes) else v) for k, v in a.items()},
            {"smooth_softmax": 0, "qk_output": 0, "sliding_window_cache": 0,
             "kv_cache_bit_width": 0, "k_quant_type": "NONE", "v_quant_type": "NONE"})
    q, k, v, past_k, past_v, seqlens_k, total, cos, sin, position_ids, attn_bias = _inputs(inputs, 17)[:11]
    _unsupported(node, inputs, {11: "head_sink", 12: "k_scale", 13: "v_scale", 14: "q_norm_weight",
                                15: "k_norm_weight", 16: "query_seqlens"})
    heads, kv_heads = a["num_heads"], a["kv_num_heads"]
    if heads is None or kv_heads is None:
        raise TvmAttnError("the num_heads and kv_num_heads attributes are required")
    if (past_k is None) != (past_v is None):
        raise TvmAttnError("past_key and past_value must be given together")
    if seqlens_k is None or len(shape_of(seqlens_k, "seqlens_k")) != 1:
        raise TvmAttnError("seqlens_k must be given, a (B,) tensor of each sequence's key count minus one")
    if a["do_rotary"] and (cos is None or sin is None):
        raise TvmAttnError("do_rotary=1 needs the cos_cache and sin_cache inputs")
    if not a["do_rotary"] and (cos is not None or position_ids is not None):
        raise TvmAttnError("cos_cache, sin_cache and position_ids are only read with do_rotary=1")
    if k is None:  # packed (B, S, (h + 2·h_kv)·d)
        width = static(shape_of(q, "query")[2], "the packed QKV width") // (heads + 2 * kv_heads)
        parts = node.emit(relax.op.split(q, [heads * width, (heads + kv_heads) * width], axis=2))
        q, k, v = (node.emit(relax.TupleGetItem(parts, i)) for i in range(3))
    q, k, v = split_heads(node, q, heads, "query"), split_heads(node, k, kv_heads, "key"), \
        split_heads(node, v, kv_heads, "value")
    batch, n_new = shape_of(q, "query")[:2]
    lens = node.emit(relax.op.astype(seqlens_k, "int64"))
    lens = node.emit(relax.op.add(lens, relax.const(1, "int64")))  # each sequence's valid keys
    first = node.emit(relax.op.subtract(lens, relax.prim_value(n_new))) if past_k is not None else None
    if a["do_rotary"]:
        positions = _gqa_positions(node, position_ids, first, batch, n_new)
        q = rotary(node, q, cos, sin, positions, bool(a["rotary_interleaved"]), "query")
        k = rotary(node, k, cos, sin, positions, bool(a["rotary_interleaved"]), "key")
    q, k, v = bhsd(node, q), bhsd(node, k), bhsd(node, v)
    _check_total(total, shape_of(past_k, "past_key")[2] if past_k is not None else 0, n_new)
    if past_k is not None:
        k, v = _write_at(node, past_k, k, first), _write_at(node, past_v, v, first)
    kv_lens = node.emit(relax.op.astype(lens, "int32"))
    _, mask = _ort_masks(node, None, attn_bias, 0.0)
    # ORT 1.32 counts the query's own position in local_window_size (checked against its CPU kernel)
    window = a["local_window_size"] if a["local_window_size"] >= 0 else None
    y, = node.attend(q, k, v, layout="BHSD", mask=mask, kv_lens=kv_lens,
                     scale=None if a["scale"] is None else float(a["scale"]),
                     softcap=float(a["softcap"]) if a["softcap"] else None,
                     **_causal(bool(a["causal"]), past_k, window))
    return [merge_heads(node, y, "BHSD"), k if node.wants(1) else None, v if node.wants(2) else None]


def _check_total(total: relax.Expr | None, p_len, n_new) -> None:
    """ORT's present holds max(past buffer, total_sequence_length) rows; tvmattn's the past buffer plus
    the S new rows. A constant total_sequence_length must say the same (one computed at run time is
    taken to: the usual export computes it as past length + S)."""
    if not isinstance(total, tvm.ir.GenericConst):
        return
    value = int(np.asarray(total.value.numpy()).reshape(-1)[0])
    sizes = [d if isinstance(d, int) else int(d.value) if isinstance(d, tirx.IntImm) else None for d in (p_len, n_new)]
    if None not in sizes and value != sum(sizes):
        raise TvmAttnError(f"total_sequence_length is {value}, not the past length {sizes[0]} plus the {sizes[1]} "
                           f"new tokens: a shared past/present buffer is not supported")


def _gqa_positions(node: Node, position_ids: relax.Expr | None, first: relax.Expr | None, batch,
                   n_new) -> relax.Expr:
    """(B, S) int64 rotary positions: position_ids, else each sequence's first new position + s."""
    if position_ids is not None:
        return node.emit(relax.op.astype(position_ids, "int64"))
    steps = node.emit(relax.op.reshape(node.emit(relax.op.arange(n_new, dtype="int64")), [1, n_new]))
    if first is None:
        return node.emit(relax.op.broadcast_to(steps, [batch, n_new]))
    return node.emit(relax.op.add(node.emit(relax.op.reshape(first, [batch, 1])), steps))


def rotary(node: Node, x: relax.Expr, cos: relax.Expr, sin: relax.Expr, positions: relax.Expr,
           interleaved: bool, what: str) -> relax.Var:
    """Rotary embedding of ``x`` (B, S, h, d) at ``positions`` (B, S) from (max_position, r/2) caches:
    the first r features rotate in pairs (x[i], x[i + r/2]), or (x[2i], x[2i + 1]) interleaved; the
    rest pass through. A position past the caches' rows is clamped (ORT rejects it)."""
    batch, seq, heads, width = shape_of(x, what)
    d = static(width, f"the head width of {what}")
    half = static(shape_of(cos, "cos_cache")[-1], "the rotary width of cos_cache")
    if len(shape_of(cos, "cos_cache")) != 2 or shape_of(sin, "sin_cache")[-1].value != half or 2 * half > d:
        raise TvmAttnError(f"cos_cache and sin_cache must be (max_position, r/2) with r ≤ the head width {d}")
    c, s = (node.emit(relax.op.reshape(node.emit(relax.op.take(t, positions, axis=0, mode="clip")),
                                       [batch, seq, 1, half])) for t in (cos, sin))
    if str(c.ty.dtype) != str(x.ty.dtype):
        c, s = node.emit(relax.op.astype(c, str(x.ty.dtype))), node.emit(relax.op.astype(s, str(x.ty.dtype)))
    if interleaved:
        pairs = node.emit(relax.op.reshape(_features(node, x, 0, 2 * half), [batch, seq, heads, half, 2]))
        x1, x2 = (node.emit(relax.op.squeeze(node.emit(relax.op.strided_slice(pairs, [4], [i], [i + 1])), [4]))
                  for i in (0, 1))
    else:
        x1, x2 = _features(node, x, 0, half), _features(node, x, half, 2 * half)
    r1 = node.emit(relax.op.subtract(node.emit(relax.op.multiply(x1, c)), node.emit(relax.op.multiply(x2, s))))
    r2 = node.emit(relax.op.add(node.emit(relax.op.multiply(x2, c)), node.emit(relax.op.multiply(x1, s))))
    if interleaved:
        rotated = node.emit(relax.op.reshape(node.emit(relax.op.stack([r1, r2], axis=4)),
                                             [batch, seq, heads, 2 * half]))
    else:
        rotated = node.emit(relax.op.concat([r1, r2], axis=3))
    if 2 * half == d:
        return rotated
    return node.emit(relax.op.concat([rotated, _features(node, x, 2 * half, d)], axis=3))


def _features(node: Node, x: relax.Expr, lo: int, hi: int) -> relax.Var:
    return node.emit(relax.op.strided_slice(x, [3], [lo], [hi]))


def _write_at(node: Node, past: relax.Expr, new: relax.Expr, first: relax.Expr) -> relax.Var:
    """The present cache (B, h, P + S, d): sequence b's first[b] past rows, its S new rows, then zeros.

    A gather from [past; new; 0] along the keys; a row index that is out of range (an inconsistent
    seqlens_k) is clamped to the zero row rather than read out of bounds."""
    batch, heads, p_len, width = shape_of(past, "past_key")
    n_new = shape_of(new, "the new keys")[2]
    total = p_len + n_new
    zero = node.emit(relax.op.broadcast_to(relax.const(0, str(past.ty.dtype)), [batch, heads, 1, width]))
    rows = node.emit(relax.op.concat([past, new, zero], axis=2))
    t = node.emit(relax.op.reshape(node.emit(relax.op.arange(total, dtype="int64")), [1, 1, total, 1]))
    start = node.emit(relax.op.reshape(first, [batch, 1, 1, 1]))
    from_new = node.emit(relax.op.add(node.emit(relax.op.subtract(t, start)), relax.prim_value(p_len)))
    zero_row = node.emit(relax.op.add(node.emit(relax.op.zeros_like(t)), relax.prim_value(total)))
    index = node.emit(relax.op.where(node.emit(relax.op.less(t, start)), t,
                                     node.emit(relax.op.where(
                                         node.emit(relax.op.less(t, node.emit(relax.op.add(
                                             start, relax.prim_value(n_new))))), from_new, zero_row))))
    index = node.emit(relax.op.clip(index, 0, total))
    index = node.emit(relax.op.broadcast_to(index, [batch, heads, total, width]))
    return node.emit(relax.op.gather_elements(rows, index, axis=2))
