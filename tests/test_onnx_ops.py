"""The operators real exports contain that TVM's importer lacks (compiler/onnx/ops.py), one graph per op
and attribute case, against ONNX Runtime at two shapes with symbolic batch and sequence; binding input
shapes (``shapes=``, ``--shape``); models saved with external data.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto as TP
from onnx_testing import assert_matches_ort, ort_run, randn

import tvmattn
from tvmattn.compiler.cli import main

H, HEADS, D = 16, 2, 8  # hidden size, heads, head size
MS = (("", 17), ("com.microsoft", 1))
SHAPES = [(1, 3), (2, 5)]  # (batch, seq) at which each model runs


def _model(node: onnx.NodeProto | list, inputs, outputs, initializers=(), opsets=MS) -> onnx.ModelProto:
    """One node's model (or a list of nodes'); ``outputs`` are (name, dtype, rank): shape inference sizes them."""
    nodes = [node] if isinstance(node, onnx.NodeProto) else node
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info(*i) for i in inputs],
                          [oh.make_tensor_value_info(name, dtype, [None] * rank) for name, dtype, rank in outputs],
                          [onnx.numpy_helper.from_array(a, n) for n, a in initializers])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 10
    return model


def _feeds(model: onnx.ModelProto, make) -> list[dict[str, np.ndarray]]:
    return [make(np.random.default_rng(b * 10 + n), b, n) for b, n in SHAPES]


def _hidden(rng, b, n, *names):
    return {name: randn(rng, b, n, H) for name in names}


GAMMA, BETA, BIAS = (np.random.default_rng(i).standard_normal(H).astype(np.float32) for i in range(3))
X3 = ("x", TP.FLOAT, ["b", "n", H])


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("simplified", [False, True])
def test_skip_layer_normalization(simplified, with_bias):
    """Output 0 and the residual sum (output 3, which the next SkipLayerNormalization reads)."""
    op = "SkipSimplifiedLayerNormalization" if simplified else "SkipLayerNormalization"
    weights = [("gamma", GAMMA)] + ([] if simplified else [("beta", BETA)])
    ins = ["x", "skip"] + [n for n, _ in weights] + (["bias"] if with_bias else [])
    node = oh.make_node(op, ins, ["y", "", "", "sum"], domain="com.microsoft", epsilon=1e-5)
    model = _model(node, [X3, ("skip", TP.FLOAT, ["b", "n", H])], [("y", TP.FLOAT, 3), ("sum", TP.FLOAT, 3)],
                   weights + ([("bias", BIAS)] if with_bias else []))
    assert_matches_ort(model, _feeds(model, lambda r, b, n: _hidden(r, b, n, "x", "skip")), attentions=0)


@pytest.mark.parametrize("op, opset", [("SimplifiedLayerNormalization", 17), ("RMSNormalization", 23)])
def test_rms_normalization(op, opset):
    """Both in the ONNX domain: ONNX Runtime registers its SimplifiedLayerNormalization there."""
    node = oh.make_node(op, ["x", "gamma"], ["y"], epsilon=1e-6)
    model = _model(node, [X3], [("y", TP.FLOAT, 3)], [("gamma", GAMMA)], (("", opset),))
    assert_matches_ort(model, _feeds(model, lambda r, b, n: _hidden(r, b, n, "x")), attentions=0)


@pytest.mark.parametrize("square", ["Pow", "Mul"])
def test_decomposed_rms_norm_is_one_function(square):
    """RMSNorm as PyTorch exports it, x / sqrt(mean(x², -1) + eps) · γ, with x² a Pow or a Mul: one
    function (the mean of squares a single reduction, `ops.powers`), no x² written on its own."""
    nodes = [oh.make_node("Pow", ["x", "two"], ["sq"]) if square == "Pow" else oh.make_node("Mul", ["x", "x"], ["sq"]),
             oh.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
             oh.make_node("Add", ["ms", "eps"], ["v"]), oh.make_node("Sqrt", ["v"], ["rms"]),
             oh.make_node("Div", ["x", "rms"], ["xn"]),
             oh.make_node("Mul", ["xn", "gamma"], ["y"])]
    constants = [("two", np.array(2.0, np.float32)), ("eps", np.array(1e-6, np.float32)), ("gamma", GAMMA)]
    model = _model(nodes, [X3], [("y", TP.FLOAT, 3)], constants, (("", 17),))
    imported = assert_matches_ort(model, _feeds(model, lambda r, b, n: _hidden(r, b, n, "x")), attentions=0)
    assert len(imported.report.rule_of) == 1 and "mean_of_squares" in next(iter(imported.report.rule_of)), \
        imported.report.rule_of


@pytest.mark.parametrize("segments", [False, True])
def test_embed_layer_normalization(segments):
    """BERT's embeddings with a padding mask: the output, mask_index (valid keys per sequence) and the sum."""
    rng = np.random.default_rng(7)
    tables = [("word", randn(rng, 30, H)), ("position", randn(rng, 16, H))] + \
        ([("segment", randn(rng, 2, H))] if segments else [])
    ins = ["ids", "segment_ids" if segments else "", "word", "position", "segment" if segments else "",
           "gamma", "beta", "mask"]
    node = oh.make_node("EmbedLayerNormalization", ins, ["y", "mask_index", "sum"], domain="com.microsoft",
                        epsilon=1e-12)
    ids = [("ids", TP.INT32, ["b", "n"]), ("mask", TP.INT32, ["b", "n"])] + \
        ([("segment_ids", TP.INT32, ["b", "n"])] if segments else [])
    model = _model(node, ids, [("y", TP.FLOAT, 3), ("mask_index", TP.INT32, 1), ("sum", TP.FLOAT, 3)],
                   tables + [("gamma", GAMMA), ("beta", BETA)])

    def feed(r, b, n):
        mask = np.ones((b, n), np.int32)
        mask[0, n - 1:] = 0
        out = {"ids": r.integers(0, 30, (b, n)).astype(np.int32), "mask": mask}
        return out | ({"segment_ids": r.integers(0, 2, (b, n)).astype(np.int32)} if segments else {})

    assert_matches_ort(model, _feeds(model, feed), attentions=0)


@pytest.mark.parametrize("op, bias, attrs", [("Gelu", False, {}), ("BiasGelu", True, {}), ("FastGelu", True, {}),
                                             ("QuickGelu", False, {"alpha": 1.5})])
def test_gelus(op, bias, attrs):
    node = oh.make_node(op, ["x"] + (["bias"] if bias else []), ["y"], domain="com.microsoft", **attrs)
    model = _model(node, [X3], [("y", TP.FLOAT, 3)], [("bias", BIAS)] if bias else [])
    assert_matches_ort(model, _feeds(model, lambda r, b, n: {"x": 3 * randn(r, b, n, H)}), attentions=0)


def _caches(positions: int, rotary: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(positions)[:, None] / 10000 ** (np.arange(rotary // 2)[None, :] * 2 / rotary)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# rotary_embedding_dim 0: the whole head; 4 of 8: the rest passes through
@pytest.mark.parametrize("rank, rotary_dim, interleaved", [(4, 0, 0), (4, 4, 1), (3, 0, 1), (3, 4, 0)])
def test_onnx_rotary_embedding(rank, rotary_dim, interleaved):
    """Opset 23, caches indexed by position_ids (as the dynamo exporter writes it with position ids)."""
    cos, sin = _caches(16, rotary_dim or D)
    x = ("x", TP.FLOAT, ["b", HEADS, "n", D] if rank == 4 else ["b", "n", HEADS * D])
    node = oh.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], interleaved=interleaved,
                        rotary_embedding_dim=rotary_dim, **({"num_heads": HEADS} if rank == 3 else {}))
    model = _model(node, [x, ("pos", TP.INT64, ["b", "n"])], [("y", TP.FLOAT, rank)], [("cos", cos), ("sin", sin)],
                   (("", 23),))

    def feed(r, b, n):
        shape = (b, HEADS, n, D) if rank == 4 else (b, n, HEADS * D)
        return {"x": randn(r, *shape), "pos": r.integers(0, 16, (b, n))}

    assert_matches_ort(model, _feeds(model, feed), attentions=0)


@pytest.mark.parametrize("offset", [False, True])  # position_ids (B, S), or (1,): the first position
@pytest.mark.parametrize("interleaved", [0, 1])
def test_ms_rotary_embedding(interleaved, offset):
    cos, sin = _caches(16, D)
    node = oh.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain="com.microsoft",
                        interleaved=interleaved, num_heads=HEADS)
    pos = ("pos", TP.INT64, [1] if offset else ["b", "n"])
    model = _model(node, [("x", TP.FLOAT, ["b", "n", HEADS * D]), pos], [("y", TP.FLOAT, 3)],
                   [("cos", cos), ("sin", sin)])

    def feed(r, b, n):
        return {"x": randn(r, b, n, HEADS * D),
                "pos": np.array([3]) if offset else r.integers(0, 16, (b, n))}

    assert_matches_ort(model, _feeds(model, feed), attentions=0)


def test_unsupported_norm_output_is_one_error():
    node = oh.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["y", "inv"], name="sln")
    model = _model(node, [X3], [("y", TP.FLOAT, 3), ("inv", TP.FLOAT, 3)], [("gamma", GAMMA)])
    with pytest.raises(tvmattn.TvmAttnError, match="'sln'.*output 'inv_std_var'.*not supported"):
        tvmattn.import_onnx(model)


# ---- fusion through a reshape ----------------------------------------------------------------------------
@pytest.mark.parametrize("back, vector, fused", [((2, 5, 4 * H), False, True), ((2, 5, 4, H), False, True),
                                                 ((2, 5, 4, H), True, False)])
def test_activation_after_a_row_reshape(back, vector, fused):
    """A projection on 2-D rows reshaped back (GPT-2's Conv1D), then tanh-GELU and a residual: the
    activation and the residual fuse into the GEMM (`ops.reshapes`), through a reshape that keeps the
    last axis or splits it (their other operands are scalars and the residual); a vector added along the
    split axis keeps them apart. All against ONNX Runtime."""
    rng = np.random.default_rng(0)
    w, bias = rng.standard_normal((H, 4 * H)).astype(np.float32) / 4, rng.standard_normal(4 * H).astype(np.float32)
    consts = {"rows": np.array([10, H]), "back": np.array(back), "three": np.float32(3), "c": np.float32(0.044715),
              "s": np.float32(0.7978846), "one": np.float32(1), "half": np.float32(0.5),
              "v": rng.standard_normal(back[-1]).astype(np.float32)}
    nodes = [oh.make_node("Reshape", ["x", "rows"], ["x2"]), oh.make_node("MatMul", ["x2", "w"], ["h0"]),
             oh.make_node("Add", ["h0", "bias"], ["h1"]), oh.make_node("Reshape", ["h1", "back"], ["hb"]),
             oh.make_node("Add", ["hb", "v"], ["h"]) if vector else oh.make_node("Identity", ["hb"], ["h"]),
             oh.make_node("Pow", ["h", "three"], ["h3"]), oh.make_node("Mul", ["h3", "c"], ["h3c"]),
             oh.make_node("Add", ["h", "h3c"], ["u"]), oh.make_node("Mul", ["u", "s"], ["us"]),
             oh.make_node("Tanh", ["us"], ["t"]), oh.make_node("Add", ["t", "one"], ["t1"]),
             oh.make_node("Mul", ["h", "half"], ["hh"]), oh.make_node("Mul", ["hh", "t1"], ["g"]),
             oh.make_node("Add", ["g", "residual"], ["y"])]
    inits = [onnx.numpy_helper.from_array(a, n) for n, a in {"w": w, "bias": bias, **consts}.items()]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, (2, 5, H)),
                                       oh.make_tensor_value_info("residual", TP.FLOAT, back)],
                          [oh.make_tensor_value_info("y", TP.FLOAT, back)], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    imported = assert_matches_ort(model, [{"x": randn(rng, 2, 5, H), "residual": rng.standard_normal(back).astype(
        np.float32)}], attentions=0)
    rules = {rule for name, rule in imported.report.rule_of.items() if "tanh" in name}
    assert rules == ({"matmul"} if fused else {"injective"}), imported.report.rule_of


def test_a_cast_after_a_head_split_joins_the_projection():
    """A projection split into heads, then cast to 16 bits (BERT's Q, K, V for a bf16 attention kernel):
    the cast moves before the reshape into the GEMM's epilogue, which stores 16 bits. Against ONNX
    Runtime (fp16: its CPU EP casts to it)."""
    rng = np.random.default_rng(2)
    w, bias = rng.standard_normal((H, 4 * H)).astype(np.float32) / 4, rng.standard_normal(4 * H).astype(np.float32)
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h0"]), oh.make_node("Add", ["h0", "bias"], ["h1"]),
             oh.make_node("Reshape", ["h1", "heads"], ["h"]), oh.make_node("Cast", ["h"], ["y"], to=TP.FLOAT16)]
    inits = [onnx.numpy_helper.from_array(a, n) for n, a in {"w": w, "bias": bias,
                                                               "heads": np.array([2, 5, 4, H])}.items()]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, (2, 5, H))],
                          [oh.make_tensor_value_info("y", TP.FLOAT16, (2, 5, 4, H))], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    imported = assert_matches_ort(model, [{"x": randn(rng, 2, 5, H)}], attentions=0)
    assert {rule for name, rule in imported.report.rule_of.items() if "cast" in name} == {"matmul"}, \
        imported.report.rule_of


@pytest.mark.parametrize("position", ["constant", "input"])
def test_convolution_activation_before_the_transposition_back(position):
    """A convolution's channels-first output with its bias and erf-GELU, transposed back to channels-last
    and a position embedding added (Whisper's front end): the activation moves before the transposition
    (`ops.reshapes`) into the GEMM's epilogue, and the two transpositions cancel; a position embedding
    that is a graph input stays after them. Against ONNX Runtime."""
    rng = np.random.default_rng(1)
    c_in, c, t = 12, 32, 20
    consts = {"w": rng.standard_normal((c, c_in, 3)).astype(np.float32) / 4,
              "b": rng.standard_normal(c).astype(np.float32), "sqrt2": np.float32(np.sqrt(2)),
              "one": np.float32(1), "half": np.float32(0.5)}
    if position == "constant":
        consts["pos"] = rng.standard_normal((t, c)).astype(np.float32)
    nodes = [oh.make_node("Conv", ["x", "w", "b"], ["h"], pads=[1, 1]), oh.make_node("Div", ["h", "sqrt2"], ["hs"]),
             oh.make_node("Erf", ["hs"], ["e"]), oh.make_node("Add", ["e", "one"], ["e1"]),
             oh.make_node("Mul", ["h", "e1"], ["g0"]), oh.make_node("Mul", ["g0", "half"], ["g"]),
             oh.make_node("Transpose", ["g"], ["gt"], perm=[0, 2, 1]), oh.make_node("Add", ["gt", "pos"], ["y"])]
    inputs = [oh.make_tensor_value_info("x", TP.FLOAT, (2, c_in, t))]
    feed = {"x": randn(rng, 2, c_in, t)}
    if position == "input":
        inputs.append(oh.make_tensor_value_info("pos", TP.FLOAT, (t, c)))
        feed["pos"] = randn(rng, t, c)
    graph = oh.make_graph(nodes, "g", inputs, [oh.make_tensor_value_info("y", TP.FLOAT, (2, t, c))],
                          [onnx.numpy_helper.from_array(a, n) for n, a in consts.items()])
    imported = assert_matches_ort(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), [feed], attentions=0)
    assert {rule for name, rule in imported.report.rule_of.items() if "erf" in name} == {"matmul"}, \
        imported.report.rule_of
    # (the one transposition left is x's, channels-last for the im2col: it joins it)
    assert all("im2col" in name for name in imported.report.rule_of if "transpose" in name), imported.report.rule_of


# ---- binding shapes ------------------------------------------------------------------------------------
def _gelu_model(dims) -> onnx.ModelProto:
    node = oh.make_node("Gelu", ["x"], ["y"], domain="com.microsoft")
    return _model(node, [("x", TP.FLOAT, dims)], [("y", TP.FLOAT, 3)])


def test_shapes_bind_an_input():
    model = _gelu_model(["b", "n", H])
    imported = tvmattn.import_onnx(model, shapes={"x": (1, "n", H)})
    assert imported.inputs[0].shape == (1, "n", H)
    for n in (3, 7):
        x = randn(np.random.default_rng(n), 1, n, H)
        np.testing.assert_allclose(imported.run({"x": x})[0], ort_run(model, {"x": x})[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(tvmattn.TvmAttnError, match="input 'x' has shape"):
        imported.run({"x": randn(np.random.default_rng(0), 2, 3, H)})


def test_pads_known_once_a_computed_slice_is_folded():
    """SEW's squeeze: x sliced to an end computed from x's shape, then padded by an amount read from the
    slice's shape. At bound sizes ONNX's inference sizes the slice only once its end is a constant, so the
    pads are folded in a second round (TVM's Pad takes no computed pads); at symbolic ones they are read
    as an expression of the sizes."""
    def const(name, value):
        return oh.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array(value)))
    nodes = [const("one", [1]), const("two", 2), const("zero", [0]), const("zeros", [0, 0, 0]),
             oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Gather", ["s", "one"], ["n"]),
             oh.make_node("Div", ["n", "two"], ["half"]), oh.make_node("Slice", ["x", "zero", "half", "one"], ["y"]),
             oh.make_node("Shape", ["y"], ["ys"]), oh.make_node("Gather", ["ys", "one"], ["pad"]),
             oh.make_node("Concat", ["zeros", "pad"], ["pads"], axis=0), oh.make_node("Pad", ["y", "pads"], ["z"])]
    model = _model(nodes, [("x", TP.FLOAT, ["b", "n"])], [("z", TP.FLOAT, 2)], opsets=(("", 17),))
    x = randn(np.random.default_rng(0), 3, 8)
    imported = tvmattn.import_onnx(model, shapes={"x": (3, 8)})
    np.testing.assert_array_equal(imported.run({"x": x})[0], ort_run(model, {"x": x})[0])
    symbolic = tvmattn.import_onnx(model)  # at symbolic sizes the amounts are expressions of them (`pads`)
    for n in (7, 8, 11):
        x = randn(np.random.default_rng(n), 2, n)
        np.testing.assert_array_equal(symbolic.run({"x": x})[0], ort_run(model, {"x": x})[0])


def test_a_pad_amount_not_provably_nonnegative_is_checked_when_the_model_runs():
    """x padded at its end by n - 5, computed from x's shape: >= 0 only from n = 5 on, which no analyzer proves
    (sizes are only >= 1; SEW's L - 2·(L // 2) is >= 0 only where a size far upstream is). It imports at
    symbolic sizes and pads as ONNX Runtime does; below 5, where ONNX crops, the run fails with a sentence
    (TVM's fill of a negative size had failed in its allocator)."""
    def const(name, value):
        return oh.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array(value)))
    nodes = [const("one", [1]), const("five", [5]), const("zeros", [0, 0, 0]),
             oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Gather", ["s", "one"], ["n"]),
             oh.make_node("Sub", ["n", "five"], ["k"]), oh.make_node("Concat", ["zeros", "k"], ["pads"], axis=0),
             oh.make_node("Pad", ["x", "pads"], ["z"])]
    model = _model(nodes, [("x", TP.FLOAT, ["b", "n"])], [("z", TP.FLOAT, 2)], opsets=(("", 17),))
    imported = tvmattn.import_onnx(model)
    for n in (5, 6, 9):
        x = randn(np.random.default_rng(n), 2, n)
        np.testing.assert_array_equal(imported.run({"x": x})[0], ort_run(model, {"x": x})[0])
    with pytest.raises(tvmattn.TvmAttnError, match="Pad's amount computed from the input sizes is negative"):
        imported.run({"x": randn(np.random.default_rng(0), 2, 3)})


def test_unnamed_dimensions_get_names_of_their_own():
    """TVM's importer would read both unnamed sizes as one."""
    model = _gelu_model([None, None, H])
    imported = tvmattn.import_onnx(model)
    x = randn(np.random.default_rng(0), 2, 5, H)
    np.testing.assert_allclose(imported.run({"x": x})[0], ort_run(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shapes, match", [({"y": (1, 2)}, "'y', which is not an input"),
                                           ({"x": (1, 2)}, "gives input 'x' 2 dimensions; it has 3"),
                                           ({"x": (1, -3, H)}, "dimension -3")])
def test_bad_shapes_are_one_error(shapes, match):
    with pytest.raises(tvmattn.TvmAttnError, match=match):
        tvmattn.import_onnx(_gelu_model(["b", "n", H]), shapes=shapes)


def test_cli_shape_binds_inputs(tmp_path, capsys):
    onnx.save(_gelu_model(["b", "n", H]), str(tmp_path / "m.onnx"))
    assert main(["import", str(tmp_path / "m.onnx"), "--shape", f"x=1xnx{H}", "--check", "--at", "n=5"]) == 0
    assert "PASS" in capsys.readouterr().out


def _trigram_model(shift: int = 1) -> onnx.ModelProto:
    """MobileBERT's trigram embedding: concat(pad(x[:, 1:]), x, pad(x[:, :-1])) on the feature axis (the
    rows ``shift`` apart)."""
    ints = lambda name, v: (name, np.array(v, np.int64))  # noqa: E731
    nodes = [oh.make_node("Slice", ["x", "shift", "end", "axis"], ["later"]),
             oh.make_node("Slice", ["x", "zero", "minus_shift", "axis"], ["earlier"]),
             oh.make_node("Pad", ["later", "pad_end"], ["next"]),
             oh.make_node("Pad", ["earlier", "pad_start"], ["previous"]),
             oh.make_node("Concat", ["next", "x", "previous"], ["y"], axis=2)]
    consts = [ints("shift", [shift]), ints("zero", [0]), ints("end", [2**63 - 1]), ints("minus_shift", [-shift]),
              ints("axis", [1]), ints("pad_end", [0, 0, 0, 0, shift, 0]), ints("pad_start", [0, shift, 0, 0, 0, 0])]
    return _model(nodes, [("x", TP.FLOAT, ["b", "n", H])], [("y", TP.FLOAT, 3)], consts)


def test_a_trigram_embedding_at_symbolic_sizes():
    """MobileBERT's trigram embedding with n symbolic: TVM's converter sized x[:, :-1] min(max(n - 1, 0), n)
    and could not prove the padded slices n long (the concat's shape unknown: the import failed). n ≥ 1
    (the importer refuses empty sizes) makes the slices n - 1 long, as at every static n."""
    rng = np.random.default_rng(0)
    assert_matches_ort(_trigram_model(), [{"x": randn(rng, 2, n, H)} for n in (1, 5)], 0)


def test_a_shape_tvm_cannot_infer_is_one_error_that_says_what_to_do():
    """Rows two apart, n symbolic: x[:, 2:] is min(2, n) short, a clamp n ≥ 1 does not remove, so TVM cannot
    prove the concat's parts n long; the error says so and how to go on. Static, it matches ONNX Runtime."""
    with pytest.raises(tvmattn.TvmAttnError, match="could not infer the shape of a concat .* static shapes"):
        tvmattn.import_onnx(_trigram_model(2))
    x = randn(np.random.default_rng(0), 2, 5, H)
    imported = tvmattn.import_onnx(_trigram_model(2), shapes={"x": x.shape})
    np.testing.assert_array_equal(imported.run({"x": x})[0], ort_run(_trigram_model(2), {"x": x})[0])


@pytest.mark.parametrize("op", ["Min", "Max"])
def test_min_and_max_of_sizes(op):
    """x + x viewed as (b, m, H) for m = min(n, 4) (GPT-Neo's dynamo export: ``torch.sym_min(1024, n)`` in
    a Reshape's shape) or 4 - max(0, 4 - n) (MPT's ALiBi rows): TVM's Min and Max took tensors only, and
    the symbolic import failed. m is n up to 4; past it the view cannot hold x (a clean error)."""
    ints = lambda name, v: (name, np.array(v, np.int64))  # noqa: E731
    m = [oh.make_node("Min", ["n", "four"], ["m"])] if op == "Min" else [
        oh.make_node("Sub", ["four", "n"], ["d"]), oh.make_node("Max", ["d", "zero"], ["start"]),
        oh.make_node("Sub", ["four", "start"], ["m"])]
    nodes = [oh.make_node("Shape", ["x"], ["n1"], start=1, end=2), oh.make_node("Squeeze", ["n1"], ["n"]), *m,
             oh.make_node("Unsqueeze", ["m", "axis"], ["m1"]),
             oh.make_node("Concat", ["minus_one", "m1", "width"], ["shape"], axis=0),
             oh.make_node("Reshape", ["x", "shape"], ["view"]), oh.make_node("Add", ["x", "view"], ["y"])]
    consts = [ints("four", 4), ints("zero", 0), ints("axis", [0]), ints("minus_one", [-1]), ints("width", [H])]
    model = _model(nodes, [("x", TP.FLOAT, ["b", "n", H])], [("y", TP.FLOAT, 3)], consts)
    rng = np.random.default_rng(0)
    imported = assert_matches_ort(model, [{"x": randn(rng, 2, n, H)} for n in (3, 4)], 0)
    with pytest.raises(tvmattn.TvmAttnError, match="the model rejected its inputs"):
        imported.run({"x": randn(rng, 2, 6, H)})


def test_an_attention_over_rows_a_min_of_sizes_counts_reaches_the_kernel():
    """softmax(v·vᵀ/8)·v over x viewed as (b, min(n, 4), H) (GPT-Neo's ``sym_min``; SEW's pooled frames):
    the importer cast each tensor whose sizes hold a min to those same sizes again, a cast that checks
    nothing, and the scores' cast hid the chain from the patterns (left to TVM). On the kernel now, against
    ONNX Runtime."""
    ints = lambda name, v: (name, np.array(v, np.int64))  # noqa: E731
    nodes = [oh.make_node("Shape", ["x"], ["n1"], start=1, end=2), oh.make_node("Squeeze", ["n1"], ["n"]),
             oh.make_node("Min", ["n", "four"], ["m"]), oh.make_node("Unsqueeze", ["m", "axis"], ["m1"]),
             oh.make_node("Concat", ["minus_one", "m1", "width"], ["shape"], axis=0),
             oh.make_node("Reshape", ["x", "shape"], ["v"]), oh.make_node("Transpose", ["v"], ["vt"], perm=[0, 2, 1]),
             oh.make_node("MatMul", ["v", "vt"], ["s"]), oh.make_node("Mul", ["s", "c"], ["scaled"]),
             oh.make_node("Softmax", ["scaled"], ["p"], axis=-1), oh.make_node("MatMul", ["p", "v"], ["y"])]
    consts = [ints("four", 4), ints("axis", [0]), ints("minus_one", [-1]), ints("width", [H]),
              ("c", np.array(0.125, np.float32))]
    model = _model(nodes, [("x", TP.FLOAT, ["b", "n", H])], [("y", TP.FLOAT, 3)], consts)
    rng = np.random.default_rng(0)
    assert_matches_ort(model, [{"x": randn(rng, 2, n, H)} for n in (3, 4)], 1)


def test_a_size_beside_a_constant_array_is_a_tensor_of_the_sum():
    """Funnel's relative positions: a constant (16, 1) array plus 2·n, a scalar of shape arithmetic. TVM's
    converter folded both into one scalar and failed on the array; it matches ONNX Runtime at two n."""
    ints = lambda name, v: (name, np.array(v, np.int64))  # noqa: E731
    nodes = [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Gather", ["s", "one"], ["n"], axis=0),
             oh.make_node("Mul", ["n", "two"], ["n2"]), oh.make_node("Add", ["positions", "n2"], ["y"])]
    consts = [ints("one", 1), ints("two", 2), ints("positions", np.arange(16).reshape(16, 1))]
    model = _model(nodes, [("x", TP.FLOAT, ["b", "n", H])], [("y", TP.INT64, 2)], consts)
    imported = tvmattn.import_onnx(model)
    for n in (3, 7):
        x = randn(np.random.default_rng(n), 2, n, H)
        np.testing.assert_array_equal(imported.run({"x": x})[0], ort_run(model, {"x": x})[0])


def test_sizes_that_do_not_broadcast_name_the_op_and_the_sizes():
    """An export that baked its traced length into one operand (Funnel's TorchScript export: 15 for
    2·8 - 1, behind shape arithmetic ONNX's inference does not follow) fails at any other length, in ONNX
    Runtime too; the error says which sizes disagree, where it said "ValueError" (the rest of TVM's line
    is the op's repr)."""
    from tvm import relax

    from tvmattn.compiler.errors import tvm_reason

    bb = relax.BlockBuilder()
    x, w = relax.Var("x", relax.TensorType((2, 5, 15), "float32")), relax.Var("w", relax.TensorType((128,), "float32"))
    with pytest.raises(Exception) as raised:
        bb.normalize(relax.op.multiply(x, w))
    assert tvm_reason(raised.value) == ("multiply: the first input shape at dim 2 is 15 and the second input shape at "
                                        "dim 0 is 128, which are not broadcastable.")


# ---- a constant tiled along the batch --------------------------------------------------------------------
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_product_by_a_constant_tiled_per_sequence(transposed, dtype):
    """DeBERTa's queries × positional keys: Tile of a constant (h, r, d) by [batch, 1, 1] (a symbolic
    batch), transposed, times queries (b·h, n, d). The tile is gone (`tiles.constant_tiles`: the matmul
    broadcasts the constant, no copy a call) and the product matches ONNX Runtime's."""
    r = 12
    keys = np.random.default_rng(5).standard_normal((HEADS, r, D) if transposed else (HEADS, D, r)).astype(np.float32)
    one, d = np.array([1], np.int64), np.array([D], np.int64)
    nodes = [oh.make_node("Shape", ["q"], ["s"]),
             oh.make_node("Gather", ["s", "zero"], ["b"], axis=0), oh.make_node("Gather", ["s", "two"], ["n"], axis=0),
             oh.make_node("Concat", ["minus", "n", "d"], ["rows"], axis=0),
             oh.make_node("Reshape", ["q", "rows"], ["q3"]),  # (b·h, n, d)
             oh.make_node("Concat", ["b", "one", "one"], ["reps"], axis=0),
             oh.make_node("Tile", ["keys", "reps"], ["tiled"]),  # (b·h, r, d) or (b·h, d, r)
             *([oh.make_node("Transpose", ["tiled"], ["kt"], perm=[0, 2, 1])] if transposed else []),
             oh.make_node("MatMul", ["q3", "kt" if transposed else "tiled"], ["y"])]
    model = _model(nodes, [("q", TP.FLOAT, ["b", HEADS, "n", D])], [("y", TP.FLOAT, 3)],
                   [("keys", keys), ("zero", np.array([0], np.int64)), ("two", np.array([2], np.int64)),
                    ("minus", np.array([-1], np.int64)), ("one", one), ("d", d)])
    imported = tvmattn.import_onnx(model, dtype=dtype)
    assert not [f for f in imported.report.rule_of if "tile" in f], imported.report.rule_of
    for b, n in SHAPES:
        q = randn(np.random.default_rng(b * 10 + n), b, HEADS, n, D)
        got, want = imported.run({"q": q})[0], ort_run(model, {"q": q})[0]
        assert got.shape == want.shape == (b * HEADS, n, r)
        assert np.abs(got - want).max() <= (1e-5 if dtype is None else 2e-2) * np.abs(want).max()


# ---- external data -------------------------------------------------------------------------------------
def test_external_data_imports_from_its_path(tmp_path):
    weights = np.random.default_rng(0).standard_normal((64, H)).astype(np.float32)  # past the threshold
    node = oh.make_node("Gather", ["table", "ids"], ["y"])
    model = _model(node, [("ids", TP.INT64, ["b", "n"])], [("y", TP.FLOAT, 3)], [("table", weights)])
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    imported = tvmattn.import_onnx(str(tmp_path / "m.onnx"))
    ids = np.array([[1, 63, 5]])
    np.testing.assert_array_equal(imported.run({"ids": ids})[0], weights[ids])
    with pytest.raises(tvmattn.TvmAttnError, match="external data.*import it from its path"):
        tvmattn.import_onnx(onnx.load(str(tmp_path / "m.onnx"), load_external_data=False))
    (tmp_path / "m.data").write_bytes((tmp_path / "m.data").read_bytes()[:100])
    with pytest.raises(tvmattn.TvmAttnError, match="side file is truncated"):
        tvmattn.import_onnx(str(tmp_path / "m.onnx"))
    (tmp_path / "m.data").unlink()
    with pytest.raises(tvmattn.TvmAttnError, match="external data file 'm.data', which is not in"):
        tvmattn.import_onnx(str(tmp_path / "m.onnx"))


@pytest.mark.parametrize("graph, dtype, tolerance", [
    ("float32", None, 1e-5), ("float32", "bfloat16", 1e-2), ("float16", None, 2e-3), ("bfloat16", None, 1e-2)])
@pytest.mark.parametrize("gather", ["GatherND", "Gather"])
@pytest.mark.parametrize("left", [True, False])
def test_a_matmul_by_gathered_expert_weights_reads_them_in_place(left, gather, graph, dtype, tolerance):
    """A mixture of experts' W[expert_ids] · x per routed token (transformers' batched_mm as dynamo writes
    it: GatherND; Gather for a take), left W_s (S, O, K) · x (S, K, 1) or right x (S, 1, K) · W_s (S, K, O):
    one `experts` kernel reads W in place (no (S, O, K) copy, no function gathers), against the float64
    product of the graph's own (rounded) W and x: an fp32 graph (imported in fp32, or with bf16 weights),
    an fp16 or a bf16 export. O = 96: tiles of 32 outputs; negative ids included."""
    experts, k, o = 4, 48, 96  # (W over 32 KB in 16 bits: a Gather of a smaller table is fused as a lookup)
    store = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[graph]
    w = np.random.default_rng(7).standard_normal((experts, o, k) if left else (experts, k, o)).astype(store)
    elem = {"float32": TP.FLOAT, "float16": TP.FLOAT16, "bfloat16": TP.BFLOAT16}[graph]
    ids = ("ids", TP.INT64, ["s", 1] if gather == "GatherND" else ["s"])
    x = ("x", elem, ["s", k, 1] if left else ["s", 1, k])
    nodes = [oh.make_node(gather, ["w", "ids"], ["ws"]),
             oh.make_node("MatMul", ["ws", "x"] if left else ["x", "ws"], ["y"])]
    weight = onnx.numpy_helper.from_array(w, "w") if graph != "bfloat16" else oh.make_tensor(
        "w", TP.BFLOAT16, w.shape, w.astype(np.float32).reshape(-1).tolist())
    graph_proto = oh.make_graph(nodes, "g", [oh.make_tensor_value_info(*i) for i in (ids, x)],
                                [oh.make_tensor_value_info("y", elem, [None] * 3)], [weight])
    model = oh.make_model(graph_proto, opset_imports=[oh.make_opsetid("", 17)])
    imported = tvmattn.import_onnx(model, dtype=dtype)
    assert "experts" in imported.report.rule_of.values(), imported.report.rule_of
    assert not [name for name in imported.report.rule_of if "gather" in name or "take" in name], imported.report.rule_of
    for s in (1, 37):
        rng = np.random.default_rng(s)
        feed = {"ids": rng.integers(-experts, experts, [s, 1] if gather == "GatherND" else [s]),
                "x": randn(rng, *([s, k, 1] if left else [s, 1, k])).astype(store)}
        chosen = w.astype(np.float64)[feed["ids"].reshape(-1) % experts]
        xs = feed["x"].astype(np.float64)
        want = chosen @ xs if left else xs @ chosen
        got = imported.run(feed)[0]
        assert got.dtype == store and np.abs(got.astype(np.float64) - want).max() <= tolerance * np.abs(want).max()


@pytest.mark.parametrize("equation, a, b, matmul", [
    ("...qhd,...khd->...hqk", (2, 3, 33, 2, 16), (2, 3, 99, 2, 16), True),  # LongT5's local attention, odd widths
    ("...hqk,...khd->...qhd", (2, 3, 2, 33, 99), (2, 3, 99, 2, 16), True),
    ("bhqd,bhkd->bhqk", (2, 3, 17, 8), (2, 3, 19, 8), True),
    ("ij,jk->ik", (5, 7), (7, 9), True),
    ("bn,anm->bam", (4, 6), (3, 6, 5), True),  # free indices on both sides of the contraction
    ("i,j->ij", (5,), (7,), True),  # nothing contracted: an outer product
    ("ij,jk->k", (5, 7), (7, 9), False),  # i summed in one operand only
    ("bij,bjk->bik", (1, 5, 7), (3, 7, 9), False),  # a batch of one broadcast against three
])
def test_einsum_as_a_batched_matmul(equation, a, b, matmul):
    """A two-operand Einsum of batch, contracted and free indices runs as a matmul (TVM's einsum had been one
    reduction block, LongT5's attention at 4 GFLOP/s); others stay TVM's. Both against ONNX Runtime."""
    rank = np.einsum(equation, np.zeros(a), np.zeros(b)).ndim
    model = _model(oh.make_node("Einsum", ["a", "b"], ["y"], equation=equation),
                   [("a", TP.FLOAT, list(a)), ("b", TP.FLOAT, list(b))], [("y", TP.FLOAT, rank)], opsets=(("", 17),))
    imported = tvmattn.import_onnx(model)
    rules = imported.report.rule_of
    assert any("matmul" in name for name in rules) == matmul, rules
    assert any("einsum" in name for name in rules) != matmul, rules
    rng = np.random.default_rng(0)
    feed = {"a": randn(rng, *a), "b": randn(rng, *b)}
    got, want = imported.run(feed)[0], ort_run(model, feed)[0]
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("a, b", [(["s", 64], [64, "m"]), ([2, 3, "s", 16], [1, 3, 16, "m"])])
def test_a_matmul_of_a_symbolic_width_runs_in_register_tiles(a, b):
    """A GEMM whose width is known only at run time (DeBERTa's scores against 2·min(n, span) relative
    positions) runs on the `matmul-columns` rule, padded to whole tiles (it ran a product at a time on the
    `reduce` rule: DeBERTa at symbolic sizes 0.11× OpenVINO); against float64 at widths and row counts
    that fill no tile, one tile, and a power of two."""
    model = _model(oh.make_node("MatMul", ["a", "b"], ["y"]), [("a", TP.FLOAT, a), ("b", TP.FLOAT, b)],
                   [("y", TP.FLOAT, len(a))], opsets=(("", 17),))
    imported = tvmattn.import_onnx(model)
    assert "matmul-columns" in imported.report.rule_of.values(), imported.report.rule_of
    rng = np.random.default_rng(0)
    for s, m in ((1, 1), (5, 3), (37, 99), (64, 256)):
        sizes = {"s": s, "m": m}
        x, w = (randn(rng, *[sizes.get(d, d) for d in dims]) for dims in (a, b))
        want = x.astype(np.float64) @ w.astype(np.float64)
        got = imported.run({"a": x, "b": w})[0]
        assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (s, m)
