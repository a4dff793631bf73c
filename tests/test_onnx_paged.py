"""ONNX Runtime's com.microsoft.PagedAttention imported onto tvmattn's paged kernel.

ONNX Runtime has no CPU kernel for the op, so the reference is the op's specification written here in
float64 NumPy: write each new token's key and value into its slot, then attend to each sequence's pages.
The caches come back updated (in place, as the op says), and a second step runs on them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh

import tvmattn
from tvmattn.compiler.arguments import numpy_dtype
from tvmattn.compiler.errors import TvmAttnError

PROTO = {"float32": TP.FLOAT, "float16": TP.FLOAT16, "bfloat16": TP.BFLOAT16}
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 3e-2}  # of the output's scale


@dataclass(frozen=True)
class Case:
    dtype: str = "float16"
    heads: int = 8
    kv_heads: int = 2
    d: int = 32
    page: int = 16
    causal: int = 1
    window: int = -1
    softcap: float = 0.0
    scale: float = 0.0
    sink: str = ""  # "", "head_sink" or "smooth"
    rotary: str = ""  # "", "half" or "interleaved"
    rotary_dim: int = 0  # 0: d
    packed: bool = False
    slots: bool = False  # slot_mapping given (some -1: no write)
    qk_norm: bool = False


@functools.cache
def _model(case: Case) -> onnx.ModelProto:
    t, h, hkv, d = PROTO[case.dtype], case.heads, case.kv_heads, case.d
    names = ["query", "" if case.packed else "key", "" if case.packed else "value", "key_cache", "value_cache",
             "cumulative_sequence_length", "past_seqlens", "block_table", "cos_cache" if case.rotary else "",
             "sin_cache" if case.rotary else "", "slot_mapping" if case.slots else "",
             "head_sink" if case.sink == "head_sink" else "", "q_norm_weight" if case.qk_norm else "",
             "k_norm_weight" if case.qk_norm else ""]
    cache = ["pages", case.page, hkv, d]
    shapes = {"query": (t, ["T", (h + 2 * hkv) * d if case.packed else h * d]), "key": (t, ["T", hkv * d]),
              "value": (t, ["T", hkv * d]), "key_cache": (t, cache), "value_cache": (t, cache),
              "cumulative_sequence_length": (TP.INT32, ["B1"]), "past_seqlens": (TP.INT32, ["B"]),
              "block_table": (TP.INT32, ["B", "max_pages"]), "cos_cache": (t, ["positions", _rotary_dim(case) // 2]),
              "sin_cache": (t, ["positions", _rotary_dim(case) // 2]), "slot_mapping": (TP.INT32, ["T"]),
              "head_sink": (t, [h]), "q_norm_weight": (t, [d]), "k_norm_weight": (t, [d])}
    node = oh.make_node("PagedAttention", names, ["output", "key_cache_out", "value_cache_out"], "paged",
                        domain="com.microsoft", num_heads=h, kv_num_heads=hkv, is_causal=case.causal,
                        local_window_size=case.window, softcap=case.softcap, scale=case.scale,
                        do_rotary=int(bool(case.rotary)), rotary_interleaved=int(case.rotary == "interleaved"),
                        smooth_softmax=int(case.sink == "smooth"))
    graph = oh.make_graph([node], "paged", [oh.make_tensor_value_info(n, *shapes[n]) for n in names if n], [
        oh.make_tensor_value_info("output", t, ["T", h * d]), oh.make_tensor_value_info("key_cache_out", t, cache),
        oh.make_tensor_value_info("value_cache_out", t, cache)])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21), oh.make_opsetid("com.microsoft", 1)])


@functools.cache
def _imported(case: Case) -> tvmattn.ImportedModel:
    return tvmattn.import_onnx(_model(case))


def _rotary_dim(case: Case) -> int:
    return case.rotary_dim or case.d


def _feed(case: Case, past: list[int], new: list[int], rng, shared_prefix: bool = False) -> dict[str, np.ndarray]:
    """Inputs for sequences of ``past`` cached keys and ``new`` tokens, their pages (room for one more
    token) shuffled through a pool with spare pages; block-table entries past them hold junk (−1, huge)."""
    p = case.page
    widths = [-(-(a + b + 1) // p) for a, b in zip(past, new)]
    pages = sum(widths) + 3
    order = rng.permutation(pages)
    table = np.full((len(past), max(widths) + 2), -1, np.int32)
    table[:, -1] = 10**6
    for b, w in enumerate(widths):
        table[b, :w] = order[sum(widths[:b]):sum(widths[:b]) + w]
    if shared_prefix:  # every sequence's first page (full, before its new tokens) is sequence 0's
        assert min(past) >= p
        table[:, 0] = table[0, 0]
    caches = {name: rng.standard_normal((pages, p, case.kv_heads, case.d)).astype(numpy_dtype(case.dtype))
              for name in ("key_cache", "value_cache")}
    return {**caches, **_tokens(case, past, new, table, rng)}


def _tokens(case: Case, past: list[int], new: list[int], table: np.ndarray, rng) -> dict[str, np.ndarray]:
    """A step's inputs besides the caches: the new tokens of each sequence and where they go."""
    p, tokens = case.page, sum(new)
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    feed = {"query": rng.standard_normal((tokens, (case.heads + 2 * case.kv_heads * case.packed) * case.d)),
            "cumulative_sequence_length": cu, "past_seqlens": np.array(past, np.int32), "block_table": table}
    if not case.packed:
        feed["key"], feed["value"] = (rng.standard_normal((tokens, case.kv_heads * case.d)) for _ in range(2))
    if case.rotary:
        angles = rng.uniform(0, 2 * np.pi, (max(a + b for a, b in zip(past, new)) + 5, _rotary_dim(case) // 2))
        feed["cos_cache"], feed["sin_cache"] = np.cos(angles), np.sin(angles)
    if case.slots:  # the slots the block table gives, some tokens not written (a prefix-cache hit)
        seq = np.repeat(np.arange(len(past)), new)
        pos = np.array(past)[seq] + np.arange(tokens) - cu[seq]
        slots = table[seq, pos // p] * p + pos % p
        feed["slot_mapping"] = np.where(rng.random(tokens) < 0.3, -1, slots).astype(np.int32)
    if case.sink == "head_sink":
        feed["head_sink"] = rng.uniform(-2, 6, case.heads)
    if case.qk_norm:
        feed["q_norm_weight"], feed["k_norm_weight"] = (rng.standard_normal(case.d) for _ in range(2))
    return {k: v if v.dtype.kind == "i" else v.astype(numpy_dtype(case.dtype)) for k, v in feed.items()}


def _reference(case: Case, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The op as its specification says, in float64: output (T, h·d) and both caches after the writes."""
    h, hkv, d, p, dt = case.heads, case.kv_heads, case.d, case.page, numpy_dtype(case.dtype)
    f = {k: v.astype(np.float64) if v.dtype.kind != "i" else v for k, v in feed.items()}
    cu, past, table = feed["cumulative_sequence_length"], feed["past_seqlens"], feed["block_table"]
    if case.packed:
        q, k, v = np.split(f["query"], [h * d, (h + hkv) * d], axis=1)
    else:
        q, k, v = f["query"], f["key"], f["value"]
    q, k, v = q.reshape(-1, h, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    seq = np.repeat(np.arange(len(past)), np.diff(cu))
    pos = past[seq] + np.arange(len(seq)) - cu[seq]
    if case.qk_norm:
        q, k = (x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * f[w] for x, w in
                ((q, "q_norm_weight"), (k, "k_norm_weight")))
    if case.rotary:
        q, k = (_rope(x, f["cos_cache"][pos], f["sin_cache"][pos], case.rotary == "interleaved") for x in (q, k))
    kc, vc = feed["key_cache"].copy(), feed["value_cache"].copy()
    slots = feed["slot_mapping"] if case.slots else table[seq, pos // p] * p + pos % p
    for t, s in enumerate(slots):
        if s >= 0:
            kc[s // p, s % p], vc[s // p, s % p] = k[t].astype(dt), v[t].astype(dt)
    scale = case.scale or 1 / np.sqrt(d)
    out = np.zeros((len(seq), h, d))
    for t in range(len(seq)):
        b, length = seq[t], past[seq[t]] + cu[seq[t] + 1] - cu[seq[t]]
        keys = np.arange(length)
        rows = table[b, keys // p], keys % p
        kk, vv = kc[rows].astype(np.float64), vc[rows].astype(np.float64)  # (L, h_kv, d)
        for head in range(h):
            logits = kk[:, head // (h // hkv)] @ q[t, head] * scale
            if case.softcap:
                logits = case.softcap * np.tanh(logits / case.softcap)
            seen = (keys <= pos[t]) if case.causal else np.ones(length, bool)
            if case.window >= 0:
                seen &= keys > pos[t] - case.window
            logits = np.where(seen, logits, -np.inf)
            sink = {"head_sink": f.get("head_sink", [0] * h)[head], "smooth": 0.0}.get(case.sink, -np.inf)
            top = max(logits.max(initial=-np.inf), sink)
            weights = np.exp(logits - top)
            out[t, head] = weights @ vv[:, head // (h // hkv)] / (weights.sum() + np.exp(sink - top))
    return [out.reshape(len(seq), h * d), kc, vc]


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """x (T, heads, d) rotated at its tokens' cos, sin (T, r/2); features past r pass through."""
    r = 2 * cos.shape[1]
    c, s, y = cos[:, None], sin[:, None], x.copy()
    x1, x2 = (x[..., 0:r:2], x[..., 1:r:2]) if interleaved else (x[..., :r // 2], x[..., r // 2:r])
    a, b = x1 * c - x2 * s, x1 * s + x2 * c
    if interleaved:
        y[..., 0:r:2], y[..., 1:r:2] = a, b
    else:
        y[..., :r // 2], y[..., r // 2:r] = a, b
    return y


def check(case: Case, past: list[int], new: list[int], seed: int = 0, shared_prefix: bool = False) -> None:
    """One step, then a decode step on the caches it returned: outputs and caches against `_reference`."""
    rng = np.random.default_rng(seed)
    feed = _feed(case, past, new, rng, shared_prefix)
    for step in range(2):
        want = _reference(case, feed)
        got = _imported(case).run(dict(feed))
        assert all(np.array_equal(feed[name], g) for name, g in zip(("key_cache", "value_cache"), got[1:]))  # in place
        error = np.abs(got[0].astype(np.float64) - want[0]).max() / max(np.abs(want[0]).max(), 1e-3)
        assert error <= TOLERANCE[case.dtype], f"step {step}: output error {error:.3g}"
        for g, w in zip(got[1:], want[1:]):  # the caches: the new rows written (after norm and rotary), no other
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=TOLERANCE[case.dtype],
                                       atol=TOLERANCE[case.dtype])
        past, new = [a + b for a, b in zip(past, new)], [1] * len(past)
        feed = {"key_cache": got[1], "value_cache": got[2], **_tokens(case, past, new, feed["block_table"], rng)}


C = Case()
CASES = [  # (case, past lengths, new tokens per sequence)
    (C, [37, 0, 200], [1, 1, 1]),  # decode steps (one first token)
    (replace(C, dtype="bfloat16", page=32), [0, 45, 7, 64], [19, 0, 6, 33]),  # chunked prefill, an empty sequence
    (replace(C, dtype="float32", page=1, window=9, softcap=30.0, scale=0.3), [20, 3], [5, 12]),
    (replace(C, causal=0, sink="head_sink", page=8, kv_heads=1), [30, 0], [4, 9]),  # a block drafter, MQA
    (replace(C, rotary="half", rotary_dim=16, qk_norm=True, sink="smooth"), [17, 50], [3, 1]),
    (replace(C, rotary="interleaved", packed=True, heads=4, kv_heads=4, d=64), [10, 33, 0], [2, 1, 7]),
    (replace(C, slots=True, page=4), [9, 12], [6, 2]),
]


@pytest.mark.parametrize("case,past,new", CASES)
def test_paged_attention_matches_its_specification(case, past, new):
    check(case, past, new)


def test_sequences_sharing_a_prefix_page():
    check(C, [16, 20, 31], [3, 1, 2], seed=1, shared_prefix=True)


def test_the_report_names_the_paged_kernel():
    report = _imported(C).report
    assert [r.kernel for r in report.replacements] == ["tvmattn_paged0"] and "ragged" in report.replacements[0].line()
    assert report.in_place == {"key_cache_out": "key_cache", "value_cache_out": "value_cache"}
    assert "key_cache_out is key_cache, written in place" in str(report)


BAD = [  # (input, how it is broken, what the error names)
    ("block_table", lambda f: f["block_table"].__setitem__((1, 0), f["key_cache"].shape[0]), "block_table"),
    ("block_table", lambda f: f["block_table"].__setitem__((0, 2), -1), "block_table"),
    ("past_seqlens", lambda f: f["past_seqlens"].__setitem__(0, -3), "past_seqlens"),
    ("past_seqlens", lambda f: f["past_seqlens"].__setitem__(2, 10**5), "past_seqlens"),
    ("cumulative_sequence_length", lambda f: f["cumulative_sequence_length"].__setitem__(1, 5),
     "cumulative_sequence_length"),
    ("cumulative_sequence_length", lambda f: f["cumulative_sequence_length"].__setitem__(3, 2),
     "cumulative_sequence_length"),
]


@pytest.mark.parametrize("name,breaks,named", BAD)
def test_bad_index_inputs_are_one_clear_error(name, breaks, named):
    feed = _feed(C, [37, 0, 200], [1, 1, 1], np.random.default_rng(0))
    feed[name] = feed[name].copy()
    breaks(feed)
    with pytest.raises(TvmAttnError, match=named):
        _imported(C).run(feed)


def test_a_slot_outside_the_caches_is_one_clear_error():
    case = replace(C, slots=True, page=4)
    feed = _feed(case, [9, 12], [6, 2], np.random.default_rng(0))
    feed["slot_mapping"] = feed["slot_mapping"].copy()
    feed["slot_mapping"][3] = feed["key_cache"].shape[0] * 4
    with pytest.raises(TvmAttnError, match="slot_mapping"):
        _imported(case).run(feed)


@pytest.mark.parametrize("change,named", [
    (dict(page=12), "block size 12"),
    (dict(window=4, causal=0), "local_window_size"),
])
def test_what_the_kernel_does_not_do_is_refused_at_import(change, named):
    with pytest.raises(TvmAttnError, match=named):
        tvmattn.import_onnx(_model(replace(C, **change)))


def test_a_cache_computed_in_the_model_is_refused():
    """The op writes its caches in place: they must be the model's inputs, not tensors it computes."""
    model = onnx.ModelProto()
    model.CopyFrom(_model(C))  # (the cached one stays as it is)
    graph = model.graph
    node = graph.node[0]
    node.input[3] = "key_cache_copy"
    graph.node.insert(0, oh.make_node("Neg", ["key_cache"], ["negated"]))
    graph.node.insert(1, oh.make_node("Neg", ["negated"], ["key_cache_copy"]))
    with pytest.raises(TvmAttnError, match="must be inputs of the model"):
        tvmattn.import_onnx(model)
