"""ONNX Runtime's GroupQueryAttention (com.microsoft) → a tvmattn kernel, its KV cache kept as ORT keeps it.

The cache (past_key/past_value, BNSH) is one of:
  grow     present has past + S rows: sequence b's past fills its first seqlens_k[b] + 1 − S rows, its S
           new rows follow, zeros after (total_sequence_length is past + S);
  shared   past and present are one buffer of M rows (ORT's past_present_share_buffer, GenAI's static
           cache; total_sequence_length ≤ M): the new rows go to the same place, present has M rows;
  none     no past (a prompt): present is the new keys.
Which, the graph says: a constant total_sequence_length, else present_key's declared length (past_key's:
shared; another: grow); undeclared, grow (and a shared buffer is refused when the model runs).
A prompt is the first (its queries at 0‥S−1, right padding past seqlens_k[b]) without a past, or where a
shared buffer's total_sequence_length is S; after a past, sequence b's query i sits at seqlens_k[b] + 1 − S + i.
On CPU targets the index inputs are checked when the model runs, as ORT checks them: seqlens_k within
present's rows (and at least S − 1 after a past), total_sequence_length what the cache says, the rotary
positions within the cos/sin caches.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from tvmattn.compiler.annotations import IS_SCHEDULED, OP_PATTERN, OPAQUE
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx import rotary
from tvmattn.compiler.onnx.converters import (
    Node,
    _inputs,
    _refuse,
    _unsupported,
    bhsd,
    graph_input,
    merge_heads,
    split_heads,
)
from tvmattn.compiler.onnx.kernels import Mask, Sizes, shape_of, static
from tvmattn.compiler.onnx.ort_attention import _causal, ort_masks
from tvmattn.compiler.paged import PagedSpec

op = relax.op
I64 = "int64"


def ms_group_query_attention(node: Node, inputs: list) -> list:
    """ORT GroupQueryAttention: GQA with a KV cache (see the module docstring), causal or not, local window,
    softcap, attention bias, smooth softmax and head_sink (the kernel's sinks), packed QKV when key is
    absent, per-sequence lengths and rotary embedding (do_rotary: cos/sin caches, position_ids)."""
    a = node.attrs({"num_heads": None, "kv_num_heads": None, "scale": None, "softcap": 0.0,
                    "local_window_size": -1, "do_rotary": 0, "rotary_interleaved": 0, "smooth_softmax": 0,
                    "qk_output": 0, "causal": 1, "sliding_window_cache": 0, "kv_cache_bit_width": 0,
                    "k_quant_type": "NONE", "v_quant_type": "NONE", "qk_norm_epsilon": 1e-6,
                    "q_norm_epsilon": None, "k_norm_epsilon": None})
    _refuse(node, {k: (v.decode() if isinstance(v, bytes) else v) for k, v in a.items()},
            {"qk_output": 0, "sliding_window_cache": 0, "kv_cache_bit_width": 0, "k_quant_type": "NONE",
             "v_quant_type": "NONE"})
    q, k, v, past_k, past_v, seqlens_k, total, cos, sin, position_ids, attn_bias, head_sink = _inputs(inputs, 17)[:12]
    _unsupported(node, inputs, {12: "k_scale", 13: "v_scale", 14: "q_norm_weight", 15: "k_norm_weight",
                                16: "query_seqlens"})
    heads, kv_heads = a["num_heads"], a["kv_num_heads"]
    if heads is None or kv_heads is None:
        raise TvmAttnError("the num_heads and kv_num_heads attributes are required")
    if (past_k is None) != (past_v is None):
        raise TvmAttnError("past_key and past_value must be given together")
    if seqlens_k is None or len(shape_of(seqlens_k, "seqlens_k")) != 1:
        raise TvmAttnError("seqlens_k must be given, a (B,) tensor of each sequence's key count minus one")
    if total is None:
        raise TvmAttnError("total_sequence_length must be given")
    if a["do_rotary"] and (cos is None or sin is None):
        raise TvmAttnError("do_rotary=1 needs the cos_cache and sin_cache inputs")
    if k is None:  # packed (B, S, (h + 2·h_kv)·d)
        width = static(shape_of(q, "query")[2], "the packed QKV width") // (heads + 2 * kv_heads)
        parts = node.emit(op.split(q, [heads * width, (heads + kv_heads) * width], axis=2))
        q, k, v = (node.emit(relax.TupleGetItem(parts, i)) for i in range(3))
    q, k, v = split_heads(node, q, heads, "query"), split_heads(node, k, kv_heads, "key"), \
        split_heads(node, v, kv_heads, "value")
    batch, n_new = shape_of(q, "query")[:2]
    cache = _cache(node, past_k, total, n_new)
    p_len = shape_of(past_k, "past_key")[2] if past_k is not None else 0
    rows = p_len if cache == "shared" else p_len + n_new  # present's
    seqlens = node.in_range(seqlens_k, "input 'seqlens_k' (each sequence's key count after this step, minus 1) "
                                       "must index present_key's rows", 0, rows)
    total_range = (n_new, p_len + 1) if cache == "shared" else (rows, rows + 1)
    seqlens = node.in_range(total, "input 'total_sequence_length' " + (
        "must be at least the new tokens and at most past_key's buffer" if cache == "shared" else
        "must be past_key's length plus the new tokens (a buffer past and present share is one where the graph "
        "declares present_key with past_key's sequence length)"), *total_range, carry=seqlens)
    lens = node.emit(op.add(node.emit(op.astype(seqlens, I64)), relax.const(1, I64)))  # each sequence's keys
    first_prompt = _first_prompt(node, cache, total, n_new)
    first = None if cache is None else _first_new_rows(node, lens, n_new, first_prompt, rows)
    if a["do_rotary"]:
        positions = _positions(node, position_ids, first, first_prompt, batch, n_new)
        positions = node.in_range(positions, "the rotary positions (position_ids, or from seqlens_k) must index "
                                             "cos_cache's rows", 0, shape_of(cos, "cos_cache")[0])
        q = _rotary(node, q, cos, sin, positions, bool(a["rotary_interleaved"]), "query")
        k = _rotary(node, k, cos, sin, positions, bool(a["rotary_interleaved"]), "key")
    q_rows, q, k, v = q, bhsd(node, q), bhsd(node, k), bhsd(node, v)
    if cache == "shared" and node.checks and all(graph_input(x) for x in (past_k, past_v)):
        k, v = _write_in_place(node, past_k, past_v, k, v, first)
    elif cache is not None:
        k, v = _write_at(node, past_k, k, first, rows), _write_at(node, past_v, v, first, rows)
    kv_lens, mask = _keys(node, cache, lens, first_prompt, attn_bias, batch, n_new, rows)
    # ORT 1.32 counts the query's own position in local_window_size (checked against its CPU kernel)
    window = a["local_window_size"] if a["local_window_size"] >= 0 else None
    options = dict(scale=None if a["scale"] is None else float(a["scale"]),
                   softcap=float(a["softcap"]) if a["softcap"] else None, **_causal(bool(a["causal"]), past_k, window))
    sinks = _sinks(node, head_sink, a["smooth_softmax"], heads)
    if _over_pages(node, cache, n_new, rows, attn_bias, q, k):
        y = _decode_over_pages(node, q_rows, k, v, kv_lens, sinks, int(rows.value), options)
        return [merge_heads(node, y, "BSHD"), k if node.wants(1) else None, v if node.wants(2) else None]
    y, = node.attend(q, k, v, layout="BHSD", mask=mask, kv_lens=kv_lens, sinks=sinks, **options)
    return [merge_heads(node, y, "BHSD"), k if node.wants(1) else None, v if node.wants(2) else None]


def _over_pages(node: Node, cache: str | None, n_new, rows, attn_bias, q, k) -> bool:
    """Whether this is a decode step (one new token a sequence) over a buffer past and present share
    with a static row count, without attention_bias, on a CPU: ORT GenAI's batch of sequences of their
    own lengths (seqlens_k). It runs on the paged decode kernel, the buffer read as pages (no table): its
    work split follows each sequence's own length. (A first prompt of one token sits at 0 and sees key 0:
    the kernel's length 1, as kv_lens says.)"""
    return (cache == "shared" and attn_bias is None and node.checks and isinstance(n_new, tirx.IntImm)
            and int(n_new.value) == 1 and isinstance(rows, tirx.IntImm) and str(q.ty.dtype) == str(k.ty.dtype))


def _decode_over_pages(node: Node, q: relax.Expr, k: relax.Expr, v: relax.Expr, kv_lens: relax.Expr,
                       sinks: relax.Expr | None, rows: int, options: dict) -> relax.Var:
    """q (B, 1, h, d) over the (B, h_kv, rows, d) buffers on `paged_decode.buffer_kernel`: pages of the
    largest power of two up to 256 that divides ``rows``."""
    batch, _, heads, d = shape_of(q, "query")
    page = max(p for p in (1, 2, 4, 8, 16, 32, 64, 128, 256) if rows % p == 0)
    spec = PagedSpec(num_heads=static(heads, "the query head count"), num_kv_heads=static(shape_of(k, "key")[1],
                     "the key head count"), head_dim=static(d, "the head size"), page_size=page, kv_layout="HND",
                     q_len=1, dtype=str(q.ty.dtype), causal=options.get("causal", False),
                     window=options.get("window"), softcap=options["softcap"], sinks=sinks is not None,
                     scale=options["scale"])
    zeros = relax.const(np.zeros(spec.h, np.float32))
    return node.kernels.call_paged(node.bb, spec, [q, k, v, kv_lens, zeros if sinks is None else sinks, zeros],
                                   [batch, 1, heads, d], (node.name,), f"{node.op} converter", rows=rows)


def _cache(node: Node, past: relax.Expr | None, total: relax.Expr, n_new) -> str | None:
    """"grow", "shared" or None (no past): see the module docstring."""
    if past is None:
        return None
    p_len = shape_of(past, "past_key")[2]
    if isinstance(total, tvm.ir.GenericConst):
        value = int(np.asarray(total.value.numpy()).reshape(-1)[0])
        sizes = [int(d.value) if isinstance(d, tirx.IntImm) else None for d in (p_len, n_new)]
        if sizes[0] is not None and value <= sizes[0]:
            return "shared"
        if None not in sizes and value == sum(sizes):
            return "grow"
        if None not in sizes:
            raise TvmAttnError(f"total_sequence_length is {value}: neither the past length {sizes[0]} plus the "
                               f"{sizes[1]} new tokens (a growing cache) nor at most the past buffer's {sizes[0]} "
                               f"rows (a buffer past and present share)")
    past_len, present_len = (node.declared.get(name, ())[2:3] for name in (node.proto.input[3], node.proto.output[1]
                                                                             if node.wants(1) else ""))
    if past_len and present_len and present_len[0] is not None:
        return "shared" if present_len == past_len else "grow"
    return "grow"


def _first_prompt(node: Node, cache: str | None, total: relax.Expr, n_new) -> relax.Expr | bool:
    """Whether this is a first prompt: True without a past, False for a growing cache, and for a shared
    buffer a (1,) bool tensor, total_sequence_length == S."""
    if cache != "shared":
        return cache is None
    total = node.emit(op.astype(node.emit(op.reshape(total, [1])), I64))
    return node.emit(op.equal(total, relax.prim_value(tirx.Cast(I64, n_new))))


def _first_new_rows(node: Node, lens: relax.Expr, n_new, first_prompt: relax.Expr | bool, rows) -> relax.Expr:
    """(B,) int64: the row of sequence b's first new key, seqlens_k[b] + 1 − S (0 in a first prompt),
    checked to lie in the cache."""
    first = node.emit(op.subtract(lens, relax.prim_value(tirx.Cast(I64, n_new))))
    if first_prompt is not False:
        first = node.emit(op.where(first_prompt, node.emit(op.zeros_like(first)), first))
    return node.in_range(first, "input 'seqlens_k' is below S − 1 after a past: each sequence's keys must "
                                "include its S new tokens", 0, rows - n_new + 1)


def _positions(node: Node, position_ids: relax.Expr | None, first: relax.Expr | None,
               first_prompt: relax.Expr | bool, batch, n_new) -> relax.Expr:
    """(B, S) int64 rotary positions: each sequence's first new row + s, or position_ids, of which ORT reads
    only each row's first in a first prompt (position_ids[b, 0] + s)."""
    steps = node.emit(op.reshape(node.emit(op.arange(n_new, dtype=I64)), [1, n_new]))
    if position_ids is None:
        if first is None:
            return node.emit(op.broadcast_to(steps, [batch, n_new]))
        return node.emit(op.add(node.emit(op.reshape(first, [batch, 1])), steps))
    given = node.emit(op.astype(position_ids, I64))
    leading = node.emit(op.add(node.emit(op.strided_slice(given, [1], [0], [1], assume_inbound=True)), steps))
    if first_prompt is True:
        return leading
    return given if first_prompt is False else node.emit(op.where(first_prompt, leading, given))


def _keys(node: Node, cache: str | None, lens: relax.Expr, first_prompt: relax.Expr | bool,
          attn_bias: relax.Expr | None, batch, n_new, rows) -> tuple[relax.Expr, Mask | None]:
    """kv_lens and the mask. kv_lens says where the queries sit (bottom-right causal after a past, at each
    sequence's keys) and hides the keys past it; a shared buffer's first prompt sits at 0 (kv_lens S), its
    right padding then hidden by a bool mask of each sequence's keys. attention_bias's keys (total_sequence_
    length of them) are read over the buffer's rows, 0 past its end (keys the padding hides)."""
    counts = node.emit(op.astype(lens, "int32"))
    if cache != "shared":
        return counts, ort_masks(node, None, attn_bias, 0.0, rows)[1]
    prompt_keys = node.emit(op.add(node.emit(op.zeros_like(counts)), relax.prim_value(tirx.Cast("int32", n_new))))
    kv_lens = node.emit(op.where(first_prompt, prompt_keys, counts))
    t = node.emit(op.arange(rows, dtype="int32"))
    keep = node.emit(op.less(t, node.emit(op.reshape(counts, [batch, 1, 1, 1]))))
    if attn_bias is None:
        return kv_lens, Mask(keep, "bool")
    bias = _over_rows(node, ort_masks(node, None, attn_bias, 0.0, rows)[1].value, rows)
    return kv_lens, Mask(node.emit(op.where(keep, bias, relax.const(-np.inf, "float32"))), "additive")


def _over_rows(node: Node, bias: relax.Expr, rows) -> relax.Expr:
    """``bias`` (…, T) read over ``rows`` keys: entry t < T, else 0."""
    keys = shape_of(bias, "attention_bias")[-1]
    if Sizes().equal(keys, rows):
        return bias
    t = node.emit(op.arange(rows, dtype=I64))
    index = node.emit(op.clip(t, 0, keys - 1))
    read = node.emit(op.take(bias, index, axis=3, mode="clip"))
    inside = node.emit(op.less(t, relax.prim_value(tirx.Cast(I64, keys))))
    return node.emit(op.where(inside, read, relax.const(0.0, "float32")))


def _sinks(node: Node, head_sink: relax.Expr | None, smooth: int, heads: int) -> relax.Expr | None:
    """The kernel's sinks: head_sink (which ORT reads over smooth_softmax), or 0 for every head (smooth
    softmax: 1 added to the softmax's denominator)."""
    if head_sink is not None:
        return node.emit(op.astype(head_sink, "float32")) if str(head_sink.ty.dtype) != "float32" else head_sink
    return relax.const(np.zeros(heads, np.float32)) if smooth else None


def _rotary(node: Node, x: relax.Expr, cos: relax.Expr, sin: relax.Expr, positions: relax.Expr,
            interleaved: bool, what: str) -> relax.Var:
    """`rotary.rotate` of ``x`` (B, S, h, d) at ``positions`` (B, S, checked by the caller) from
    (max_position, r/2) caches."""
    d = static(shape_of(x, what)[3], f"the head width of {what}")
    half = static(shape_of(cos, "cos_cache")[-1], "the rotary width of cos_cache")
    if len(shape_of(cos, "cos_cache")) != 2 or shape_of(sin, "sin_cache")[-1].value != half or 2 * half > d:
        raise TvmAttnError(f"cos_cache and sin_cache must be (max_position, r/2) with r ≤ the head width {d}")
    c, s = rotary.at_positions(node, positions, cos, sin, check=False)
    return rotary.rotate(node, x, c, s, interleaved, 2 * half, head_axis=2)


def _write_in_place(node: Node, past_k: relax.Expr, past_v: relax.Expr, k: relax.Expr, v: relax.Expr,
                    first: relax.Expr) -> tuple[relax.Var, relax.Var]:
    """A buffer past and present share, as ORT means it: sequence b's S new rows written into past at
    first[b] (checked to fit), the rows after them zeroed (ORT's present has zeros there), in place
    (``call_tir_inplace``): present is past (`ImportReport.in_place`), no copy of the buffer a step."""
    width = static(shape_of(past_k, "past_key")[3], "the head size")
    return node.write_in_place(_shared_write_func(str(past_k.ty.dtype), width), "gqa_shared_buffer_write",
                               (past_k, past_v), [k, v, first])


def _shared_write_func(dtype: str, width: int) -> tirx.PrimFunc:
    @T.prim_func(private=True)
    def write(pk_h: T.handle, pv_h: T.handle, k_h: T.handle, v_h: T.handle, first_h: T.handle):
        batch, heads, rows, n_new = T.int64(), T.int64(), T.int64(), T.int64()
        PK = T.match_buffer(pk_h, (batch, heads, rows, width), dtype)
        PV = T.match_buffer(pv_h, (batch, heads, rows, width), dtype)
        K = T.match_buffer(k_h, (batch, heads, n_new, width), dtype)
        V = T.match_buffer(v_h, (batch, heads, n_new, width), dtype)
        FIRST = T.match_buffer(first_h, (batch,), I64)
        for bh in T.parallel(batch * heads):
            start = T.max(T.min(FIRST[bh // heads], rows - n_new), 0)  # (checked; clamped all the same)
            for s in range(n_new):
                for e in T.vectorized(width):
                    PK[bh // heads, bh % heads, start + s, e] = K[bh // heads, bh % heads, s, e]
                    PV[bh // heads, bh % heads, start + s, e] = V[bh // heads, bh % heads, s, e]
            for t in range(rows - start - n_new):
                for e in T.vectorized(width):
                    PK[bh // heads, bh % heads, start + n_new + t, e] = T.Cast(dtype, 0)
                    PV[bh // heads, bh % heads, start + n_new + t, e] = T.Cast(dtype, 0)

    return write.with_attr(OP_PATTERN, OPAQUE).with_attr(IS_SCHEDULED, True)


def _write_at(node: Node, past: relax.Expr, new: relax.Expr, first: relax.Expr, rows) -> relax.Var:
    """The present cache (B, h, rows, d): sequence b's first[b] past rows, its S new rows, then zeros.

    A gather from [past; new; 0] along the keys; a row index out of range (seqlens_k where nothing checks
    it) is clamped to the zero row rather than read out of bounds."""
    batch, heads, p_len, width = shape_of(past, "past_key")
    n_new = shape_of(new, "the new keys")[2]
    zero = node.emit(op.broadcast_to(relax.const(0, str(past.ty.dtype)), [batch, heads, 1, width]))
    source = node.emit(op.concat([past, new, zero], axis=2))
    t = node.emit(op.reshape(node.emit(op.arange(rows, dtype=I64)), [1, 1, rows, 1]))
    start = node.emit(op.reshape(first, [batch, 1, 1, 1]))
    from_new = node.emit(op.add(node.emit(op.subtract(t, start)), relax.prim_value(tirx.Cast(I64, p_len))))
    zero_row = node.emit(op.add(node.emit(op.zeros_like(t)), relax.prim_value(tirx.Cast(I64, p_len + n_new))))
    new_rows = node.emit(op.less(t, node.emit(op.add(start, relax.prim_value(tirx.Cast(I64, n_new))))))
    index = node.emit(op.where(node.emit(op.less(t, start)), t, node.emit(op.where(new_rows, from_new, zero_row))))
    index = node.emit(op.clip(index, 0, p_len + n_new))
    index = node.emit(op.broadcast_to(index, [batch, heads, rows, width]))
    return node.emit(op.gather_elements(source, index, axis=2))
