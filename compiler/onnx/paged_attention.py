"""ONNX Runtime's PagedAttention (com.microsoft) → tvmattn's ragged paged CPU kernel, its cache written in place.

    query         (T, h·d), or packed QKV (T, (h + 2·h_kv)·d) without key and value
    key, value    (T, h_kv·d)                  the new tokens of B sequences, packed without padding
    key_cache     (pages, P, h_kv, d)          NHD pages (value_cache alike), updated in place: key_cache_out
                                               aliases key_cache, as the op's specification says
    cumulative_sequence_length (B + 1,) int32  sequence b's new tokens are rows cu[b] … cu[b + 1] − 1
    past_seqlens  (B,) int32                   sequence b's keys already in the cache
    block_table   (B, max_pages) int32         page j of sequence b
    output        (T, h·d)

Token i of sequence b sits at position past[b] + i: its key and value go to row (past[b] + i) % P of page
block_table[b, (past[b] + i) // P] (or to slot_mapping's page·P + row; −1 writes nothing), and its query
sees the sequence's keys up to its own position (causal, bottom-right; ``is_causal=0``: all of them).

Three steps: one TIR function checks the index inputs (a serial loop over B + T entries, every failure a
sentence naming the node and the input) and derives each token's position and slot and each sequence's key
count; one writes the new rows into both caches in place (``call_tir_inplace``, never outside them); the
ragged paged kernel (`schedules.cpu.paged_decode`) attends. Q/K RMSNorm and rotary embedding come before the
write, as the op applies them. CPU targets only: the paged kernel is a CPU kernel.
"""

from __future__ import annotations

import numpy as np
from tvm import relax, tirx
from tvm.script import tirx as T

from tvmattn.compiler.annotations import IS_SCHEDULED, OP_PATTERN, OPAQUE
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx import rotary
from tvmattn.compiler.onnx.converters import Node, _inputs, _refuse, _unsupported, graph_input
from tvmattn.compiler.onnx.gqa import _sinks
from tvmattn.compiler.onnx.kernels import shape_of, static
from tvmattn.compiler.paged import PagedSpec, with_unused

op = relax.op
I64 = "int64"


def ms_paged_attention(node: Node, inputs: list) -> list:
    """ORT PagedAttention: GQA over a paged NHD cache of any power-of-two page size, ragged (packed)
    sequences with a past, causal or not, local window, softcap, scale, head_sink / smooth softmax, packed
    QKV, slot_mapping, Q/K RMSNorm and rotary embedding (half or interleaved, partial width). fp16 and bf16
    as the specification types them, and fp32."""
    a = node.attrs({"num_heads": None, "kv_num_heads": None, "scale": 0.0, "softcap": 0.0, "local_window_size": -1,
                    "do_rotary": 0, "rotary_interleaved": 0, "is_causal": 1, "smooth_softmax": 0,
                    "qk_norm_epsilon": 1e-6, "rotary_offset": 0, "v_head_size": 0, "kv_cache_layout": "SEPARATE",
                    "k_cache_dtype": "", "v_cache_dtype": "", "k_quant_type": "NONE", "v_quant_type": "NONE",
                    "kv_cache_bit_width": 0})
    a = {k: v.decode() if isinstance(v, bytes) else v for k, v in a.items()}
    _refuse(node, a, {"rotary_offset": 0, "v_head_size": 0, "kv_cache_layout": "SEPARATE", "k_quant_type": "NONE",
                      "v_quant_type": "NONE"})
    (q, k, v, k_cache, v_cache, cu, past, table, cos, sin, slot_mapping, head_sink, q_norm,
     k_norm) = _inputs(inputs, 17)[:14]
    _unsupported(node, inputs, {14: "k_scale", 15: "v_scale"})  # (attention_metadata, 16: bounds, a hint)
    heads, kv_heads = a["num_heads"], a["kv_num_heads"]
    if heads is None or kv_heads is None:
        raise TvmAttnError("the num_heads and kv_num_heads attributes are required")
    if not node.checks:
        raise TvmAttnError(f"PagedAttention imports for CPU targets only (tvmattn's paged kernel is a CPU kernel), "
                           f"not {node.kernels.target.kind.name}")
    if any(x is None for x in (k_cache, v_cache, cu, past, table)):
        raise TvmAttnError("key_cache, value_cache, cumulative_sequence_length, past_seqlens and block_table must "
                           "be given")
    if (k is None) != (v is None) or (q_norm is None) != (k_norm is None):
        raise TvmAttnError("key and value (and q_norm_weight and k_norm_weight) must be given together")
    if a["do_rotary"] and (cos is None or sin is None):
        raise TvmAttnError("do_rotary=1 needs the cos_cache and sin_cache inputs")
    window = a["local_window_size"] if a["local_window_size"] >= 0 else None
    if window == 0 or (window is not None and not a["is_causal"]):
        raise TvmAttnError(f"local_window_size={window} with is_causal={a['is_causal']} is not supported by "
                           f"tvmattn's {node.op} converter (a window of at least 1 key on a causal mask is)")
    if not (graph_input(k_cache) and graph_input(v_cache)):
        raise TvmAttnError("key_cache and value_cache must be inputs of the model: the op writes them in place")
    pages, page, cache_heads, d = _cache_shape(node, k_cache, v_cache, kv_heads)
    dtype = str(k_cache.ty.dtype)
    for name in ("k_cache_dtype", "v_cache_dtype"):
        if a[name] not in ("", dtype):
            raise TvmAttnError(f"attribute {name}={a[name]!r} is not supported by tvmattn's {node.op} converter "
                               f"(a quantized cache): only the cache tensor's own type, {dtype}")
    q, k, v = _heads(node, q, k, v, heads, kv_heads, d)
    if str(q.ty.dtype) != dtype or str(k.ty.dtype) != dtype:
        raise TvmAttnError(f"query ({q.ty.dtype}), key and the caches ({dtype}) must have one dtype")
    tokens = shape_of(q, "query")[0]
    spec = PagedSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, page_size=page, kv_layout="NHD",
                     q_len=None, dtype=dtype, causal=bool(a["is_causal"]), window=window,
                     softcap=float(a["softcap"]) or None, sinks=head_sink is not None or bool(a["smooth_softmax"]),
                     scale=float(a["scale"]) or None)
    slots, positions, lens = _index(node, cu, past, table, slot_mapping, tokens, pages, page)
    if q_norm is not None:
        q, k = _rms_norm(node, q, q_norm, a["qk_norm_epsilon"]), _rms_norm(node, k, k_norm, a["qk_norm_epsilon"])
    if a["do_rotary"]:
        positions = node.in_range(positions, "the rotary positions (past_seqlens plus each token's place in its "
                                             "sequence) must index cos_cache's rows", 0, shape_of(cos, "cos_cache")[0])
        q, k = (_rotary(node, x, cos, sin, positions, bool(a["rotary_interleaved"]), what)
                for x, what in ((q, "query"), (k, "key")))
    k_cache, v_cache = node.write_in_place(_write_func(page, dtype), "paged_attention_write", (k_cache, v_cache),
                                           [k, v, slots])
    given = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": table, "cache_seqlens": lens,
             "cu_seqlens_q": cu, "sinks": _sinks(node, head_sink, a["smooth_softmax"], heads)}
    args = with_unused(spec, {k: x for k, x in given.items() if x is not None},
                       zeros=relax.const(np.zeros(heads, np.float32)))
    y = node.kernels.call_paged(node.bb, spec, list(args.values()), [tokens, heads, d], (node.name,),
                                f"{node.op} converter")
    return [node.emit(op.reshape(y, [tokens, heads * d])), k_cache if node.wants(1) else None,
            v_cache if node.wants(2) else None]


def _cache_shape(node: Node, k_cache: relax.Expr, v_cache: relax.Expr, kv_heads: int) -> tuple:
    """(pages, P, h_kv, d) of the caches, P and d static, P a power of two, h_kv the attribute's."""
    shape = shape_of(k_cache, "key_cache")
    if len(shape) != 4 or len(shape_of(v_cache, "value_cache")) != 4:
        raise TvmAttnError("key_cache and value_cache must be 4-D: (num_blocks, block_size, kv_num_heads, head_size)")
    if str(shape_of(v_cache, "value_cache")) != str(shape) or str(v_cache.ty.dtype) != str(k_cache.ty.dtype):
        raise TvmAttnError("value_cache must have key_cache's shape and dtype")
    page, heads, d = (static(x, what) for x, what in zip(shape[1:], ("the block size", "the cache's head count",
                                                                    "the head size")))
    if heads != kv_heads:
        raise TvmAttnError(f"key_cache has {heads} heads, kv_num_heads says {kv_heads}")
    if page & (page - 1) or not 1 <= page <= 256:
        raise TvmAttnError(f"the block size {page} is not supported: tvmattn's paged kernel takes pages of a power "
                           f"of two from 1 to 256 keys (vLLM's and FlashAttention's caches use 16)")
    return shape[0], page, heads, d


def _heads(node: Node, q, k, v, heads: int, kv_heads: int, d: int) -> tuple:
    """q (T, h, d), k and v (T, h_kv, d), split from packed QKV where key is absent."""
    tokens, width = shape_of(q, "query")[:2] if len(shape_of(q, "query")) == 2 else (None, None)
    if width is None:
        raise TvmAttnError("query must be 2-D: (num_tokens, num_heads · head_size), or packed QKV")
    width = static(width, "the query width")
    if k is None:
        if width != (heads + 2 * kv_heads) * d:
            raise TvmAttnError(f"packed QKV has width {width}, not (num_heads + 2·kv_num_heads)·head_size = "
                               f"{(heads + 2 * kv_heads) * d}")
        parts = node.emit(op.split(q, [heads * d, (heads + kv_heads) * d], axis=1))
        q, k, v = (node.emit(relax.TupleGetItem(parts, i)) for i in range(3))
    elif width != heads * d:
        raise TvmAttnError(f"query has width {width}, not num_heads · head_size = {heads * d}")
    for x, what in ((k, "key"), (v, "value")):
        shape = shape_of(x, what)
        if len(shape) != 2 or static(shape[1], f"the {what} width") != kv_heads * d:
            raise TvmAttnError(f"{what} must be (num_tokens, kv_num_heads · head_size = {kv_heads * d})")
    return (node.emit(op.reshape(q, [tokens, heads, d])), node.emit(op.reshape(k, [tokens, kv_heads, d])),
            node.emit(op.reshape(v, [tokens, kv_heads, d])))


def _rms_norm(node: Node, x: relax.Expr, weight: relax.Expr, epsilon: float) -> relax.Var:
    """Each head's RMSNorm (over d), in fp32, back in x's dtype: the op's Q/K norm."""
    dtype = str(x.ty.dtype)
    x32, w32 = (node.emit(op.astype(t, "float32")) if str(t.ty.dtype) != "float32" else t for t in (x, weight))
    return node.emit(op.astype(node.emit(op.nn.rms_norm(x32, w32, axes=[-1], epsilon=float(epsilon))), dtype))


def _rotary(node: Node, x: relax.Expr, cos: relax.Expr, sin: relax.Expr, positions: relax.Expr,
            interleaved: bool, what: str) -> relax.Var:
    """RoPE of ``x`` (T, heads, d) at ``positions`` (T,) from (max_position, r/2) caches."""
    tokens, heads, d = shape_of(x, what)
    half = static(shape_of(cos, "cos_cache")[-1], "the rotary width of cos_cache")
    if len(shape_of(cos, "cos_cache")) != 2 or str(shape_of(sin, "sin_cache")) != str(shape_of(cos, "cos_cache")) \
            or 2 * half > static(d, "the head size"):
        raise TvmAttnError(f"cos_cache and sin_cache must be (max_position, r/2) with r ≤ the head size {d}")
    c, s = rotary.at_positions(node, node.emit(op.reshape(positions, [1, tokens])), cos, sin, check=False)
    rotated = rotary.rotate(node, node.emit(op.reshape(x, [1, tokens, heads, d])), c, s, interleaved, 2 * half,
                            head_axis=2)
    return node.emit(op.reshape(rotated, [tokens, heads, d]))


def _index(node: Node, cu, past, table, slot_mapping, tokens, pages, page: int) -> tuple:
    """(slots (T,) int64, positions (T,) int64, key counts (B,) int32) from the index inputs, checked."""
    for x, name, rank in ((cu, "cumulative_sequence_length", 1), (past, "past_seqlens", 1), (table, "block_table", 2),
                          (slot_mapping, "slot_mapping", 1)):
        if x is not None and (len(shape_of(x, name)) != rank or str(x.ty.dtype) != "int32"):
            raise TvmAttnError(f"{name} must be a {rank}-D int32 tensor")
    given = slot_mapping if slot_mapping is not None else relax.const(np.zeros(0, np.int32))
    func = node.bb.add_func(_index_func(page, slot_mapping is not None, f"node {node.name!r} ({node.op})"),
                            "paged_attention_index")
    batch = shape_of(past, "past_seqlens")[0]
    out = node.emit(relax.call_tir(func, [cu, past, table, given, relax.prim_value(tirx.Cast(I64, pages))], [
        relax.TensorType([tokens], I64), relax.TensorType([tokens], I64), relax.TensorType([batch], "int32")]))
    return tuple(node.emit(relax.TupleGetItem(out, i)) for i in range(3))


def _index_func(page: int, given_slots: bool, where: str) -> tirx.PrimFunc:
    """The index inputs checked (each failure a sentence), and what they say for each token and sequence."""

    bad_cu = f"{where}: input 'cumulative_sequence_length' must run from 0 to the number of tokens, never decreasing"
    bad_given = f"{where}: input 'slot_mapping' must have one entry a token"
    bad_past = (f"{where}: input 'past_seqlens' plus a sequence's new tokens must lie in [0, what block_table "
                f"reaches: its columns times the block size {page}]")
    bad_block = (f"{where}: input 'block_table' names a block outside the caches (or -1, unmapped) within a "
                 f"sequence's length: point it at a block of key_cache and value_cache")
    bad_slot = f"{where}: input 'slot_mapping' must be -1 (no write) or a slot of the caches, block * {page} + row"

    @T.prim_func(private=True)
    def index(cu_h: T.handle, past_h: T.handle, table_h: T.handle, given_h: T.handle, pages: T.int64,
              slot_h: T.handle, pos_h: T.handle, lens_h: T.handle):
        batch, width, tokens, n_given = T.int64(), T.int64(), T.int64(), T.int64()
        PAST = T.match_buffer(past_h, (batch,), "int32")
        CU = T.match_buffer(cu_h, (batch + 1,), "int32")
        TABLE = T.match_buffer(table_h, (batch, width), "int32")
        GIVEN = T.match_buffer(given_h, (n_given,), "int32")
        SLOT = T.match_buffer(slot_h, (tokens,), I64)
        POS = T.match_buffer(pos_h, (tokens,), I64)
        LENS = T.match_buffer(lens_h, (batch,), "int32")
        assert CU[0] == 0 and T.Cast(I64, CU[batch]) == tokens, bad_cu
        if given_slots:
            assert n_given == tokens, bad_given
        for b in range(batch):  # all of them before any write: CU indexes the outputs
            assert CU[b] <= CU[b + 1], bad_cu
        for b in range(batch):
            assert 0 <= PAST[b] and T.Cast(I64, PAST[b]) + T.Cast(I64, CU[b + 1] - CU[b]) <= width * page, bad_past
            LENS[b] = PAST[b] + CU[b + 1] - CU[b]
            for j in range((T.Cast(I64, LENS[b]) + page - 1) // page):
                assert 0 <= TABLE[b, j] and T.Cast(I64, TABLE[b, j]) < pages, bad_block
            for i in range(CU[b + 1] - CU[b]):
                POS[CU[b] + i] = T.Cast(I64, PAST[b] + i)
                if given_slots:
                    assert -1 <= GIVEN[CU[b] + i] and T.Cast(I64, GIVEN[CU[b] + i]) < pages * page, bad_slot
                    SLOT[CU[b] + i] = T.Cast(I64, GIVEN[CU[b] + i])
                else:
                    SLOT[CU[b] + i] = (T.Cast(I64, TABLE[b, T.Cast(I64, PAST[b] + i) // page]) * page
                                       + T.Cast(I64, PAST[b] + i) % page)

    return index.with_attr(OP_PATTERN, OPAQUE).with_attr(IS_SCHEDULED, True)


def _write_func(page: int, dtype: str) -> tirx.PrimFunc:
    """cache[slot // P, slot % P] = the token's row, for each token whose slot lies in the caches."""

    @T.prim_func(private=True)
    def write(kc_h: T.handle, vc_h: T.handle, k_h: T.handle, v_h: T.handle, slot_h: T.handle):
        pages, tokens, heads, d = T.int64(), T.int64(), T.int64(), T.int64()
        KC = T.match_buffer(kc_h, (pages, page, heads, d), dtype)
        VC = T.match_buffer(vc_h, (pages, page, heads, d), dtype)
        K = T.match_buffer(k_h, (tokens, heads, d), dtype)
        V = T.match_buffer(v_h, (tokens, heads, d), dtype)
        SLOT = T.match_buffer(slot_h, (tokens,), I64)
        for t in T.parallel(tokens):
            if 0 <= SLOT[t] and SLOT[t] < pages * page:
                for h, e in T.grid(heads, d):
                    KC[SLOT[t] // page, SLOT[t] % page, h, e] = K[t, h, e]
                    VC[SLOT[t] // page, SLOT[t] % page, h, e] = V[t, h, e]

    return write.with_attr(OP_PATTERN, OPAQUE).with_attr(IS_SCHEDULED, True)
