"""The attention mask as TIR expressions: which key t a query s sees, and which keys a query range sees.

`visible` is what the tensor expression selects with; `key_range` is the same rule solved for t, which
the block-skipping pass uses to tighten key loops. Both read the spec's mask fields only here.

    pos(s)   = s + offset,  offset = 0 (top_left) or L - n (bottom_right); L = valid keys of the row
    causal   t <= pos(s)
    window   pos(s) - W < t            (and, when not causal, t < pos(s) + W)
    padding  t < L
"""

from __future__ import annotations

from tvm import tirx
from tvm.ir.expr import Expr as PrimExpr

from .spec import AttentionSpec


def query_offset(spec: AttentionSpec, kv_len: PrimExpr, n_q: PrimExpr) -> PrimExpr:
    """Position of query 0 among the keys."""
    return kv_len - n_q if spec.causal_align == "bottom_right" else tirx.const(0, "int32")


def visible(spec: AttentionSpec, s: PrimExpr, t: PrimExpr, kv_len: PrimExpr, n_q: PrimExpr) -> PrimExpr:
    """True where query s may attend to key t."""
    pos = s + query_offset(spec, kv_len, n_q)
    conds = []
    if spec.causal:
        conds.append(t <= pos)
    if spec.window is not None:
        conds.append(pos - spec.window < t)
        if not spec.causal:
            conds.append(t < pos + spec.window)
    if spec.key_padding:
        conds.append(t < kv_len)
    if not conds:
        return tirx.const(True, "bool")
    cond = conds[0]
    for c in conds[1:]:
        cond = tirx.all(cond, c)
    return cond


def key_range(spec: AttentionSpec, s_lo: PrimExpr, s_hi: PrimExpr, kv_len: PrimExpr,
              n_q: PrimExpr) -> tuple[PrimExpr | None, PrimExpr | None]:
    """Keys [t_lo, t_hi) that any query in [s_lo, s_hi] sees; None where the mask sets no bound."""
    off = query_offset(spec, kv_len, n_q)
    lo = hi = None
    if spec.causal:
        hi = s_hi + off + 1
    if spec.window is not None:
        lo = s_lo + off - spec.window + 1
        if not spec.causal:
            hi = s_hi + off + spec.window
    if spec.key_padding:
        hi = kv_len if hi is None else tirx.min(hi, kv_len)
    return lo, hi
