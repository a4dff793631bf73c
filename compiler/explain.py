"""The shape trace of the seeds: one row per stage with its shape, FLOPs and bytes moved.

Bytes are what a stage would read and write if every stage were materialised in memory (the textbook
pipeline); the fused kernel moves only its inputs and output, which the totals show beside it.
FLOPs count a multiply-add as 2; the softmax as 5 per score (max, subtract, exp, sum, divide).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from tvmattn.compiler import variant
from tvmattn.compiler.arguments import numpy_dtype
from tvmattn.compiler.spec import AttentionSpec

PER_PAIR = ("scores = q·kᵀ", "weights·v")  # the trace's matmuls with a term per (query, key) pair
ROWS_AT_A_TIME = 512  # queries whose visibility is held at once while counting pairs


@dataclass
class Stage:
    name: str
    shape: tuple
    flops: int
    bytes: int
    note: str = ""


def trace(spec: AttentionSpec, sizes: dict[str, int] | None = None) -> list[Stage]:
    """The stages of ``spec`` in order (symbolic sizes taken from ``sizes``, else left as names)."""
    sz = lambda x: (sizes or {}).get(x, x) if isinstance(x, str) else x  # noqa: E731
    B, n, n_kv = sz(spec.batch), sz(spec.n_q), sz(spec.n_kv)
    h, h_kv, d_k, d_v, d = spec.h, spec.h_kv, spec.d_k, spec.d_v, spec.d
    e = _itemsize(spec.dtype)
    f = 4  # fp32 intermediates (scores, probabilities)
    symbolic = any(isinstance(x, str) for x in (B, n, n_kv))
    num = (lambda *xs: 0) if symbolic else _prod  # FLOPs/bytes need numbers

    rows: list[Stage] = []
    if spec.projections:
        src = "x_kv" if spec.is_cross else "x"
        rows += [
            Stage("q_proj = x·W_Q", (B, n, h * d_k), 2 * num(B, n, d, h * d_k),
                  e * (num(B, n, d) + d * h * d_k + num(B, n, h * d_k))),
            Stage(f"k_proj = {src}·W_K", (B, n_kv, h_kv * d_k), 2 * num(B, n_kv, d, h_kv * d_k),
                  e * (num(B, n_kv, d) + d * h_kv * d_k + num(B, n_kv, h_kv * d_k))),
            Stage(f"v_proj = {src}·W_V", (B, n_kv, h_kv * d_v), 2 * num(B, n_kv, d, h_kv * d_v),
                  e * (num(B, n_kv, d) + d * h_kv * d_v + num(B, n_kv, h_kv * d_v))),
            Stage("head split q (reshape d → h×d_k, transpose)", (B, h, n, d_k), 0, 0, "relabelling only"),
            Stage("head split k, v", (B, h_kv, n_kv, d_k), 0, 0,
                  f"{h // h_kv} query heads per k/v head" if h != h_kv else "relabelling only"),
        ]
    rows += [
        Stage("scores = q·kᵀ", (B, h, n, n_kv), 2 * num(B, h, n, n_kv, d_k),
              e * (num(B, h, n, d_k) + num(B, h_kv, n_kv, d_k)) + f * num(B, h, n, n_kv)),
        Stage(f"scale × {spec.softmax_scale:.4g}", (B, h, n, n_kv), num(B, h, n, n_kv),
              2 * f * num(B, h, n, n_kv)),
        Stage("mask", (B, h, n, n_kv), 0, 2 * f * num(B, h, n, n_kv), _mask_note(spec)),
        Stage("softmax over keys", (B, h, n, n_kv), 5 * num(B, h, n, n_kv), 2 * f * num(B, h, n, n_kv),
              "row max subtracted, fp32"),
        Stage("weights·v", (B, h, n, d_v), 2 * num(B, h, n, n_kv, d_v),
              f * num(B, h, n, n_kv) + e * (num(B, h_kv, n_kv, d_v) + num(B, h, n, d_v))),
    ]
    if spec.projections:
        rows += [
            Stage("merge heads (transpose, reshape h×d_v → d)", (B, n, h * d_v), 0, 0, "relabelling only"),
            Stage("out = merged·W_O", (B, n, d), 2 * num(B, n, h * d_v, d),
                  e * (num(B, n, h * d_v) + h * d_v * d + num(B, n, d))),
        ]
    return rows


def useful_flops(spec: AttentionSpec, sizes: dict[str, int] | None = None) -> int:
    """The trace's matmuls, QKᵀ and P·V counted only over the (query, key) pairs the position rules
    let a query see, as FlashAttention counts: a masked pair is work a good kernel skips, so a dense
    count would flatter a causal kernel's GFLOP/s past any GEMM's. Key padding counts every key (its
    lengths are inputs, not part of the spec)."""
    rows = trace(spec, sizes)
    scores = next(r for r in rows if r.name in PER_PAIR)
    n, n_kv = scores.shape[-2:]
    numeric = isinstance(n, int) and isinstance(n_kv, int) and n > 0 and n_kv > 0  # symbolic: the trace counts 0
    share = visible_pairs(spec, n, n_kv) / (n * n_kv) if numeric else 1.0
    return round(sum(r.flops * (share if r.name in PER_PAIR else 1.0) for r in rows if "·" in r.name))


def visible_pairs(spec: AttentionSpec, n: int, n_kv: int) -> int:
    """(query, key) pairs that `variant.visible` lets through, every key valid."""
    t = np.arange(n_kv)[None, :]
    total = 0
    for lo in range(0, n, ROWS_AT_A_TIME):
        s = np.arange(lo, min(lo + ROWS_AT_A_TIME, n))[:, None]
        seen = variant.visible(spec, s, t, n_kv, n, lambda rules: functools.reduce(np.logical_and, rules))
        total += len(s) * n_kv if seen is None else int(np.broadcast_to(seen, (len(s), n_kv)).sum())
    return total


def parameters(spec: AttentionSpec) -> int:
    """Weights of the layer: W_Q, W_K, W_V, W_O (4·d² for plain multi-head attention)."""
    if not spec.projections:
        return 0
    return spec.d * (spec.h * spec.d_k + spec.h_kv * spec.d_k + spec.h_kv * spec.d_v) + spec.h * spec.d_v * spec.d


def fused_bytes(spec: AttentionSpec, sizes: dict[str, int] | None = None) -> int:
    """What the fused kernel reads and writes: its arguments and its output, nothing in between."""
    shapes = list(spec.input_shapes().items()) + [("out", spec.output_shape())]
    total = 0
    for name, shape in shapes:
        dims = [(sizes or {}).get(x, x) if isinstance(x, str) else x for x in shape]
        if any(isinstance(x, str) for x in dims):
            return 0
        total += _prod(*dims) * numpy_dtype(spec.input_dtype(name) if name != "out" else spec.dtype).itemsize
    return total


def report(spec: AttentionSpec, sizes: dict[str, int] | None = None) -> str:
    """The trace as a table, then the totals."""
    rows = trace(spec, sizes)
    lines = [f"{'stage':<46} {'shape':<26} {'FLOPs':>12} {'bytes':>12}  note"]
    for r in rows:
        shape = "(" + ", ".join(str(x) for x in r.shape) + ")"
        lines.append(f"{r.name:<46} {shape:<26} {_fmt(r.flops):>12} {_fmt(r.bytes):>12}  {r.note}")
    flops = sum(r.flops for r in rows)
    moved = sum(r.bytes for r in rows)
    fused = fused_bytes(spec, sizes)
    lines.append(f"total: {_fmt(flops)} FLOPs, {_fmt(moved)} bytes stage by stage, "
                 f"{_fmt(fused)} bytes fused" + (f"; parameters {_fmt(parameters(spec))}"
                                                 + (" = 4·d²" if parameters(spec) == 4 * spec.d ** 2 else "")
                                                 if spec.projections else ""))
    if flops and moved and fused:
        lines.append(f"arithmetic intensity: {flops / moved:.1f} FLOP/byte stage by stage, "
                     f"{flops / fused:.1f} FLOP/byte fused")
    elif not flops:
        lines.append("FLOPs and bytes need numbers: give the symbolic sizes (--at n=…)")
    dense, useful = sum(r.flops for r in rows if "·" in r.name), useful_flops(spec, sizes)
    if useful < dense:
        lines.append(f"useful matmul FLOPs (over the (query, key) pairs a query sees; what `bench`'s GFLOP/s "
                     f"counts): {_fmt(useful)}, {100 * useful / dense:.0f}% of the dense {_fmt(dense)}")
    return "\n".join(lines)


def _mask_note(spec: AttentionSpec) -> str:
    parts = [p for p, on in (("causal " + spec.causal_align.replace("_", "-"), spec.causal),
                             (f"window {spec.window}", spec.window is not None),
                             ("key padding", spec.key_padding)) if on]
    alibi = f"; + ALiBi slope·distance ({spec.alibi})" if spec.alibi else ""
    return (", ".join(parts) + " → -inf" if parts else "none") + alibi


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def _prod(*xs: int) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _fmt(x: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return str(x)
