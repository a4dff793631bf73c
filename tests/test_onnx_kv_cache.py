"""Decoders with a KV cache as their exporters write them, and ONNX Runtime's cache-attention ops.

Hugging Face GPT-2 and Llama (random weights from a config) exported with their cache ("with past":
past_key_{i}/past_value_{i} in, present_key_{i}/present_value_{i} out) by torch's dynamo and TorchScript
exporters, imported once with the cache (or prompt) length symbolic and run at two lengths: every
Softmax on a tvmattn kernel, the decode step on the one-query kernel (bottom-right causal, proved from
the mask's position arithmetic), logits and presents as ONNX Runtime computes them.

com.microsoft.GroupQueryAttention with per-sequence lengths and rotary embedding, and
MultiHeadAttention with packed QKV / KV, against ONNX Runtime.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx_testing import assert_matches_ort, ort_run, randn

import tvmattn
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx.patterns import NOT_ATTENTION

pytest.importorskip("transformers")
hd = pytest.importorskip("tvmattn.models.hf_decoders")

CASES = [  # family, exporter, decode (with past) or prefill
    ("gpt2", "torchscript", True), ("gpt2", "dynamo", True), ("gpt2", "torchscript", False),
    ("llama", "torchscript", True),
    pytest.param("gpt2", "dynamo", False, marks=pytest.mark.slow),
    pytest.param("llama", "dynamo", True, marks=pytest.mark.slow),
    pytest.param("llama", "dynamo", False, marks=pytest.mark.slow),
    pytest.param("llama", "torchscript", False, marks=pytest.mark.slow),
]


@functools.cache
def _decoder(family: str):
    return hd.decoder(family)


@functools.cache
def _exported(family: str, exporter: str, past: bool) -> onnx.ModelProto:
    return hd.export(_decoder(family), exporter, past=past)


@pytest.mark.parametrize("family,exporter,past", CASES)
def test_hf_decoder_matches_onnx_runtime(family, exporter, past):
    model, exported = _decoder(family), _exported(family, exporter, past)
    rng = np.random.default_rng(0)
    inputs, _ = hd.names(model, past)
    feeds = []
    for length in (4, 9):  # the cache length (decode) or the prompt length (prefill): one import serves both
        feed = {"input_ids": rng.integers(0, hd.VOCAB, (1, 1 if past else length)).astype(np.int64)}
        feeds.append(feed | {name: randn(rng, *hd.cache_shape(model, length)) for name in inputs[1:]})
    layers = model.config.num_hidden_layers
    imported = assert_matches_ort(exported, feeds, attentions=layers, softmaxes=layers)  # presents too
    assert len(imported.run(feeds[0])) == 1 + 2 * layers
    for r in imported.report.replacements:
        spec = r.spec
        assert spec.causal and spec.attn_mask is None, spec.describe()  # no mask read: the causal rule
        assert isinstance(spec.kv_seq_len, str)  # symbolic
        if past:  # the decode kernel: one query against the cache and itself
            assert (spec.seq_len, spec.causal_align) == (1, "bottom_right")
        else:
            assert spec.seq_len == spec.kv_seq_len and spec.causal_align == "top_left"
        if family == "llama":
            assert (spec.h, spec.h_kv) == (4, 2)
    if past:  # each cache extended once, for the kernel and the present output alike
        functions = imported.profile(imported.declared(feeds[0]), runs=1).functions
        assert sum(f.calls for f in functions if f.name.startswith("concatenate")) == 2 * layers



@functools.cache
def _exported_with_mask(family: str, exporter: str) -> onnx.ModelProto:
    return hd.export(_decoder(family), exporter, past=True, batch=2, attention_mask=True)


@pytest.mark.parametrize("family,exporter", [
    ("gpt2", "torchscript"), pytest.param("gpt2", "dynamo", marks=pytest.mark.slow),
    pytest.param("llama", "torchscript", marks=pytest.mark.slow),
    pytest.param("llama", "dynamo", marks=pytest.mark.slow)])
def test_hf_decoder_batch_with_left_padding(family, exporter):
    """A batch of two decode steps, the second sequence left-padded (attention_mask 0 on its first
    keys): the mask goes to the kernel as an additive (B, n_kv) mask."""
    model, exported = _decoder(family), _exported_with_mask(family, exporter)
    rng = np.random.default_rng(1)
    inputs, _ = hd.names(model, True, attention_mask=True)
    feeds = []
    for length, padding in ((6, 3), (2, 1)):  # one import, two cache lengths
        feed = {"input_ids": rng.integers(0, hd.VOCAB, (2, 1)).astype(np.int64),
                "attention_mask": np.ones((2, length + 1), np.int64)}
        feed["attention_mask"][1, :padding] = 0
        feeds.append(feed | {name: randn(rng, *hd.cache_shape(model, length, 2)) for name in inputs[2:]})
    layers = model.config.num_hidden_layers
    imported = assert_matches_ort(exported, feeds, layers, softmaxes=layers)
    spec = imported.report.replacements[0].spec
    assert (spec.batch, spec.seq_len, spec.attn_mask, spec.attn_mask_dims) == (2, 1, "additive", "bt")


def test_report_says_why_a_softmax_is_not_attention():
    node = oh.make_node("Softmax", ["x"], ["y"], axis=-1, name="classifier")
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("x", TP.FLOAT, ["B", 10])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, ["B", 10])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 10
    fate, = tvmattn.import_onnx(model).report.softmaxes
    assert (fate.node, fate.kernel, fate.reason) == ("classifier", None, NOT_ATTENTION)


def test_report_lists_the_softmaxes_inside_subgraphs():
    """optimum's merged decoder keeps both decoders in the branches of an If: their Softmaxes are the
    graph's too. Each branch here is decomposed attention, the else branch with a fill of -10 (no mask)."""
    def branch(name: str, fill: float) -> onnx.GraphProto:
        nodes = [oh.make_node("Transpose", ["k"], [f"{name}_kt"], perm=[0, 1, 3, 2]),
                 oh.make_node("MatMul", ["q", f"{name}_kt"], [f"{name}_s"]),
                 oh.make_node("Where", ["keep", f"{name}_s", f"{name}_fill"], [f"{name}_m"]),
                 oh.make_node("Softmax", [f"{name}_m"], [f"{name}_p"], axis=-1, name=f"{name}_softmax"),
                 oh.make_node("MatMul", [f"{name}_p", "v"], [f"{name}_y"])]
        return oh.make_graph(nodes, name, [], [oh.make_tensor_value_info(f"{name}_y", TP.FLOAT, [1, 2, 4, 8])],
                             [onnx.numpy_helper.from_array(np.float32(fill), f"{name}_fill")])

    node = oh.make_node("If", ["c"], ["y"], then_branch=branch("then", -np.inf), else_branch=branch("else", -10.0))
    inputs = [("c", TP.BOOL, []), ("keep", TP.BOOL, [1, 1, 4, 4])] + [(n, TP.FLOAT, [1, 2, 4, 8]) for n in "qkv"]
    model = _model([node], inputs, [("y", TP.FLOAT, [1, 2, 4, 8])], (("", 17),))
    rng = np.random.default_rng(5)
    feeds = [{"c": np.array(c), "keep": np.tri(4, dtype=bool)[None, None],
              **{n: randn(rng, 1, 2, 4, 8) for n in "qkv"}} for c in (True, False)]
    imported = tvmattn.import_onnx(model)
    for feed in feeds:
        np.testing.assert_allclose(imported.run(feed)[0], ort_run(model, feed)[0], rtol=1e-4, atol=1e-5)
    fates = {f.node: f for f in imported.report.softmaxes}
    assert fates["then_softmax"].kernel and not fates["else_softmax"].kernel, str(imported.report)
    assert "fill -10" in fates["else_softmax"].reason


# ---- com.microsoft.GroupQueryAttention: per-sequence lengths, rotary ---------------------------------------
H, H_KV, MAX_POS = 4, 2, 64
MS = (("", 17), ("com.microsoft", 1))


def _model(nodes, inputs, outputs, opsets=MS) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info(*i) for i in inputs],
                          [oh.make_tensor_value_info(*o) for o in outputs])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 10
    return model


def _gqa(d: int, past: bool, rotary: str | None, rotary_dim: int) -> onnx.ModelProto:
    names = ["q", "k", "v"] + (["pk", "pv"] if past else ["", ""]) + ["sl", "tot"]
    names += ["cos", "sin"] if rotary else []
    node = oh.make_node("GroupQueryAttention", names, ["y", "present_k", "present_v"], domain="com.microsoft",
                        num_heads=H, kv_num_heads=H_KV, do_rotary=int(rotary is not None),
                        rotary_interleaved=int(rotary == "interleaved"))
    inputs = [("q", TP.FLOAT, ["B", "S", H * d]), ("k", TP.FLOAT, ["B", "S", H_KV * d]),
              ("v", TP.FLOAT, ["B", "S", H_KV * d])]
    inputs += [(n, TP.FLOAT, ["B", H_KV, "P", d]) for n in ("pk", "pv")] if past else []
    inputs += [("sl", TP.INT32, ["B"]), ("tot", TP.INT32, [])]
    inputs += [(n, TP.FLOAT, [MAX_POS, rotary_dim // 2]) for n in ("cos", "sin")] if rotary else []
    return _model([node], inputs, [("y", TP.FLOAT, ["B", "S", H * d]), ("present_k", TP.FLOAT, ["B", H_KV, "T", d]),
                                   ("present_v", TP.FLOAT, ["B", H_KV, "T", d])])


def _gqa_feed(rng, d: int, batch: int, seq: int, past: int, seqlens: list[int], rotary_dim: int) -> dict:
    feed = {"q": randn(rng, batch, seq, H * d), "k": randn(rng, batch, seq, H_KV * d),
            "v": randn(rng, batch, seq, H_KV * d), "sl": np.array(seqlens, np.int32),
            "tot": np.array(past + seq, np.int32)}
    if past:
        feed["pk"], feed["pv"] = randn(rng, batch, H_KV, past, d), randn(rng, batch, H_KV, past, d)
    angles = np.arange(MAX_POS)[:, None] / 10000 ** (np.arange(rotary_dim // 2) / (rotary_dim // 2))
    feed["cos"], feed["sin"] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return feed


@pytest.mark.parametrize("rotary,d,rotary_dim", [  # (32, 16): only part of each head rotates
    ("half", 16, 16), ("interleaved", 32, 16), pytest.param(None, 16, 16, marks=pytest.mark.slow),
    pytest.param("interleaved", 16, 16, marks=pytest.mark.slow), pytest.param("half", 32, 16, marks=pytest.mark.slow)])
def test_ms_group_query_attention_per_sequence_lengths_and_rotary(rotary, d, rotary_dim):
    """A batch whose sequences have different lengths in one cache buffer: each sequence's new keys go
    right after its own past (present matches ORT's, zeros after), its queries sit there (bottom-right
    at its own length); rotary at those positions. ORT takes S > 1 after a cache only at batch 1."""
    rng = np.random.default_rng(3)
    # decode: sequence 1 has 3 of the buffer's 5 past rows; a chunk of 2 after 5 of 6; the full buffer
    decode = [_gqa_feed(rng, d, 2, 1, 5, [5, 3], rotary_dim), _gqa_feed(rng, d, 1, 2, 6, [6], rotary_dim),
              _gqa_feed(rng, d, 2, 1, 7, [7, 7], rotary_dim)]
    imported = assert_matches_ort(_gqa(d, True, rotary, rotary_dim), [_select(f, True, rotary) for f in decode], 1)
    spec = imported.report.replacements[0].spec
    assert spec.key_padding and spec.causal and spec.causal_align == "bottom_right" and spec.h_kv == H_KV
    # a prompt with right padding: keys past seqlens_k[b] are padding
    prompts = [_gqa_feed(rng, d, 2, 4, 0, [3, 1], rotary_dim), _gqa_feed(rng, d, 1, 3, 0, [2], rotary_dim)]
    spec = assert_matches_ort(_gqa(d, False, rotary, rotary_dim), [_select(f, False, rotary) for f in prompts],
                              1).report.replacements[0].spec
    assert spec.key_padding and spec.causal and spec.causal_align == "top_left"


def _select(feed: dict, past: bool, rotary: str | None) -> dict:
    return {k: v for k, v in feed.items() if (past or k not in ("pk", "pv")) and (rotary or k not in ("cos", "sin"))}


def test_ms_group_query_attention_rotary_needs_its_caches():
    node = oh.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "sl", "tot"], ["y"], domain="com.microsoft",
                        num_heads=H, kv_num_heads=H_KV, do_rotary=1, name="gqa")
    model = _model([node], [("q", TP.FLOAT, [1, 2, H * 16]), ("k", TP.FLOAT, [1, 2, H_KV * 16]),
                            ("v", TP.FLOAT, [1, 2, H_KV * 16]), ("sl", TP.INT32, [1]), ("tot", TP.INT32, [])],
                   [("y", TP.FLOAT, [1, 2, H * 16])])
    with pytest.raises(TvmAttnError, match="^node 'gqa' .*do_rotary=1 needs the cos_cache and sin_cache"):
        tvmattn.import_onnx(model)


# ---- com.microsoft.MultiHeadAttention: packed QKV / KV --------------------------------------------------
D = 16


def _mha(packing: str, past: bool, causal: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The packed model and the same attention with Q, K, V apart (ONNX Runtime's CPU kernel has no
    packed layouts: the unpacked model is the reference)."""
    cache_in = ["", "", "", "pk", "pv"] if past else []
    cache = [(n, TP.FLOAT, ["B", H, "P", D]) for n in ("pk", "pv")] if past else []
    outs = [("y", TP.FLOAT, ["B", "S", H * D])] + ([(n, TP.FLOAT, ["B", H, "T", D]) for n in ("prk", "prv")]
                                                   if past else [])
    out_names = [o[0] for o in outs]
    attrs = dict(domain="com.microsoft", num_heads=H, unidirectional=causal)
    kv_len = "S" if packing == "qkv" else "L"
    if packing == "qkv":
        packed = _model([oh.make_node("MultiHeadAttention", ["qkv", "", ""] + cache_in, out_names, **attrs)],
                        [("qkv", TP.FLOAT, ["B", "S", H, 3, D])] + cache, outs)
    else:
        packed = _model([oh.make_node("MultiHeadAttention", ["q", "kv", ""] + cache_in, out_names, **attrs)],
                        [("q", TP.FLOAT, ["B", "S", H * D]), ("kv", TP.FLOAT, ["B", "L", H, 2, D])] + cache, outs)
    apart = _model([oh.make_node("MultiHeadAttention", ["q", "k", "v"] + cache_in, out_names, **attrs)],
                   [("q", TP.FLOAT, ["B", "S", H * D]), ("k", TP.FLOAT, ["B", kv_len, H * D]),
                    ("v", TP.FLOAT, ["B", kv_len, H * D])] + cache, outs)
    return packed, apart


@pytest.mark.parametrize("packing,past,causal", [
    ("qkv", False, 1), ("qkv", True, 1), ("kv", True, 0),
    pytest.param("qkv", False, 0, marks=pytest.mark.slow), pytest.param("kv", False, 0, marks=pytest.mark.slow)])
def test_ms_multi_head_attention_packed(packing, past, causal):
    packed, apart = _mha(packing, past, causal)
    imported = tvmattn.import_onnx(packed)
    assert len(imported.report.replacements) == 1
    rng = np.random.default_rng(4)
    for batch, seq, kv_len, past_len in ((2, 3, 5, 4), (1, 1, 6, 7)):
        feed = {"pk": randn(rng, batch, H, past_len, D), "pv": randn(rng, batch, H, past_len, D)} if past else {}
        if packing == "qkv":
            qkv = randn(rng, batch, seq, H, 3, D)
            feed_packed = {"qkv": qkv, **feed}
            q, k, v = (qkv[:, :, :, i].reshape(batch, seq, H * D) for i in range(3))
        else:
            q, kv = randn(rng, batch, seq, H * D), randn(rng, batch, kv_len, H, 2, D)
            feed_packed = {"q": q, "kv": kv, **feed}
            k, v = (kv[:, :, :, i].reshape(batch, kv_len, H * D) for i in range(2))
        want = ort_run(apart, {"q": q, "k": k, "v": v, **feed})
        for got, ref in zip(imported.run(feed_packed), want, strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_generate_script_tokens_equal_onnx_runtime(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "scripts" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate", path)
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert generate.main(["--tokens", "3", "--prompt", "5"]) == 0
    assert "(equal;" in capsys.readouterr().out


def test_ms_group_query_attention_constant_total_beyond_the_cache_is_refused():
    """A constant total_sequence_length neither past + S (a growing cache) nor within the past buffer (one
    past and present share)."""
    node = oh.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tot"], ["y"], name="gqa",
                        domain="com.microsoft", num_heads=H, kv_num_heads=H_KV)
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info(*i) for i in (
        ("q", TP.FLOAT, [1, 1, H * 16]), ("k", TP.FLOAT, [1, 1, H_KV * 16]), ("v", TP.FLOAT, [1, 1, H_KV * 16]),
        ("pk", TP.FLOAT, [1, H_KV, 8, 16]), ("pv", TP.FLOAT, [1, H_KV, 8, 16]), ("sl", TP.INT32, [1]))],
        [oh.make_tensor_value_info("y", TP.FLOAT, [1, 1, H * 16])],
        [onnx.numpy_helper.from_array(np.array(12, np.int32), "tot")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid(d, v) for d, v in MS])
    model.ir_version = 10
    with pytest.raises(TvmAttnError, match="^node 'gqa' .*total_sequence_length is 12: neither the past length 8"):
        tvmattn.import_onnx(model)


@pytest.mark.parametrize("rotary,sink", [(None, False), ("half", True)])
def test_ms_group_query_attention_decode_over_a_shared_buffer_runs_on_the_paged_kernel(rotary, sink):
    """ORT GenAI's decode step: one token a sequence into a buffer past and present share (static rows),
    sequences of their own lengths (seqlens_k), GQA: the paged decode kernel reads the buffer as pages
    (its work split follows each sequence's length); outputs and presents as ORT computes them,
    including a first prompt of one token (total_sequence_length 1) and a sequence filling the buffer."""
    d, rows = 16, 40
    names = ["q", "k", "v", "pk", "pv", "sl", "tot"] + (["cos", "sin"] if rotary else ["", ""]) + \
        (["", "", "sink"] if sink else [])
    node = oh.make_node("GroupQueryAttention", names, ["y", "present_k", "present_v"], domain="com.microsoft",
                        num_heads=H, kv_num_heads=H_KV, do_rotary=int(rotary is not None))
    inputs = [("q", TP.FLOAT, ["B", 1, H * d]), ("k", TP.FLOAT, ["B", 1, H_KV * d]),
              ("v", TP.FLOAT, ["B", 1, H_KV * d])] + [(n, TP.FLOAT, ["B", H_KV, rows, d]) for n in ("pk", "pv")]
    inputs += [("sl", TP.INT32, ["B"]), ("tot", TP.INT32, [])]
    inputs += [(n, TP.FLOAT, [MAX_POS, d // 2]) for n in ("cos", "sin")] if rotary else []
    inputs += [("sink", TP.FLOAT, [H])] if sink else []
    model = _model([node], inputs, [("y", TP.FLOAT, ["B", 1, H * d]),
                                    ("present_k", TP.FLOAT, ["B", H_KV, rows, d]),
                                    ("present_v", TP.FLOAT, ["B", H_KV, rows, d])])
    rng = np.random.default_rng(5)

    def feed(seqlens: list[int], total: int) -> dict:
        f = _gqa_feed(rng, d, len(seqlens), 1, rows, seqlens, d)
        f["tot"] = np.array(total, np.int32)
        f = _select(f, True, rotary)
        return f | ({"sink": randn(rng, H)} if sink else {})

    imported = assert_matches_ort(model, [feed([5, 39, 0], 40), feed([17, 3], 18), feed([0, 0], 1)], 1)
    assert [type(r.spec).__name__ for r in imported.report.replacements] == ["PagedSpec"]
    assert "40-row buffers read as pages" in imported.report.replacements[0].schedule
    # the new rows go into the past buffer itself (present is past), the arrays a decode loop passes
    assert imported.report.in_place == {"present_k": "pk", "present_v": "pv"}
    f = feed([5, 2], 6)
    assert imported.run(f)[1] is f["pk"] and np.abs(f["pk"][:, :, 7:]).max() == 0


def test_ms_group_query_attention_undeclared_shared_buffer_is_refused_at_run_time():
    """Without a constant total_sequence_length or a declared present_key length, the cache is taken to grow
    (present = past + S); a feed that uses the past as a shared buffer (total ≤ its rows) is then refused,
    saying how to declare one."""
    node = oh.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tot"], ["y", "pres_k", "pres_v"],
                        name="gqa", domain="com.microsoft", num_heads=H, kv_num_heads=H_KV)
    model = _model([node], [("q", TP.FLOAT, [1, 1, H * 16]), ("k", TP.FLOAT, [1, 1, H_KV * 16]),
                            ("v", TP.FLOAT, [1, 1, H_KV * 16]), ("pk", TP.FLOAT, [1, H_KV, 8, 16]),
                            ("pv", TP.FLOAT, [1, H_KV, 8, 16]), ("sl", TP.INT32, [1]), ("tot", TP.INT32, [1])],
                   [("y", TP.FLOAT, [1, 1, H * 16])] + [(n, TP.FLOAT, [None] * 4) for n in ("pres_k", "pres_v")])
    rng = np.random.default_rng(6)
    feed = {"q": randn(rng, 1, 1, H * 16), "k": randn(rng, 1, 1, H_KV * 16), "v": randn(rng, 1, 1, H_KV * 16),
            "pk": randn(rng, 1, H_KV, 8, 16), "pv": randn(rng, 1, H_KV, 8, 16), "sl": np.array([4], np.int32)}
    imported = tvmattn.import_onnx(model)
    assert imported.run(feed | {"tot": np.array([9], np.int32)})[1].shape == (1, H_KV, 9, 16)  # past + S
    with pytest.raises(TvmAttnError, match="'gqa'.*total_sequence_length.*declares present_key with past_key's"):
        imported.run(feed | {"tot": np.array([5], np.int32)})
