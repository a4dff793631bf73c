"""ONNX attention ops → tvmattn kernels: one converter per op (the import finds them in `registry.OPS`).

A converter gets the `Node` (its proto, attributes, the BlockBuilder and the module's kernels) and the
node's inputs as Relax expressions (None where absent), and returns its outputs (None where the node
does not ask for one). The attention itself always becomes `kernels.attend`: the converters
only reshape heads, concatenate caches and translate masks into AttentionSpec fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import onnx
from tvm import relax, tirx

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx import run_checks
from tvmattn.compiler.onnx.kernels import Kernels, Mask, Sizes, attend, shape_of, static
from tvmattn.compiler.target import is_cpu

Converter = Callable[["Node", list], list]


@dataclass
class Node:
    """The node being converted, and where its conversion goes. ``declared``: the shapes the graph
    declares for its tensors (name → sizes, a number, a name or None each), where it declares them."""

    proto: onnx.NodeProto
    bb: relax.BlockBuilder
    kernels: Kernels
    declared: Mapping[str, tuple] = field(default_factory=dict)

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

    @property
    def checks(self) -> bool:
        """Whether index inputs are checked at run time (`run_checks.in_range`: a serial CPU loop)."""
        return is_cpu(self.kernels.target)

    def in_range(self, values: relax.Expr, what: str, lo, hi, carry: relax.Expr | None = None) -> relax.Expr:
        """``carry`` (default ``values``) after a run-time check that ``values`` lie in [lo, hi), on CPU
        targets (elsewhere as it is): an error naming this node and ``what`` if not."""
        if not self.checks:
            return values if carry is None else carry
        return run_checks.in_range(self.bb, f"node {self.name!r} ({self.op}): {what}", values, lo, hi, carry)

    def write_in_place(self, func: tirx.PrimFunc, name: str, caches: tuple, rest: list) -> tuple[relax.Var, ...]:
        """``caches`` (this node's inputs 3 and 4) written by ``func(*caches, *rest)`` in place
        (``call_tir_inplace``), returned as its outputs; the node's outputs 1 and 2 are recorded as
        their aliases (`ImportReport.in_place`): a run hands back the arrays it was given."""
        out = self.emit(relax.call_tir_inplace(self.bb.add_func(func, name), [*caches, *rest],
                                               list(range(len(caches))), [c.ty for c in caches]))
        for i, into in ((1, 3), (2, 4)):
            if self.wants(i):
                self.kernels.in_place[self.proto.output[i]] = self.proto.input[into]
        return tuple(self.emit(relax.TupleGetItem(out, i)) for i in range(len(caches)))

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


def graph_input(x: relax.Expr) -> bool:
    """A tensor the model was given (its function's parameter), not one computed in it: what an op
    may write in place."""
    return isinstance(x, relax.Var) and not isinstance(x, relax.DataflowVar)


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
