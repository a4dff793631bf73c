"""tvmattn.import_onnx against ONNX Runtime: models/ builders, every converter, fallback, bad input.

Dimensions are symbolic (batch, seq, …) and each model runs at two sizes; the report must show each
attention on a tvmattn kernel (`onnx_testing.assert_matches_ort` fails if one fell back to TVM).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx_testing import assert_matches_ort, kernels_used, ort_run, randn
from tvm import relax, tirx

import tvmattn
from tvmattn.compiler.cli import main
from tvmattn.compiler.onnx.importer import relax_module
from tvmattn.compiler.onnx.shape_ops import refuse_sizes_by_themselves
from tvmattn.compiler.target import host_target
from tvmattn.models.onnx_models import ATTENTIONS, BUILDERS

D = 8  # head width in the op-level models


def _feeds(name: str, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    feeds = []
    for batch, seq in ((2, 7), (1, 16)):
        feed = {"x": randn(rng, batch, seq, 64)}
        if name == "bert":
            feed["attention_mask"] = np.ones((batch, seq), np.int64)
            feed["attention_mask"][0, seq - 3:] = 0  # padding
        if name == "llama":
            feed["position_ids"] = np.tile(np.arange(seq), (batch, 1)).astype(np.int64)
        if name == "cross":
            feed["memory"] = randn(rng, batch, seq + 3, 64)
        feeds.append(feed)
    return feeds


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_models_match_onnx_runtime(name):
    imported = assert_matches_ort(BUILDERS[name](), _feeds(name, np.random.default_rng(0)), ATTENTIONS[name])
    spec = imported.report.replacements[0].spec
    assert spec.batch == "batch" and spec.seq_len == "seq"  # one kernel for every length
    if name == "llama":
        assert (spec.h, spec.h_kv) == (4, 2)  # GQA found under repeat_kv
    if name == "cross":
        assert spec.kv_seq_len == "mem_seq"
    if name == "gpt2":  # its sliced tril buffer is proven causal: tile skipping, no mask to read
        assert spec.causal and spec.attn_mask is None


def test_buffer_one_diagonal_off_tril_stays_a_mask():
    """GPT-2's slicing of a buffer that keeps keys j ≤ i + 1 is not causal: it stays a mask."""
    model = BUILDERS["gpt2"]()
    bias = next(t for t in model.graph.initializer if t.name == "bias")
    size = bias.dims[-1]
    bias.CopyFrom(onnx.numpy_helper.from_array(np.tri(size, size, 1, dtype=bool)[None, None], "bias"))
    imported = assert_matches_ort(model, _feeds("gpt2", np.random.default_rng(1)), 1)
    spec = imported.report.replacements[0].spec
    assert not spec.causal and spec.attn_mask is not None


@pytest.mark.parametrize("shift, window", [(0, None), (0, 3), (1, 3), (0, 8)])
def test_constant_band_mask(shift, window):
    """A constant bool mask where(keep, scores, -inf) of static sizes (8 queries, 8 keys), keep the band
    j ≤ i + shift (and j > i + shift − window): the causal rule with its window where shift is 0 (a
    window of every key is plain causal), a mask otherwise."""
    n = 8
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    keep = (j <= i + shift) & (j > i + shift - (window or n + 1))
    nodes = [oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), oh.make_node("MatMul", ["q", "kt"], ["sc"]),
             oh.make_node("Where", ["keep", "sc", "fill"], ["logits"]),
             oh.make_node("Softmax", ["logits"], ["probs"], axis=-1), oh.make_node("MatMul", ["probs", "v"], ["y"])]
    model = _model(nodes, [(name, TP.FLOAT, [2, 2, n, D]) for name in "qkv"], [("y", TP.FLOAT, [2, 2, n, D])])
    model.graph.initializer.extend([onnx.numpy_helper.from_array(keep[None, None], "keep"),
                                    onnx.numpy_helper.from_array(np.array(-np.inf, np.float32), "fill")])
    rng = np.random.default_rng(3)
    spec = assert_matches_ort(model, [{name: randn(rng, 2, 2, n, D) for name in "qkv"}], 1).report.replacements[0].spec
    if shift == 0:
        assert (spec.causal, spec.window, spec.attn_mask) == (True, window if window and window < n else None, None)
    else:
        assert not spec.causal and spec.attn_mask == "bool", spec.describe()


def _positional_mask_model(from_past: bool, shift: int, strict: bool, window: int | None) -> onnx.ModelProto:
    """Decomposed attention after a cache (K = concat(past, new), n_kv = P + S) whose additive mask is
    computed from positions when the model runs, as dynamic-shape exports write it: key positions
    j = arange(n_kv), query positions q = arange(start, start + S) with start P or 0; keep
    j ≤ q + shift (j < q + shift when ``strict``), and j > q + shift − ``window``; where(keep, 0, finfo.min)."""
    c = lambda name, value: onnx.numpy_helper.from_array(np.asarray(value), name)  # noqa: E731
    start = "p" if from_past else "zero"
    nodes = [oh.make_node("Shape", ["q"], ["s1"], start=2, end=3),
             oh.make_node("Shape", ["pk"], ["p1d"], start=2, end=3),
             oh.make_node("Squeeze", ["s1"], ["s"]), oh.make_node("Squeeze", ["p1d"], ["p"]),
             oh.make_node("Add", ["p", "s"], ["t"]), oh.make_node("Add", [start, "s"], ["end"]),
             oh.make_node("Range", ["zero", "t", "one"], ["kpos"]),
             oh.make_node("Range", [start, "end", "one"], ["qpos"]),
             oh.make_node("Unsqueeze", ["qpos", "axis1"], ["qcol"]), oh.make_node("Add", ["qcol", "shift"], ["top"]),
             oh.make_node("Less" if strict else "LessOrEqual", ["kpos", "top"],
                          ["keep" if window is None else "upper"])]
    if window is not None:
        nodes += [oh.make_node("Sub", ["top", "window"], ["low"]), oh.make_node("Greater", ["kpos", "low"], ["near"]),
                  oh.make_node("And", ["upper", "near"], ["keep"])]
    nodes += [oh.make_node("Where", ["keep", "zero_f", "min_f"], ["bias"]),
              oh.make_node("Concat", ["pk", "kn"], ["k"], axis=2), oh.make_node("Concat", ["pv", "vn"], ["v"], axis=2),
              oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), oh.make_node("MatMul", ["q", "kt"], ["sc"]),
              oh.make_node("Mul", ["sc", "scale"], ["scaled"]), oh.make_node("Add", ["scaled", "bias"], ["logits"]),
              oh.make_node("Softmax", ["logits"], ["probs"], axis=-1), oh.make_node("MatMul", ["probs", "v"], ["y"])]
    cache = [(n, TP.FLOAT, ["B", 2, "P", D]) for n in ("pk", "pv")]
    new = [(n, TP.FLOAT, ["B", 2, "S", D]) for n in ("q", "kn", "vn")]
    model = _model(nodes, new + cache, [("y", TP.FLOAT, ["B", 2, "S", D])], (("", 17),))
    used = {i for n in nodes for i in n.input}
    constants = [c("zero", np.int64(0)), c("one", np.int64(1)), c("shift", np.int64(shift)),
                 c("window", np.int64(window or 0)), c("axis1", np.array([1], np.int64)), c("zero_f", np.float32(0)),
                 c("min_f", np.float32(np.finfo(np.float32).min)), c("scale", np.float32(D ** -0.5))]
    model.graph.initializer.extend(t for t in constants if t.name in used)
    return model


@settings(max_examples=6, deadline=None)
@given(from_past=st.booleans(), shift=st.integers(-2, 2), strict=st.booleans(), window=st.none() | st.integers(1, 4))
def test_mask_computed_from_positions(from_past, shift, strict, window):
    """A mask of position arithmetic is the spec's rule only where it provably is at every length:
    keys j ≤ i + offset with offset P (bottom-right) or 0 (top-left), a window below it; then no mask
    is read. Any other offset stays a mask. Each at three (past, new) sizes, one a decode step."""
    rng = np.random.default_rng(2)
    feeds = [{"q": randn(rng, b, 2, s, D), "kn": randn(rng, b, 2, s, D), "vn": randn(rng, b, 2, s, D),
              "pk": randn(rng, b, 2, p, D), "pv": randn(rng, b, 2, p, D)}
             for b, p, s in ((2, 3, 4), (1, 1, 5), (1, 6, 1))]
    spec = assert_matches_ort(_positional_mask_model(from_past, shift, strict, window), feeds, 1
                              ).report.replacements[0].spec
    top = shift - strict  # keep j ≤ i + start + top; the window keeps j ≥ i + start + shift − window + 1
    keys = None if window is None else window - strict
    if top == 0 and (keys is None or keys >= 1):
        want = (True, "bottom_right" if from_past else "top_left", keys, None)
        assert (spec.causal, spec.causal_align, spec.window, spec.attn_mask) == want, spec.describe()
    else:
        assert not spec.causal and spec.attn_mask == "additive", spec.describe()


# ---- op-level models, one per converter ------------------------------------------------------------------
def _model(nodes, inputs, outputs, domain_opsets=(("", 23),)) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info(*i) for i in inputs],
                          [oh.make_tensor_value_info(*o) for o in outputs])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid(d, v) for d, v in domain_opsets])
    model.ir_version = 10
    return model


MS = (("", 17), ("com.microsoft", 1))


def test_onnx_attention_3d_gqa_causal_mask_dynamic():
    node = oh.make_node("Attention", ["q", "k", "v", "m"], ["y"], q_num_heads=4, kv_num_heads=2, is_causal=1)
    model = _model([node], [("q", TP.FLOAT, ["B", "S", 4 * D]), ("k", TP.FLOAT, ["B", "S", 2 * D]),
                            ("v", TP.FLOAT, ["B", "S", 2 * D]), ("m", TP.BOOL, ["B", 1, "S", "S"])],
                   [("y", TP.FLOAT, ["B", "S", 4 * D])])
    rng = np.random.default_rng(1)
    feeds = [{"q": randn(rng, b, s, 4 * D), "k": randn(rng, b, s, 2 * D), "v": randn(rng, b, s, 2 * D),
              "m": rng.random((b, 1, s, s)) < 0.8} for b, s in ((2, 5), (1, 11))]
    for f in feeds:
        f["m"][..., 0] = True  # no row without a key: ORT's softmax is NaN there, the kernel's zero
    imported = assert_matches_ort(model, feeds, 1)
    spec = imported.report.replacements[0].spec
    assert spec.causal and spec.attn_mask == "bool" and spec.h_kv == 2


def test_onnx_attention_4d_past_present_softcap_dynamic():
    node = oh.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "pk_out", "pv_out"], is_causal=1,
                        softcap=3.0, scale=0.2)
    model = _model([node], [("q", TP.FLOAT, ["B", 2, "S", D]), ("k", TP.FLOAT, ["B", 2, "S", D]),
                            ("v", TP.FLOAT, ["B", 2, "S", D]), ("pk", TP.FLOAT, ["B", 2, "P", D]),
                            ("pv", TP.FLOAT, ["B", 2, "P", D])],
                   [("y", TP.FLOAT, ["B", 2, "S", D]), ("pk_out", TP.FLOAT, ["B", 2, "T", D]),
                    ("pv_out", TP.FLOAT, ["B", 2, "T", D])])
    rng = np.random.default_rng(2)
    feeds = [{"q": randn(rng, b, 2, s, D), "k": randn(rng, b, 2, s, D), "v": randn(rng, b, 2, s, D),
              "pk": randn(rng, b, 2, p, D), "pv": randn(rng, b, 2, p, D)} for b, s, p in ((2, 3, 4), (1, 1, 9))]
    spec = assert_matches_ort(model, feeds, 1).report.replacements[0].spec
    assert spec.causal_align == "bottom_right" and spec.softcap == 3.0


def test_ms_multi_head_attention_cross_with_key_lengths():
    node = oh.make_node("MultiHeadAttention", ["q", "k", "v", "", "lens"], ["y"], domain="com.microsoft",
                        num_heads=4)
    model = _model([node], [("q", TP.FLOAT, ["B", "S", 4 * D]), ("k", TP.FLOAT, ["B", "L", 4 * D]),
                            ("v", TP.FLOAT, ["B", "L", 4 * D]), ("lens", TP.INT32, ["B"])],
                   [("y", TP.FLOAT, ["B", "S", 4 * D])], MS)
    rng = np.random.default_rng(3)
    feeds = [{"q": randn(rng, 2, 5, 4 * D), "k": randn(rng, 2, 7, 4 * D), "v": randn(rng, 2, 7, 4 * D),
              "lens": np.array([7, 3], np.int32)},
             {"q": randn(rng, 1, 2, 4 * D), "k": randn(rng, 1, 9, 4 * D), "v": randn(rng, 1, 9, 4 * D),
              "lens": np.array([4], np.int32)}]
    assert assert_matches_ort(model, feeds, 1).report.replacements[0].spec.key_padding


def test_ms_multi_head_attention_causal_cache_bias_and_masks():
    node = oh.make_node("MultiHeadAttention", ["q", "k", "v", "bias", "mask", "ab", "pk", "pv"],
                        ["y", "pk_out", "pv_out"], domain="com.microsoft", num_heads=4, unidirectional=1)
    model = _model([node], [("q", TP.FLOAT, ["B", "S", 4 * D]), ("k", TP.FLOAT, ["B", "S", 4 * D]),
                            ("v", TP.FLOAT, ["B", "S", 4 * D]), ("bias", TP.FLOAT, [12 * D]),
                            ("mask", TP.INT32, ["B", "T"]), ("ab", TP.FLOAT, [1, 4, "S", "T"]),
                            ("pk", TP.FLOAT, ["B", 4, "P", D]), ("pv", TP.FLOAT, ["B", 4, "P", D])],
                   [("y", TP.FLOAT, ["B", "S", 4 * D]), ("pk_out", TP.FLOAT, ["B", 4, "T", D]),
                    ("pv_out", TP.FLOAT, ["B", 4, "T", D])], MS)
    rng = np.random.default_rng(4)
    feeds = []
    for b, s, p in ((2, 4, 3), (1, 1, 6)):
        mask = np.ones((b, p + s), np.int32)
        mask[-1, :2] = 0
        feeds.append({"q": randn(rng, b, s, 4 * D), "k": randn(rng, b, s, 4 * D), "v": randn(rng, b, s, 4 * D),
                      "bias": randn(rng, 12 * D), "mask": mask, "ab": randn(rng, 1, 4, s, p + s),
                      "pk": randn(rng, b, 4, p, D), "pv": randn(rng, b, 4, p, D)})
    assert_matches_ort(model, feeds, 1)


def _ms_attention(inputs: list[str], extra_inputs, outputs, **attrs) -> onnx.ModelProto:
    rng = np.random.default_rng(5)
    node = oh.make_node("Attention", inputs, [o[0] for o in outputs], domain="com.microsoft", num_heads=4, **attrs)
    model = _model([node], [("x", TP.FLOAT, ["B", "S", 24])] + extra_inputs, outputs, MS)
    model.graph.initializer.extend([onnx.numpy_helper.from_array(randn(rng, 24, 12 * D) / 5, "w"),
                                    onnx.numpy_helper.from_array(randn(rng, 12 * D), "b")])
    return model


def test_ms_attention_unidirectional_with_past_and_lengths():
    model = _ms_attention(["x", "w", "b", "lens", "past"], [("lens", TP.INT32, ["B"]),
                                                           ("past", TP.FLOAT, [2, "B", 4, "P", D])],
                          [("y", TP.FLOAT, ["B", "S", 4 * D]), ("present", TP.FLOAT, [2, "B", 4, "T", D])],
                          unidirectional=1)
    rng = np.random.default_rng(6)
    feeds = [{"x": randn(rng, b, s, 24), "lens": np.array([p + s] * (b - 1) + [p + s - 1], np.int32),
              "past": randn(rng, 2, b, 4, p, D)} for b, s, p in ((2, 5, 3), (1, 2, 4))]
    assert_matches_ort(model, feeds, 1)


def test_ms_attention_scale_and_2d_mask():
    model = _ms_attention(["x", "w", "b", "mask"], [("mask", TP.INT32, ["B", "S"])],
                          [("y", TP.FLOAT, ["B", "S", 4 * D])], scale=0.3)
    rng = np.random.default_rng(7)
    feeds = []
    for b, s in ((2, 5), (3, 8)):
        mask = np.ones((b, s), np.int32)
        mask[0, 3:] = 0
        feeds.append({"x": randn(rng, b, s, 24), "mask": mask})
    assert assert_matches_ort(model, feeds, 1).report.replacements[0].spec.scale == pytest.approx(0.3)


def test_ms_group_query_attention_cache_window_softcap():
    node = oh.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total"],
                        ["y", "pk_out", "pv_out"], domain="com.microsoft", num_heads=4, kv_num_heads=2,
                        local_window_size=3, softcap=2.0)
    model = _model([node], [("q", TP.FLOAT, ["B", "S", 4 * D]), ("k", TP.FLOAT, ["B", "S", 2 * D]),
                            ("v", TP.FLOAT, ["B", "S", 2 * D]), ("pk", TP.FLOAT, ["B", 2, "P", D]),
                            ("pv", TP.FLOAT, ["B", 2, "P", D]), ("seqlens_k", TP.INT32, ["B"]),
                            ("total", TP.INT32, [])],
                   [("y", TP.FLOAT, ["B", "S", 4 * D]), ("pk_out", TP.FLOAT, ["B", 2, "T", D]),
                    ("pv_out", TP.FLOAT, ["B", 2, "T", D])], MS)
    rng = np.random.default_rng(8)
    # ORT takes several new tokens after a cache only for batch 1
    feeds = [{"q": randn(rng, b, s, 4 * D), "k": randn(rng, b, s, 2 * D), "v": randn(rng, b, s, 2 * D),
              "pk": randn(rng, b, 2, p, D), "pv": randn(rng, b, 2, p, D),
              "seqlens_k": np.full(b, p + s - 1, np.int32), "total": np.array(p + s, np.int32)}
             for b, s, p in ((2, 1, 6), (1, 4, 3))]
    spec = assert_matches_ort(model, feeds, 1).report.replacements[0].spec
    assert spec.window == 3 and spec.h_kv == 2


def test_ms_group_query_attention_packed_prompt():
    node = oh.make_node("GroupQueryAttention", ["qkv", "", "", "", "", "seqlens_k", "total"], ["y"],
                        domain="com.microsoft", num_heads=4, kv_num_heads=2)
    model = _model([node], [("qkv", TP.FLOAT, ["B", "S", 8 * D]), ("seqlens_k", TP.INT32, ["B"]),
                            ("total", TP.INT32, [])], [("y", TP.FLOAT, ["B", "S", 4 * D])], MS)
    rng = np.random.default_rng(9)
    feeds = [{"qkv": randn(rng, b, s, 8 * D), "seqlens_k": np.full(b, s - 1, np.int32),
              "total": np.array(s, np.int32)} for b, s in ((2, 5), (1, 9))]
    assert_matches_ort(model, feeds, 1)


# ---- what is not replaced, and the report ---------------------------------------------------------------
def _decomposed(fill: float, nan_guard: bool = False) -> onnx.ModelProto:
    """softmax(where(keep, q·kᵀ, fill))·v over (B, 2, S, D) inputs; with ``nan_guard`` the weights are
    where(isnan(p), 0, p) first, as torch's exporter writes scaled_dot_product_attention."""
    guard = [oh.make_node("IsNaN", ["p"], ["nan"]), oh.make_node("Where", ["nan", "zero", "p"], ["w"])]
    nodes = [oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             oh.make_node("MatMul", ["q", "kt"], ["s"]),
             oh.make_node("Where", ["keep", "s", "fill"], ["masked"]),
             oh.make_node("Softmax", ["masked"], ["p"], axis=-1),
             *(guard if nan_guard else []),
             oh.make_node("MatMul", ["w" if nan_guard else "p", "v"], ["y"])]
    model = _model(nodes, [("q", TP.FLOAT, ["B", 2, "S", D]), ("k", TP.FLOAT, ["B", 2, "S", D]),
                           ("v", TP.FLOAT, ["B", 2, "S", D]), ("keep", TP.BOOL, ["B", 1, "S", "S"])],
                   [("y", TP.FLOAT, ["B", 2, "S", D])], (("", 17),))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.float32(fill), "fill"))
    if nan_guard:
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.float32(0), "zero"))
    return model


def _decomposed_feed(rng):
    keep = rng.random((2, 1, 6, 6)) < 0.7
    keep[..., 0] = True
    return {"q": randn(rng, 2, 2, 6, D), "k": randn(rng, 2, 2, 6, D), "v": randn(rng, 2, 2, 6, D), "keep": keep}


def test_decomposed_attention_with_minus_inf_mask_is_replaced():
    imported = assert_matches_ort(_decomposed(-np.inf), [_decomposed_feed(np.random.default_rng(10))], 1)
    assert imported.report.replacements[0].spec.attn_mask == "bool"
    assert "pattern: decomposed attention" in str(imported.report)
    assert "Softmax_3" in str(imported.report)  # names the ONNX nodes it replaced
    assert [(f.node, f.kernel) for f in imported.report.softmaxes] == [("Softmax_3", "tvmattn_attention0")]


@pytest.mark.parametrize("bias", [["N", "S", "S"], [1, "S", "S"], ["S", "S"]])
def test_three_d_scores_and_their_bias(bias):
    """softmax(q·kᵀ + bias)·v over (N, S, D) operands (one head per batch entry, as WavLM's (B·h) batches):
    the kernel's 4-D view puts that head at axis 1, and the bias's axes must go where the scores' went."""
    nodes = [oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), oh.make_node("MatMul", ["q", "kt"], ["s"]),
             oh.make_node("Add", ["s", "bias"], ["b"]), oh.make_node("Softmax", ["b"], ["p"], axis=-1),
             oh.make_node("MatMul", ["p", "v"], ["y"])]
    model = _model(nodes, [*((x, TP.FLOAT, ["N", "S", D]) for x in "qkv"), ("bias", TP.FLOAT, bias)],
                   [("y", TP.FLOAT, ["N", "S", D])], (("", 17),))
    rng = np.random.default_rng(14)
    feeds = [{**{x: randn(rng, n, s, D) for x in "qkv"}, "bias": randn(rng, *(n if d == "N" else s if d == "S" else d
                                                                              for d in bias))}
             for n, s in ((8, 6), (3, 5))]
    assert_matches_ort(model, feeds, 1)


def test_nan_guard_of_the_weights_is_the_kernels_empty_row():
    """torch's exporter zeroes the NaN rows of the weights (those whose mask hides every key): what the
    kernel does for such a row. One row of each batch sees no key here."""
    rng = np.random.default_rng(12)
    feed = _decomposed_feed(rng)
    feed["keep"][:, :, 2] = False
    imported = assert_matches_ort(_decomposed(-np.inf, nan_guard=True), [feed], 1)
    assert np.all(imported.run(feed)[0][:, :, 2] == 0)


def test_inexact_match_is_left_to_tvm_and_reported():
    """where(keep, s, -10) gives a row with every key masked uniform weights: not what a mask does."""
    model = _decomposed(-10.0)
    imported = tvmattn.import_onnx(model)
    assert kernels_used(imported) == 0
    assert imported.report.left_to_tvm == ["Softmax_3"]
    fate, = imported.report.softmaxes  # the report says why, per Softmax node
    assert fate.node == "Softmax_3" and fate.kernel is None and "fill -10" in fate.reason
    assert "softmax Softmax_3: left to TVM: the mask's fill -10" in str(imported.report)
    feed = _decomposed_feed(np.random.default_rng(11))
    np.testing.assert_allclose(imported.run(feed)[0], ort_run(model, feed)[0], rtol=1e-5, atol=1e-5)


# ---- bad input: one TvmAttnError naming what is wrong; the CLI prints one line, exits 2 ------------------
def _simple_attention() -> onnx.ModelProto:
    node = oh.make_node("Attention", ["q", "k", "v"], ["y"], name="attn")
    return _model([node], [(n, TP.FLOAT, ["B", 2, 3, D]) for n in "qkv"], [("y", TP.FLOAT, ["B", 2, 3, D])])


def _cli_error(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_truncated_and_malformed_files(tmp_path, capsys):
    good = _simple_attention().SerializeToString()
    (tmp_path / "truncated.onnx").write_bytes(good[: len(good) // 2])
    (tmp_path / "garbage.onnx").write_bytes(b"\x08\x07not a protobuf\xff\xff\xff")
    (tmp_path / "empty.onnx").write_bytes(b"")
    for name in ("truncated.onnx", "garbage.onnx", "empty.onnx", "missing.onnx"):
        with pytest.raises(tvmattn.TvmAttnError):
            tvmattn.import_onnx(str(tmp_path / name))
        assert name in _cli_error(["import", str(tmp_path / name)], capsys)


def test_unsupported_op_names_the_node(tmp_path, capsys):
    model = _model([oh.make_node("FancyAttention", ["x"], ["y"], name="mystery", domain="my.ops")],
                   [("x", TP.FLOAT, [2, 3])], [("y", TP.FLOAT, [2, 3])], (("", 17), ("my.ops", 1)))
    with pytest.raises(tvmattn.TvmAttnError, match="'mystery'.*my.ops.FancyAttention.*not supported"):
        tvmattn.import_onnx(model)
    onnx.save(model, tmp_path / "m.onnx")
    assert "mystery" in _cli_error(["import", str(tmp_path / "m.onnx")], capsys)


def test_unsupported_attribute_value_names_the_node():
    node = oh.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "sl", "t"], ["y"], name="gqa",
                        domain="com.microsoft", num_heads=2, kv_num_heads=2, qk_output=1)
    model = _model([node], [("q", TP.FLOAT, [1, 3, 2 * D]), ("k", TP.FLOAT, [1, 3, 2 * D]),
                            ("v", TP.FLOAT, [1, 3, 2 * D]), ("sl", TP.INT32, [1]), ("t", TP.INT32, [])],
                   [("y", TP.FLOAT, [1, 3, 2 * D])], MS)
    with pytest.raises(tvmattn.TvmAttnError, match="'gqa'.*qk_output=1 is not supported"):
        tvmattn.import_onnx(model)


def test_contradicting_shapes_are_refused_and_data_propagation_is_not_the_judge():
    """A graph whose shapes contradict each other is one error; a sound one that ONNX's data propagation
    trips on (both branches of an If naming a tensor alike, as optimum's merged decoders do) loads."""
    from tvmattn.compiler.errors import TvmAttnError
    from tvmattn.compiler.onnx import graph

    bad = _model([oh.make_node("Add", ["a", "b"], ["y"])], [("a", TP.FLOAT, [2, 3]), ("b", TP.FLOAT, [4, 3])],
                 [("y", TP.FLOAT, [2, 3])])
    with pytest.raises(TvmAttnError, match="^the model's shapes or types are inconsistent"):
        graph.load(bad)

    def branch(name: str) -> onnx.GraphProto:
        return oh.make_graph([oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Identity", ["s"], [name])], name,
                             [], [oh.make_tensor_value_info(name, TP.INT64, [2])])

    node = oh.make_node("If", ["c"], ["y"], then_branch=branch("t"), else_branch=branch("e"))
    sound = _model([node], [("c", TP.BOOL, []), ("x", TP.FLOAT, ["B", 3])], [("y", TP.INT64, [2])])
    with pytest.raises(onnx.shape_inference.InferenceError, match="already exists"):
        onnx.shape_inference.infer_shapes(sound, check_type=True, strict_mode=True, data_prop=True)
    assert graph.load(sound).proto is sound


def test_shape_that_cannot_be_inferred_names_the_node():
    """Q sliced at bounds given at run time: its sizes are known only when the model runs, too late for
    the kernel's head count."""
    nodes = [oh.make_node("Slice", ["x", "start", "end"], ["q"]),
             oh.make_node("Attention", ["q", "k", "v"], ["y"], name="attn")]
    model = _model(nodes, [("x", TP.FLOAT, [2, 2, 3, D]), ("start", TP.INT64, [1]), ("end", TP.INT64, [1]),
                           ("k", TP.FLOAT, [2, 2, 3, D]), ("v", TP.FLOAT, [2, 2, 3, D])],
                   [("y", TP.FLOAT, [2, 2, 3, D])])
    with pytest.raises(tvmattn.TvmAttnError, match="'attn'.*head count is q_dim1, not a number"):
        tvmattn.import_onnx(model)


def test_run_with_missing_wrong_or_unknown_inputs():
    imported = tvmattn.import_onnx(_simple_attention())
    rng = np.random.default_rng(12)
    good = {n: randn(rng, 2, 2, 3, D) for n in "qkv"}
    with pytest.raises(tvmattn.TvmAttnError, match="missing input 'v'"):
        imported.run({"q": good["q"], "k": good["k"]})
    with pytest.raises(tvmattn.TvmAttnError, match="input 'k' has shape"):
        imported.run({**good, "k": randn(rng, 2, 2, 4, D)})
    with pytest.raises(tvmattn.TvmAttnError, match="takes float32"):
        imported.run({**good, "q": good["q"].astype(np.int64)})
    with pytest.raises(tvmattn.TvmAttnError, match="unknown input 'w'"):
        imported.run({**good, "w": good["q"]})
    assert imported.run(good)[0].shape == (2, 2, 3, D)


def test_inputs_cross_without_a_copy_and_no_output_is_an_input():
    """Inputs at an element offset or read-only are taken; an output on an input's memory (a Reshape
    of it, an Identity) is a copy, as ONNX Runtime's outputs are: changing the input later leaves it."""
    model = _model([oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Reshape", ["x", "s"], ["same"]),
                    oh.make_node("Identity", ["x"], ["also"]), oh.make_node("Relu", ["x"], ["relu"])],
                   [("x", TP.FLOAT, ["n", 3])], [("same", TP.FLOAT, ["n", 3]), ("also", TP.FLOAT, ["n", 3]),
                                                 ("relu", TP.FLOAT, ["n", 3])])
    imported = tvmattn.import_onnx(model)
    x = np.random.default_rng(3).standard_normal(13).astype(np.float32)[1:].reshape(4, 3)  # one element in
    readonly = x.copy()
    readonly.setflags(write=False)
    for feed in (x, readonly):
        outs = imported.run({"x": feed})
        want = [feed, feed, np.maximum(feed, 0)]
        assert all(np.array_equal(o, w) for o, w in zip(outs, want))
        assert not any(np.shares_memory(o, feed) for o in outs)



def test_a_shape_output_comes_back_as_onnx_runtime_gives_it():
    """A graph output written by Shape (TVM keeps it a shape value, not a tensor) is an int64 array."""
    model = _model([oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Relu", ["x"], ["r"])],
                   [("x", TP.FLOAT, ["n", 3])], [("s", TP.INT64, [2]), ("r", TP.FLOAT, ["n", 3])])
    x = np.random.default_rng(4).standard_normal((5, 3)).astype(np.float32)
    got, want = tvmattn.import_onnx(model).run({"x": x}), ort_run(model, {"x": x})
    assert [g.dtype for g in got] == [w.dtype for w in want]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))

# ---- CUDA: built here; run only where a GPU is ------------------------------------------------------------
def test_cuda_build_uses_the_kernel():
    imported = tvmattn.import_onnx(BUILDERS["gpt2"](), "cuda")
    assert imported.target.kind.name == "cuda"
    assert kernels_used(imported) == 1 and "flash" in imported.report.replacements[0].schedule


@pytest.mark.gpu
def test_cuda_run_matches_onnx_runtime():
    import tvm

    if not tvm.cuda(0).exist:
        pytest.skip("no CUDA device on this machine")
    model = BUILDERS["llama"]()
    feed = _feeds("llama", np.random.default_rng(13))[0]
    got = tvmattn.import_onnx(model, "cuda").run(feed)[0]
    np.testing.assert_allclose(got, ort_run(model, feed)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("halved, rows", [(False, 1), (True, 1), (False, 9000)])
def test_slice_past_a_table_is_a_clean_error(halved, rows):
    """A table of 8 positions sliced to the input's length (BERT's position ids), or to an expression of it
    (``halved``: seq // 2 + 1, as Wav2Vec2-Conformer's rotary table to its frames): within it the model
    matches ONNX Runtime; past it, one error naming the node (TVM's slice read past the table: a crash,
    or garbage where ONNX Runtime refuses the sizes). 9000 rows of them: a table the check had skipped
    (it copied the table; now it returns it in place)."""
    table = np.arange(8 * rows, dtype=np.float32).reshape(rows, 8)
    table = onnx.numpy_helper.from_array(table, "table")  # (rows, 8)
    length = [oh.make_node("Div", ["seq", "two"], ["half"]), oh.make_node("Add", ["half", "one"], ["end1"])]
    nodes = [oh.make_node("Shape", ["x"], ["shape"]),
             oh.make_node("Gather", ["shape", "one"], ["seq"], axis=0), *(length if halved else []),
             oh.make_node("Unsqueeze", ["end1" if halved else "seq", "zero"], ["end"]),
             oh.make_node("Slice", ["table", "start", "end", "axis"], ["positions"], name="positions"),
             oh.make_node("Mul", ["positions", "two_f"], ["out"])]
    consts = [onnx.numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
              (("one", 1), ("two", 2), ("zero", [0]), ("start", [0]), ("axis", [1]))]
    consts.append(onnx.numpy_helper.from_array(np.array(2, np.float32), "two_f"))
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [1, "seq"])],
                          [oh.make_tensor_value_info("out", TP.FLOAT, [rows, None])], [table, *consts])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    imported = tvmattn.import_onnx(model)
    x = randn(np.random.default_rng(0), 1, 5)
    np.testing.assert_allclose(imported.run({"x": x})[0], ort_run(model, {"x": x})[0], rtol=1e-6)
    with pytest.raises(tvmattn.TvmAttnError, match="node 'positions' \\(Slice\\): its end is past the 8 entries"):
        imported.run({"x": randn(np.random.default_rng(0), 1, 16 if halved else 9)})


def test_a_sum_with_a_trimmed_convolution_keeps_the_inputs_sizes():
    """h + conv(h)[:, :, :-1] for h of length L = S // 2 - 1 (Wav2Vec2's and WavLM's positional convolution,
    one position too long): TVM sizes the slice min(max(L, 0), L + 1) and could not prove it L, so the
    sum's size was one of the importer's making (``y_dim2``), and FuseTIR failed on WavLM's graph after
    it. The sum is L long."""
    rng = np.random.default_rng(15)
    nodes = [oh.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             oh.make_node("Conv", ["xt", "w"], ["h"], strides=[2], kernel_shape=[4]),  # (B, D, L)
             oh.make_node("Conv", ["h", "w"], ["c"], pads=[2, 2], kernel_shape=[4]),  # (B, D, L + 1)
             oh.make_node("Slice", ["c", "zero", "last", "two"], ["trimmed"]),
             oh.make_node("Add", ["h", "trimmed"], ["y"])]
    consts = [onnx.numpy_helper.from_array(v, n) for n, v in (("w", randn(rng, D, D, 4)), ("zero", np.array([0])),
                                                              ("last", np.array([-1])), ("two", np.array([2])))]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, ["B", "S", D])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, ["B", D, "L"])], consts)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    main = relax_module(model, host_target())["main"]
    sizes = {str(v) for b in main.body.blocks[0].bindings if isinstance(b.var.ty, relax.TensorType)
             for d in b.var.ty.shape.values for v in tirx.analysis.undefined_vars(d)}
    assert sizes == {"B", "S"}
    assert_matches_ort(model, [{"x": randn(rng, b, s, D)} for b, s in ((2, 19), (1, 12))], 0)


def test_a_size_stated_by_itself_is_refused_not_a_segfault():
    """A cast of min(4, n) to n defines n by itself: TVM 0.27's CanonicalizeBindings substitutes it into
    itself without end, a segfault when the model compiles. The importer avoids stating one
    (`test_onnx_ops.test_min_and_max_of_sizes`); where one is left, the import refuses it with a sentence."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.strided_slice(x, [0], [0], [tirx.min(4, n)], assume_inbound=True))
            out = bb.emit_output(bb.match_cast(y, relax.TensorType([n], "float32")))  # (n,): n is min(4, n)
        bb.emit_func_output(out)
    with pytest.raises(tvmattn.TvmAttnError, match="states its size n as T.min"):
        refuse_sizes_by_themselves(bb.get())


def test_slice_from_a_symbolic_start_to_the_end():
    """x[:, -seq:] with ONNX's INT64_MAX end (T5's position-bias slice): the last seq columns, all of x
    where seq is longer."""
    c = onnx.numpy_helper.from_array
    nodes = [oh.make_node("Shape", ["y"], ["shape"]), oh.make_node("Gather", ["shape", "one"], ["s"]),
             oh.make_node("Neg", ["s"], ["minus_s"]), oh.make_node("Unsqueeze", ["minus_s", "axes"], ["start"]),
             oh.make_node("Slice", ["x", "start", "end", "axis1"], ["out"])]
    model = _model(nodes, [("x", TP.FLOAT, ["B", "T"]), ("y", TP.FLOAT, ["B", "S"])], [("out", TP.FLOAT, ["B", None])],
                   (("", 17),))
    model.graph.initializer.extend([c(np.array([2**63 - 1], np.int64), "end"), c(np.array([0], np.int64), "axes"),
                                    c(np.array([1], np.int64), "axis1"), c(np.array(1, np.int64), "one")])
    rng = np.random.default_rng(4)
    assert_matches_ort(model, [{"x": randn(rng, 2, t), "y": randn(rng, 2, s)} for t, s in ((7, 3), (4, 6))], 0)


def test_gather_of_a_shape_by_constant_indices():
    """Gather(Shape(y), perm), ONNX Runtime's transpose optimizer's Shape(Transpose(y)) (#44): the picked
    sizes stay a shape (x[:, -S:] from them, as the slice above); an index past the shape is one error
    naming it, from the folding of static shapes and from the converter's shape fix alike."""
    c = onnx.numpy_helper.from_array
    nodes = [oh.make_node("Shape", ["y"], ["shape"]), oh.make_node("Gather", ["shape", "perm"], ["swapped"], axis=0),
             oh.make_node("Gather", ["swapped", "first"], ["s"]), oh.make_node("Neg", ["s"], ["minus_s"]),
             oh.make_node("Unsqueeze", ["minus_s", "zero"], ["start"]),
             oh.make_node("Slice", ["x", "start", "end", "one"], ["out"])]
    model = _model(nodes, [("x", TP.FLOAT, ["B", "T"]), ("y", TP.FLOAT, ["B", "S"])], [("out", TP.FLOAT, ["B", None])],
                   (("", 17),))
    model.graph.initializer.extend([c(np.array([1, 0], np.int64), "perm"), c(np.array([2**63 - 1], np.int64), "end"),
                                    c(np.array([0], np.int64), "zero"), c(np.array([1], np.int64), "one"),
                                    c(np.array(0, np.int64), "first")])
    rng = np.random.default_rng(5)
    assert_matches_ort(model, [{"x": randn(rng, 2, t), "y": randn(rng, 2, s)} for t, s in ((7, 3), (4, 6))], 0)
    model.graph.initializer[0].CopyFrom(c(np.array([1, -3], np.int64), "perm"))
    with pytest.raises(tvmattn.TvmAttnError, match="Gather.*index -3 is out of range: axis 0 \\(a shape\\) has 2"):
        tvmattn.import_onnx(model)
    from tvm import relax, tirx

    from tvmattn.compiler.onnx import shape_ops
    b, s = tirx.Var("B", "int64"), tirx.Var("S", "int64")
    picked = shape_ops.gather([relax.ShapeExpr([b, s]), relax.const(np.array([1, -2, 1]))])
    assert [v.same_as(w) for v, w in zip(picked.values, (s, b, s))] == [True] * 3
    with pytest.raises(tvmattn.TvmAttnError, match="index 2 is out of range"):
        shape_ops.gather([relax.ShapeExpr([b, s]), relax.const(np.array([0, 2]))])


@pytest.mark.parametrize("start,limit,step", [("s", "zero", "minus_one"), ("one", "s", "two"), ("zero", "s", "one")])
def test_range_of_symbolic_bounds(start, limit, step):
    """Range with a bound of shape arithmetic (the sequence length): counting down, by two, from zero."""
    c = onnx.numpy_helper.from_array
    nodes = [oh.make_node("Shape", ["y"], ["shape"], start=1, end=2), oh.make_node("Squeeze", ["shape"], ["s"]),
             oh.make_node("Range", [start, limit, step], ["r"]), oh.make_node("Cast", ["r"], ["rf"], to=TP.FLOAT),
             oh.make_node("Unsqueeze", ["rf", "axes"], ["row"]), oh.make_node("Add", ["row", "y"], ["out"])]
    width = {"minus_one": "S", "two": None, "one": "S"}[step]
    model = _model(nodes, [("y", TP.FLOAT, ["B", "S"])], [("out", TP.FLOAT, ["B", width])], (("", 17),))
    model.graph.initializer.extend([c(np.array(v, np.int64), n) for n, v in
                                    (("zero", 0), ("one", 1), ("two", 2), ("minus_one", -1))] +
                                   [c(np.array([0], np.int64), "axes")])
    rng = np.random.default_rng(6)
    if step == "two":  # (S - 1) / 2 columns: only odd lengths broadcast against y; its own output
        model.graph.node[-1].CopyFrom(oh.make_node("Identity", ["row"], ["out"]))
        model.graph.output[0].CopyFrom(oh.make_tensor_value_info("out", TP.FLOAT, [1, None]))
    assert_matches_ort(model, [{"y": randn(rng, 2, s)} for s in (5, 8)], 0)


def test_a_computation_the_graph_repeats_runs_once():
    """Two nodes of the same op on the same inputs (T5's exporter adds the position bias to the mask in
    every attention): computed once, both consumers read it."""
    rng = np.random.default_rng(0)
    nodes = [oh.make_node("Add", ["x", "m"], ["s1"]), oh.make_node("Add", ["x", "m"], ["s2"]),
             oh.make_node("MatMul", ["s1", "w1"], ["y1"]), oh.make_node("MatMul", ["s2", "w2"], ["y2"])]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, ["n", 16]),
                                       oh.make_tensor_value_info("m", TP.FLOAT, [1, 16])],
                          [oh.make_tensor_value_info("y1", TP.FLOAT, ["n", 8]),
                           oh.make_tensor_value_info("y2", TP.FLOAT, ["n", 8])],
                          [onnx.numpy_helper.from_array(randn(rng, 16, 8), name) for name in ("w1", "w2")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    feed = {"x": randn(rng, 5, 16), "m": randn(rng, 1, 16)}
    imported = assert_matches_ort(model, [feed], attentions=0)
    calls = {f.name: f.calls for f in imported.profile(feed).functions}
    assert calls["add"] == 1 and calls["matmul1"] == 2
