"""Rotary position embeddings (RoPE), written once for the converters that apply them: ONNX's and ONNX
Runtime's ``RotaryEmbedding`` (`ops`) and GroupQueryAttention's ``do_rotary`` (`gqa`)."""

from __future__ import annotations

from tvm import relax

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx.converters import Node
from tvmattn.compiler.onnx.kernels import shape_of, static

op = relax.op


def rotate(node: Node, x: relax.Expr, cos: relax.Expr, sin: relax.Expr, interleaved: bool, rotary_dim: int,
           head_axis: int) -> relax.Var:
    """RoPE on a 4-D ``x`` whose axis 3 holds each head's features, its heads on ``head_axis`` (1:
    (B, h, S, d), 2: (B, S, h, d)), with cos, sin (B, S, r/2): the first r (``rotary_dim``, 0: all)
    features of each head rotate in pairs (x₁, x₂) → (x₁cos − x₂sin, x₁sin + x₂cos), the pairs being
    (i, i + r/2), or (2i, 2i + 1) when interleaved; features past r pass through."""
    dims = shape_of(x, "the input")
    head = static(dims[3], "the head size")
    rotary_dim = rotary_dim or head
    if rotary_dim % 2 or rotary_dim > head:
        raise TvmAttnError(f"rotary_embedding_dim={rotary_dim} must be even and at most the head size {head}")
    if str(cos.ty.dtype) != str(x.ty.dtype):
        cos, sin = (node.emit(op.astype(c, str(x.ty.dtype))) for c in (cos, sin))
    cos, sin = (node.emit(op.expand_dims(c, head_axis)) for c in (cos, sin))
    half = rotary_dim // 2

    def features(begin: int, end: int, stride: int = 1) -> relax.Var:
        return node.emit(op.strided_slice(x, axes=[3], begin=[begin], end=[end], strides=[stride]))

    x1, x2 = (features(0, rotary_dim, 2), features(1, rotary_dim, 2)) if interleaved else \
        (features(0, half), features(half, rotary_dim))
    real = node.emit(op.subtract(op.multiply(x1, cos), op.multiply(x2, sin)))
    imag = node.emit(op.add(op.multiply(x1, sin), op.multiply(x2, cos)))
    if interleaved:  # (…, r/2, 2) → (…, r): each pair back in its place
        rotated = node.emit(op.reshape(op.stack([real, imag], axis=4), dims[:3] + [rotary_dim]))
    else:
        rotated = node.emit(op.concat([real, imag], axis=3))
    if rotary_dim < head:
        rotated = node.emit(op.concat([rotated, features(rotary_dim, head)], axis=3))
    return rotated


def at_positions(node: Node, positions: relax.Expr, cos: relax.Expr, sin: relax.Expr,
                 check: bool = True) -> tuple[relax.Var, relax.Var]:
    """The (max_position, r/2) caches' rows at ``positions`` (B, S): checked to lie in them on CPU where
    ``check`` (the caller checked them otherwise), else one past them clamped."""
    if check:
        positions = node.in_range(positions, "input 'position_ids' must index cos_cache's rows", 0,
                                  shape_of(cos, "cos_cache")[0])
    return tuple(node.emit(op.take(c, positions, axis=0, mode="clip")) for c in (cos, sin))
