"""Multi-head attention as a TVM tensor expression, one `te.compute` per stage of the seeds.

    x (B,n,d) ──q_proj──► (B,n,h·d_k) ──q_heads──► (B,h,n,d_k) ─┐
    x_kv (B,n_kv,d) ─k_proj/v_proj─► k_heads, v_heads (B,h_kv,n_kv,d_k|d_v)
    scores  = q·kᵀ                         (B,h,n,n_kv)   fp32 accumulation
    logits  = cap(scale·scores) + bias,    (B,h,n,n_kv)   cap: softcap·tanh(·/softcap) if set;
              masked to -inf                              bias: an additive attn_mask
    row_max = max_t logits                 (B,h,n)
    probs   = exp(logits - row_max)        (B,h,n,n_kv)   0 where masked
    row_sum = Σ_t probs                    (B,h,n)
    pv      = probs·v                      (B,h,n,d_v)
    attn    = pv / row_sum                 (B,h,n,d_v)    0 for a row that sees no key
    merged  = heads side by side           (B,n,h·d_v)
    out     = merged·W_O                   (B,n,d)

The core kernel (``projections=False``) starts at q, k, v in the spec's layout and ends at attn in
that layout, or, when ``spec.output`` names one, at an intermediate (B,h,n,n_kv) stage. Cross-attention,
GQA, both layouts and broadcast masks only change index maps.

Axis names are part of the contract: b batch, i query head, s query position, t key position,
e the q·k dot product, c a value column. TVM names a block's iterators after them (v_b, v_s, v_t, …),
and the stages that range over keys carry ``tvmattn.key_stage``: the block-skipping pass reads both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import tvm
from tvm import te, tirx
from tvm.ir.expr import Expr as PrimExpr

from . import mask
from .spec import MASK_AXES, AttentionSpec, Dim

ACC = "float32"  # accumulation dtype, whatever the input dtype
KEY_STAGE = "tvmattn.key_stage"


@dataclass
class AttentionTE:
    """The tensor expression of one spec: inputs in call order, the output, every named stage."""

    spec: AttentionSpec
    inputs: list[te.Tensor]
    output: te.Tensor
    stages: dict[str, te.Tensor]
    dims: dict[str, tirx.Var]  # symbolic sizes by name

    def prim_func(self) -> tirx.PrimFunc:
        return te.create_prim_func(self.inputs + [self.output]).with_attr("global_symbol", "main")


def attention_te(spec: AttentionSpec) -> AttentionTE:
    """Build the tensor expression of ``spec`` (see the module docstring for the stages)."""
    dims: dict[str, tirx.Var] = {}

    def dim(x: Dim):
        if isinstance(x, str):
            return dims.setdefault(x, te.var(x))
        return x

    B, n, n_kv = dim(spec.batch), dim(spec.n_q), dim(spec.n_kv)
    h, h_kv, d_k, d_v, d, g = spec.h, spec.h_kv, spec.d_k, spec.d_v, spec.d, spec.group
    dt = spec.dtype
    stages: dict[str, te.Tensor] = {}
    inputs: list[te.Tensor] = []

    if spec.projections:
        x = te.placeholder((B, n, d), dt, "x")
        x_kv = te.placeholder((B, n_kv, d), dt, "x_kv") if spec.is_cross else x
        w_q = te.placeholder((d, h * d_k), dt, "w_q")
        w_k = te.placeholder((d, h_kv * d_k), dt, "w_k")
        w_v = te.placeholder((d, h_kv * d_v), dt, "w_v")
        w_o = te.placeholder((h * d_v, d), dt, "w_o")
        inputs += [x] + ([x_kv] if spec.is_cross else []) + [w_q, w_k, w_v, w_o]
        stages["q_proj"] = linear(x, w_q, "q_proj")
        stages["k_proj"] = linear(x_kv, w_k, "k_proj")
        stages["v_proj"] = linear(x_kv, w_v, "v_proj")
        stages["q_heads"] = _split_heads(stages["q_proj"], h, d_k, "q_heads")
        stages["k_heads"] = _split_heads(stages["k_proj"], h_kv, d_k, "k_heads")
        stages["v_heads"] = _split_heads(stages["v_proj"], h_kv, d_v, "v_heads")
        q_at, k_at, v_at = (_bhsd_reader(stages[f"{c}_heads"], "BHSD") for c in "qkv")
    else:
        shapes = spec.input_shapes()
        q, k, v = (te.placeholder(tuple(dim(x) for x in shapes[name]), dt, name) for name in "qkv")
        inputs += [q, k, v]
        q_at, k_at, v_at = (_bhsd_reader(t, spec.layout) for t in (q, k, v))

    if spec.key_padding:
        kv_lens = te.placeholder((B,), "int32", "kv_lens")
        inputs.append(kv_lens)
        kv_len = lambda b: kv_lens[b]  # noqa: E731
    else:
        kv_len = lambda b: tirx.const(n_kv, "int32") if isinstance(n_kv, int) else n_kv  # noqa: E731

    mask_at = _attn_mask(spec, dim, inputs)

    def visible(b, i, s, t):
        seen = mask.visible(spec, s, t, kv_len(b), _as_expr(n))
        if spec.attn_mask == "bool":
            return tirx.all(seen, mask_at(b, i, s, t))
        if spec.attn_mask == "additive":  # a -inf bias hides the key like a False would
            return tirx.all(seen, mask_at(b, i, s, t) > -tirx.infinity(ACC))
        return seen

    e = te.reduce_axis((0, d_k), "e")
    scores = te.compute(
        (B, h, n, n_kv),
        lambda b, i, s, t: te.sum(q_at(b, i, s, e).astype(ACC) * k_at(b, i // g, t, e).astype(ACC), axis=e),
        name="scores", attrs={KEY_STAGE: 1})
    scale = tirx.const(spec.softmax_scale, ACC)

    def scaled(b, i, s, t):
        x = scores[b, i, s, t] * scale
        if spec.softcap is None:
            return x
        return tirx.const(spec.softcap, ACC) * tirx.tanh(x * tirx.const(1.0 / spec.softcap, ACC))

    def logit(b, i, s, t):
        x = scaled(b, i, s, t)
        if spec.attn_mask == "additive":
            x = x + mask_at(b, i, s, t)
        return tirx.Select(visible(b, i, s, t), x, -tirx.infinity(ACC))

    logits = te.compute((B, h, n, n_kv), logit, name="logits", attrs={KEY_STAGE: 1})
    t = te.reduce_axis((0, n_kv), "t")
    row_max = te.compute((B, h, n), lambda b, i, s: te.max(logits[b, i, s, t], axis=t),
                         name="row_max", attrs={KEY_STAGE: 1})
    probs = te.compute(
        (B, h, n, n_kv),
        lambda b, i, s, t: tirx.Select(visible(b, i, s, t), tirx.exp(logits[b, i, s, t] - row_max[b, i, s]),
                                       tirx.const(0, ACC)),
        name="probs", attrs={KEY_STAGE: 1})
    t = te.reduce_axis((0, n_kv), "t")
    row_sum = te.compute((B, h, n), lambda b, i, s: te.sum(probs[b, i, s, t], axis=t),
                         name="row_sum", attrs={KEY_STAGE: 1})
    t = te.reduce_axis((0, n_kv), "t")
    pv = te.compute((B, h, n, d_v),
                    lambda b, i, s, c: te.sum(probs[b, i, s, t] * v_at(b, i // g, t, c).astype(ACC), axis=t),
                    name="pv", attrs={KEY_STAGE: 1})

    def normalise(b, i, s, c):
        total = row_sum[b, i, s]
        return tirx.Select(total > 0, pv[b, i, s, c] / total, tirx.const(0, ACC)).astype(dt)

    stages.update(scores=scores, logits=logits, row_max=row_max, probs=probs, row_sum=row_sum, pv=pv)
    if spec.output != "attn":
        def weight(b, i, s, t):
            total = row_sum[b, i, s]
            return tirx.Select(total > 0, probs[b, i, s, t] / total, tirx.const(0, ACC))

        stage = {"scaled_scores": scaled, "logits": logits, "weights": weight}[spec.output]
        # Not a key stage: key-tile skipping must not apply here, the hidden entries are part of the output.
        out = te.compute((B, h, n, n_kv), lambda b, i, s, t: stage(b, i, s, t).astype(dt), name=spec.output)
        stages[spec.output] = out
    elif spec.projections:
        attn = te.compute((B, h, n, d_v), normalise, name="attn")
        merged = te.compute((B, n, h * d_v), lambda b, s, m: attn[b, m // d_v, s, m % d_v], name="merged")
        out = linear(merged, w_o, "out")
        stages.update(attn=attn, merged=merged, out=out)
    elif spec.layout == "BHSD":
        out = te.compute((B, h, n, d_v), normalise, name="attn")
        stages["attn"] = out
    else:
        out = te.compute((B, n, h, d_v), lambda b, s, i, c: normalise(b, i, s, c), name="attn")
        stages["attn"] = out
    return AttentionTE(spec, inputs, out, stages, dims)


def _attn_mask(spec: AttentionSpec, dim: Callable, inputs: list[te.Tensor]) -> Callable | None:
    """The mask tensor's reader at (b, head, s, t), reading index 0 on the axes it broadcasts along."""
    if spec.attn_mask is None:
        return None
    m = te.placeholder(tuple(dim(x) for x in spec.attn_mask_shape()), spec.input_dtype("attn_mask"), "attn_mask")
    inputs.append(m)
    return lambda *index: m[tuple(ix if axis in spec.attn_mask_dims else 0 for axis, ix in zip(MASK_AXES, index))]


def _as_expr(x) -> PrimExpr:
    return tirx.const(x, "int32") if isinstance(x, int) else x


def linear(x: te.Tensor, w: te.Tensor, name: str) -> te.Tensor:
    """y[b, s, m] = Σ_c x[b, s, c]·w[c, m], accumulated in fp32, stored in x's dtype."""
    c = te.reduce_axis((0, w.shape[0]), "c")
    acc = te.compute((x.shape[0], x.shape[1], w.shape[1]),
                     lambda b, s, m: te.sum(x[b, s, c].astype(ACC) * w[c, m].astype(ACC), axis=c),
                     name=name if x.dtype == ACC else name + "_acc")
    if x.dtype == ACC:
        return acc
    return te.compute(acc.shape, lambda *i: acc(*i).astype(x.dtype), name=name)


def _split_heads(y: te.Tensor, heads: int, width: int, name: str) -> te.Tensor:
    """(B, n, heads·width) → (B, heads, n, width): a reshape and a transpose, no arithmetic."""
    return te.compute((y.shape[0], heads, y.shape[1], width),
                      lambda b, i, s, c: y[b, s, i * width + c], name=name)


def _bhsd_reader(t: te.Tensor, layout: str) -> Callable:
    """Index a (B,h,n,·) or (B,n,h,·) tensor as (b, head, pos, c)."""
    if layout == "BHSD":
        return lambda b, i, s, c: t[b, i, s, c]
    return lambda b, i, s, c: t[b, s, i, c]
