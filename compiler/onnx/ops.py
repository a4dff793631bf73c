"""Operators real exports contain that TVM 0.27's ONNX importer lacks (or gets wrong), one converter each
(the import finds them in `registry.OPS`, keyed by (domain, op type)).

The standard opset-23 ``RotaryEmbedding`` and ``RMSNormalization`` (torch's dynamo exporter at opset 23
writes them for Llama, Mistral and Qwen2), and the contrib ops ONNX Runtime's transformer optimizer
fuses BERT, GPT-2 and ViT into (domain com.microsoft). TVM's importer looks ops up by type alone, so
without these the contrib ``Gelu`` or ``SkipLayerNormalization`` reach TVM's converters of other
specifications. Each docstring states the op's math; each is checked against ONNX Runtime in
tests/test_onnx_ops.py. Norms and GELUs compute in float32, as ONNX Runtime's CPU kernels do.
"""

from __future__ import annotations

import math

from tvm import relax

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx import rotary
from tvmattn.compiler.onnx.converters import Node, _inputs
from tvmattn.compiler.onnx.kernels import shape_of, static

op = relax.op


def _const(value: float, like: relax.Expr) -> relax.Constant:
    return relax.const(value, str(like.ty.dtype))


def _refuse_outputs(node: Node, names: dict[int, str]) -> None:
    """TvmAttnError for the first output in ``names`` (index → name) the graph uses."""
    for i, name in names.items():
        if node.wants(i):
            raise TvmAttnError(f"output {name!r} ({node.proto.output[i]!r}) is not supported by tvmattn's "
                               f"{node.op} converter: only the normalised output (and the residual sum)")


def _axes(node: Node, x: relax.Expr, axis: int) -> list[int]:
    """The trailing axes from ``axis`` on, over which the norms normalise."""
    rank = len(shape_of(x, "the input"))
    if not -rank <= axis < rank:
        raise TvmAttnError(f"axis={axis} is out of range for an input of rank {rank}")
    return list(range(axis % rank, rank))


def _layer_norm(node: Node, x, gamma, beta, epsilon: float, axis: int = -1) -> relax.Var:
    """(x − mean(x)) / √(var(x) + ε) · γ + β over the trailing axes."""
    beta = beta if beta is not None else op.zeros_like(gamma)
    return node.emit(op.nn.layer_norm(x, gamma, beta, axes=_axes(node, x, axis), epsilon=epsilon))


def _rms_norm(node: Node, x, gamma, epsilon: float, axis: int = -1) -> relax.Var:
    """x / √(mean(x²) + ε) · γ over the trailing axes."""
    axes = _axes(node, x, axis)
    mean_square = node.emit(op.mean(op.multiply(x, x), axis=axes, keepdims=True))
    inv_rms = node.emit(op.rsqrt(op.add(mean_square, _const(epsilon, x))))
    return node.emit(op.multiply(op.multiply(x, inv_rms), gamma))


def _sum(node: Node, *terms: relax.Expr | None) -> relax.Expr:
    """The sum of the given terms (None: absent)."""
    present = [t for t in terms if t is not None]
    total = present[0]
    for t in present[1:]:
        total = node.emit(op.add(total, t))
    return total


# ---- norms ---------------------------------------------------------------------------------------------
def rms_normalization(node: Node, inputs: list) -> list:
    """ONNX RMSNormalization (opset 23): Y = X / √(mean(X², axes ≥ axis) + ε) · scale."""
    a = node.attrs({"axis": -1, "epsilon": 1e-5, "stash_type": 1})
    x, scale = _inputs(inputs, 2)
    return [_rms_norm(node, x, scale, float(a["epsilon"]), a["axis"])]


def simplified_layer_normalization(node: Node, inputs: list) -> list:
    """ORT SimplifiedLayerNormalization (a contrib op ORT registers in the ONNX domain):
    Y = X / √(mean(X², axes ≥ axis) + ε) · scale (RMSNorm)."""
    a = node.attrs({"axis": -1, "epsilon": 1e-5, "stash_type": 1})
    x, scale = _inputs(inputs, 2)
    _refuse_outputs(node, {1: "inv_std_var"})
    return [_rms_norm(node, x, scale, float(a["epsilon"]), a["axis"])]


def skip_layer_normalization(node: Node, inputs: list) -> list:
    """ORT SkipLayerNormalization: S = input + skip (+ bias); output = LayerNorm(S)·γ + β; outputs 1 and
    2 are S's mean and 1/√(var + ε) over the last axis (keeping it), output 3 is S."""
    a = node.attrs({"epsilon": 1e-12})
    x, skip, gamma, beta, bias = _inputs(inputs, 5)
    total = _sum(node, x, skip, bias)
    epsilon = float(a["epsilon"])
    mean = node.emit(op.mean(total, axis=[-1], keepdims=True)) if node.wants(1) or node.wants(2) else None
    inv_std = None
    if node.wants(2):
        centred = node.emit(op.subtract(total, mean))
        variance = node.emit(op.mean(op.multiply(centred, centred), axis=[-1], keepdims=True))
        inv_std = node.emit(op.rsqrt(op.add(variance, _const(epsilon, total))))
    return [_layer_norm(node, total, gamma, beta, epsilon), mean, inv_std, total]


def skip_simplified_layer_normalization(node: Node, inputs: list) -> list:
    """ORT SkipSimplifiedLayerNormalization: S = input + skip (+ bias); output = S / √(mean(S²) + ε)·γ;
    output 2 is 1/√(mean(S²) + ε) over the last axis (keeping it), output 1 (mean) zeros as ORT's CPU EP
    writes them, output 3 is S."""
    a = node.attrs({"epsilon": 1e-12})
    x, skip, gamma, bias = _inputs(inputs, 4)
    total = _sum(node, x, skip, bias)
    epsilon = float(a["epsilon"])
    kept = shape_of(total, "the sum")[:-1] + [1]
    mean = node.emit(op.zeros(relax.ShapeExpr(kept), str(total.ty.dtype))) if node.wants(1) else None
    inv_rms = None
    if node.wants(2):
        mean_square = node.emit(op.mean(op.multiply(total, total), axis=[-1], keepdims=True))
        inv_rms = node.emit(op.rsqrt(op.add(mean_square, _const(epsilon, total))))
    return [_rms_norm(node, total, gamma, epsilon), mean, inv_rms, total]


def embed_layer_normalization(node: Node, inputs: list) -> list:
    """ORT EmbedLayerNormalization (BERT's embeddings):
    E = word[input_ids] + position[position_ids or 0‥S−1] (+ segment[segment_ids]);
    output = LayerNorm(E)·γ + β; mask_index[b] = Σ_s mask[b, s] (int32; 0 without a mask); output 2 is E."""
    a = node.attrs({"epsilon": 1e-12, "mask_index_type": 1})
    ids, segment_ids, word, position, segment, gamma, beta, mask, position_ids = _inputs(inputs, 9)
    if a["mask_index_type"] not in (0, 1):
        raise TvmAttnError(f"attribute mask_index_type={a['mask_index_type']} is out of range: 0 or 1")
    batch, seq = shape_of(ids, "input_ids")
    if position_ids is None:
        position_ids = node.emit(op.arange(seq, dtype="int64"))
    if (segment_ids is None) != (segment is None):
        raise TvmAttnError("segment_ids and segment_embedding must be given together")
    terms = [op.take(word, ids, axis=0), op.take(position, position_ids, axis=0)]
    if segment is not None:
        terms.append(op.take(segment, segment_ids, axis=0))
    total = _sum(node, *(node.emit(t) for t in terms))
    if len(shape_of(total, "the embedding sum")) == 2:  # positions (S,) broadcast over a batch of one
        total = node.emit(op.broadcast_to(total, [batch, seq, shape_of(total, "the embedding sum")[-1]]))
    if mask is not None and a["mask_index_type"] == 1:
        mask_index = node.emit(op.sum(op.astype(mask, "int32"), axis=[1]))
    else:
        # broadcast_to, not zeros: TVM 0.27 cannot legalize relax.op.full
        mask_index = node.emit(op.broadcast_to(relax.const(0, "int32"), [batch]))
    return [_layer_norm(node, total, gamma, beta, float(a["epsilon"])), mask_index, total]


# ---- GELUs ---------------------------------------------------------------------------------------------
def _erf_gelu(node: Node, x: relax.Expr) -> relax.Var:
    """x · ½(1 + erf(x / √2))."""
    half = _const(0.5, x)
    return node.emit(op.multiply(op.multiply(x, half),
                                 op.add(_const(1.0, x), op.erf(op.multiply(x, _const(1 / math.sqrt(2), x))))))


def ms_gelu(node: Node, inputs: list) -> list:
    """ORT Gelu: Y = X · ½(1 + erf(X / √2))."""
    node.attrs({})
    return [_erf_gelu(node, inputs[0])]


def bias_gelu(node: Node, inputs: list) -> list:
    """ORT BiasGelu: Y = Gelu(A + B), Gelu with erf."""
    node.attrs({})
    return [_erf_gelu(node, node.emit(op.add(inputs[0], inputs[1])))]


def fast_gelu(node: Node, inputs: list) -> list:
    """ORT FastGelu: x = X (+ bias); Y = ½x(1 + tanh(√(2/π)(x + 0.044715x³))), GELU's tanh form."""
    node.attrs({})
    x, bias = _inputs(inputs, 2)
    x = _sum(node, x, bias)
    inner = op.multiply(op.add(x, op.multiply(_const(0.044715, x), op.multiply(x, op.multiply(x, x)))),
                        _const(math.sqrt(2 / math.pi), x))
    return [node.emit(op.multiply(op.multiply(_const(0.5, x), x), op.add(_const(1.0, x), op.tanh(inner))))]


def quick_gelu(node: Node, inputs: list) -> list:
    """ORT QuickGelu: Y = X · sigmoid(α·X), α = 1.702 by default (CLIP's activation)."""
    a = node.attrs({"alpha": 1.702})
    x = inputs[0]
    return [node.emit(op.multiply(x, op.sigmoid(op.multiply(x, _const(float(a["alpha"]), x)))))]


# ---- rotary position embeddings (`rotary`) ---------------------------------------------------------------
def _rotate(node: Node, x: relax.Expr, cos: relax.Expr, sin: relax.Expr, interleaved: bool, rotary_dim: int,
            heads: int) -> relax.Var:
    """`rotary.rotate` of x (B, h, S, d), or of (B, S, h·d) seen as (B, S, h, d)."""
    shape = shape_of(x, "the input")
    if len(shape) == 4:
        return rotary.rotate(node, x, cos, sin, interleaved, rotary_dim, head_axis=1)
    if len(shape) != 3:
        raise TvmAttnError(f"the input has rank {len(shape)}: RotaryEmbedding takes (B, h, S, d) or (B, S, h·d)")
    if not heads:
        raise TvmAttnError("a 3-D input needs the num_heads attribute")
    width = static(shape[2], "the hidden size")
    x4 = node.emit(op.reshape(x, [shape[0], shape[1], heads, width // heads]))
    return node.emit(op.reshape(rotary.rotate(node, x4, cos, sin, interleaved, rotary_dim, head_axis=2), shape))


def rotary_embedding(node: Node, inputs: list) -> list:
    """ONNX RotaryEmbedding (opset 23): X (B, h, S, d) or (B, S, h·d); cos_cache, sin_cache (B, S, r/2),
    or (max_position, r/2) indexed by position_ids (B, S); each pair (x₁, x₂) of the first r features
    → (x₁cos − x₂sin, x₁sin + x₂cos)."""
    a = node.attrs({"interleaved": 0, "rotary_embedding_dim": 0, "num_heads": 0})
    x, cos, sin, position_ids = _inputs(inputs, 4)
    if position_ids is not None:
        cos, sin = rotary.at_positions(node, position_ids, cos, sin)
    return [_rotate(node, x, cos, sin, bool(a["interleaved"]), a["rotary_embedding_dim"], a["num_heads"])]


def ms_rotary_embedding(node: Node, inputs: list) -> list:
    """ORT RotaryEmbedding: as ONNX's, with inputs (input, position_ids, cos_cache, sin_cache); the caches
    are (max_position, r/2) and position_ids (B, S) or (1,), an offset: positions offset + 0‥S−1. A 3-D
    input without num_heads has heads of 2·(r/2) features (the head size from the cache, as ORT derives
    it). ``scale`` and ``is_packed_batching`` change nothing on ORT's CPU EP (scale is for a cache it
    would extend, packed batching for its CUDA kernel), nor here."""
    a = node.attrs({"interleaved": 0, "rotary_embedding_dim": 0, "num_heads": 0, "scale": 1.0,
                    "is_packed_batching": 0})
    x, position_ids, cos, sin = _inputs(inputs, 4)
    shape = shape_of(x, "the input")
    if a["rotary_embedding_dim"] and not a["num_heads"]:
        raise TvmAttnError("rotary_embedding_dim needs the num_heads attribute (ONNX Runtime's rule)")
    heads = a["num_heads"]
    if len(shape) == 3 and not heads:  # heads of the cache's width
        head = 2 * static(shape_of(cos, "cos_cache")[-1], "cos_cache's width")
        hidden = static(shape[2], "the hidden size")
        if hidden % head:
            raise TvmAttnError(f"the hidden size {hidden} is no multiple of the head size {head} that cos_cache's "
                               f"width gives: give num_heads")
        heads = hidden // head
    if len(shape_of(position_ids, "position_ids")) == 1:  # an offset: the positions follow it
        seq = shape[1 if len(shape) == 3 else 2]
        steps = node.emit(op.arange(seq, dtype=str(position_ids.ty.dtype)))
        position_ids = node.emit(op.expand_dims(op.add(steps, position_ids), 0))
    cos, sin = rotary.at_positions(node, position_ids, cos, sin)
    return [_rotate(node, x, cos, sin, bool(a["interleaved"]), a["rotary_embedding_dim"], heads)]


# ---- einsum ------------------------------------------------------------------------------------------------
def einsum(node: Node, inputs: list) -> list:
    """Relax's einsum (TVM's converter writes `topi.einsum` straight into a function): before legalisation,
    one of two operands that is a batched matmul becomes one (`schedules.ops.einsum`)."""
    equation = node.attrs({"equation": None})["equation"]
    equation = equation.decode() if isinstance(equation, bytes) else equation
    return [node.emit(op.einsum(list(inputs), equation))]
