"""Convolutions as im2col + GEMM (`schedules/ops/conv.py`): ONNX Conv nodes of the shapes transformer
front ends use (patch embeddings, audio frames) and the general ones (padding, stride, dilation,
groups, odd and symbolic sizes), each against ONNX Runtime, and on the GEMM rule, none on fallback."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh
from onnx_testing import ort_run

import tvmattn
from tvmattn.compiler.target import isa_of, resolve_target
from tvmattn.compiler.verify import errors

HAS_DOT = isa_of(resolve_target("cpu")).dot is not None  # the host has a bf16 dot product


def conv_model(x_shape: list, w_shape: tuple, bias: bool, gelu: bool = False, **attrs) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    inits = [nh.from_array(w, "w")] + ([nh.from_array(rng.standard_normal(w_shape[0]).astype(np.float32), "b")]
                                        if bias else [])
    nodes = [oh.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y" if gelu else "out"], **attrs)]
    if gelu:  # Whisper's conv → GELU
        nodes.append(oh.make_node("Gelu", ["y"], ["out"]))
    dims = len(w_shape) - 2
    assert dims in (1, 2)
    graph = oh.make_graph(nodes, "conv", [oh.make_tensor_value_info("x", TP.FLOAT, x_shape)],
                          [oh.make_tensor_value_info("out", TP.FLOAT, [None] * (dims + 2))], initializer=inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)])
    model.ir_version = 9
    return model


CASES = [  # x's shape (names: symbolic), W's shape, bias, GELU after, Conv attributes, a concrete x shape
    (["b", 3, 224, 224], (48, 3, 16, 16), True, False, {"strides": [16, 16]}, (2, 3, 224, 224)),  # ViT patches
    (["b", 3, 30, 30], (32, 3, 14, 14), False, False, {"strides": [14, 14]}, (1, 3, 30, 30)),  # cropped edge
    (["b", 20, "n"], (24, 20, 3), True, True, {"pads": [1, 1]}, (2, 20, 37)),  # Whisper conv1 (n symbolic)
    (["b", 24, "n"], (24, 24, 3), True, True, {"pads": [1, 1], "strides": [2]}, (1, 24, 38)),  # Whisper conv2
    ([1, 8, 17, 13], (16, 8, 3, 3), True, False, {"pads": [1, 2, 0, 1], "dilations": [2, 1]}, (1, 8, 17, 13)),
    ([2, 16, 9, 9], (32, 4, 3, 3), True, False, {"group": 4, "pads": [1, 1, 1, 1], "strides": [2, 2]},
     (2, 16, 9, 9)),
    (["b", 8, "n"], (8, 1, 5), False, False, {"group": 8, "pads": [2, 2]}, (3, 8, 29)),  # depthwise 1-D
    (["b", 16, 56, 56], (16, 1, 3, 3), True, True, {"group": 16, "pads": [1, 1, 1, 1]}, (2, 16, 56, 56)),  # SegFormer
    ([1, 8, 15, 21], (8, 1, 3, 5), False, False, {"group": 8, "pads": [2, 0, 1, 3], "strides": [2, 1],
                                                  "dilations": [1, 2]}, (1, 8, 15, 21)),  # depthwise, odd
    ([2, 12, 10, 9], (12, 2, 3, 3), True, False, {"group": 6, "pads": [1, 1, 1, 1]}, (2, 12, 10, 9)),  # 2 per group
    ([1, 512, 50], (7, 512, 10), True, False, {"strides": [5]}, (1, 512, 50)),  # Wav2Vec2's first, narrow out
    (["b", 1, "n"], (40, 1, 10), True, False, {"strides": [5]}, (2, 1, 403)),  # one channel: 8-row tiles, 79 rows
    (["b", 32, "n"], (32, 16, 8), True, False, {"group": 2, "pads": [4, 4]}, (2, 32, 21)),  # W2V2 positions: 16 wide
    (["b", 16, 7, 9], (24, 16, 1, 1), True, True, {}, (2, 16, 7, 9)),  # pointwise (MobileViT's): x transposed
    ([2, 16, 5, 6], (8, 4, 1, 1), False, False, {"group": 4}, (2, 16, 5, 6)),  # pointwise in groups
]


@pytest.mark.parametrize("x_shape, w_shape, bias, gelu, attrs, at", CASES)
def test_conv_matches_onnx_runtime(x_shape, w_shape, bias, gelu, attrs, at):
    model = conv_model(x_shape, w_shape, bias, gelu, **attrs)
    imported = tvmattn.import_onnx(model)
    rules = imported.report.rule_of
    per_channel = attrs.get("group", 1) == w_shape[0]  # one output channel per group: taps summed in place
    assert "fallback" not in rules.values(), rules
    convs = {rule for name, rule in rules.items() if "conv_per_channel" in name}  # (its bias and GELU fused in)
    assert convs == {"injective"} if per_channel else "matmul" in rules.values(), rules
    x = np.random.default_rng(1).standard_normal(at).astype(np.float32)
    got, want = imported.run({"x": x})[0], ort_run(model, {"x": x})[0]
    assert got.shape == want.shape
    assert errors(got, want)[1] <= 1e-5, errors(got, want)


@pytest.mark.parametrize("x_shape, attrs, at", [
    (["b", 8, "n"], {"kernel_shape": [2], "strides": [2]}, (2, 8, 37)),  # SEW's frames pooled by 2, n symbolic
    ([1, 16, 14, 14], {"kernel_shape": [3, 3], "strides": [2, 2]}, (1, 16, 14, 14)),
    ([2, 4, 9, 11], {"kernel_shape": [2, 3], "strides": [1, 2], "dilations": [2, 1]}, (2, 4, 9, 11)),
])
def test_average_pooling_sums_its_taps_in_place(x_shape, attrs, at):
    """An AveragePool without padding as a depthwise convolution of weights 1/k, elementwise: one function with
    its elementwise producer (SEW's GELU, here its erf), where TVM's pooling is a reduction block that wrote
    erf(x) for it to read back (and, in SEW, ran on the fallback rule with the GELU fused in). Against ONNX
    Runtime."""
    graph = oh.make_graph([oh.make_node("Erf", ["x"], ["g"]), oh.make_node("AveragePool", ["g"], ["out"], **attrs)],
                          "pool", [oh.make_tensor_value_info("x", TP.FLOAT, x_shape)],
                          [oh.make_tensor_value_info("out", TP.FLOAT, [None] * len(x_shape))])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)])
    model.ir_version = 9
    imported = tvmattn.import_onnx(model)
    assert list(imported.report.rule_of.values()) == ["injective"], imported.report.rule_of
    x = np.random.default_rng(1).standard_normal(at).astype(np.float32)
    got, want = imported.run({"x": x})[0], ort_run(model, {"x": x})[0]
    assert got.shape == want.shape and errors(got, want)[1] <= 1e-5, errors(got, want)


@pytest.mark.parametrize("x_shape, w_shape, gelu, attrs, at", [
    (["b", 64, "n"], (64, 16, 16), False, {"group": 4, "pads": [8, 8]}, (2, 64, 37)),  # W2V2 positions: 16 wide
    (["b", 48, "n"], (96, 48, 3), False, {"pads": [1, 1]}, (2, 48, 40)),  # 96 = 3 blocks of 32: as it is
    (["b", 32, "n"], (48, 32, 2), False, {"strides": [2]}, (1, 32, 66)),  # 48 wide: padded to 64 on AMX
    ([2, 48, 61], (64, 48, 3), True, {"strides": [2]}, (2, 48, 61)),  # 30 static rows, copied as 32, GELU
    ([1, 32, 75], (32, 16, 3), True, {"group": 2, "pads": [1, 1]}, (1, 32, 75)),  # 75 rows as 96, groups
    ([1, 3, 64, 64], (32, 3, 7, 7), False, {"strides": [4, 4], "pads": [3, 3, 3, 3]}, (1, 3, 64, 64)),  # K = 147
    ([2, 33, 14, 14], (64, 33, 1, 1), True, {}, (2, 33, 14, 14)),  # pointwise, 33 channels: one zero channel
])
def test_bf16_conv_matches_onnx_runtime(x_shape, w_shape, gelu, attrs, at):
    """bf16 imports of convolutions whose GEMM width is not whole tile blocks (on AMX its weight gets
    zero columns up to them and the product is sliced back: `precision._widened`) or whose static rows
    are not whole blocks (the copy writes zero rows up to them, the GEMM's epilogue keeps the real
    ones: `conv.conv_as_gemm`'s ``row_block``)."""
    model = conv_model(x_shape, w_shape, True, gelu, **attrs)
    imported = tvmattn.import_onnx(model, dtype="bfloat16")
    assert "matmul-bf16" in imported.report.rule_of.values() or not HAS_DOT, imported.report.rule_of
    x = np.random.default_rng(1).standard_normal(at).astype(np.float32)
    got, want = imported.run({"x": x})[0], ort_run(model, {"x": x})[0]
    assert got.shape == want.shape
    assert errors(got, want)[1] <= 2e-2, errors(got, want)


@pytest.mark.parametrize("batch", ["b", 2])
@pytest.mark.parametrize("pads, strides", [([1, 1, 1, 1], [1, 1]), ([0, 1, 2, 0], [2, 1])])
def test_a_depthwise_conv_over_tokens_runs_channels_last(batch, pads, strides):
    """tokens (B, H·W, C) → Transpose → Reshape (B, C, H, W) → depthwise Conv → Reshape → Transpose →
    Gelu (SegFormer's MLP): computed channels last from the tokens as they are, the model's
    transpositions cancelled, the bias in the convolution's function; no function transposes."""
    h, w, c = 8, 6, 32
    out_h, out_w = [(n + pads[i] + pads[2 + i] - 3) // strides[i] + 1 for i, n in enumerate((h, w))]
    rng = np.random.default_rng(4)
    ints = lambda name, v: nh.from_array(np.array(v, np.int64), name)  # noqa: E731
    nodes = [oh.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]), oh.make_node("Reshape", ["t", "image"], ["i"]),
             oh.make_node("Conv", ["i", "w", "b"], ["conv"], group=c, pads=pads, strides=strides),
             oh.make_node("Reshape", ["conv", "flat"], ["f"]), oh.make_node("Transpose", ["f"], ["g"], perm=[0, 2, 1]),
             oh.make_node("Gelu", ["g"], ["y"])]
    inits = [nh.from_array((rng.standard_normal((c, 1, 3, 3)) / 3).astype(np.float32), "w"),
             nh.from_array(rng.standard_normal(c).astype(np.float32), "b"), ints("image", [0, c, h, w]),
             ints("flat", [0, c, out_h * out_w])]
    g = oh.make_graph(nodes, "tokens", [oh.make_tensor_value_info("x", TP.FLOAT, [batch, h * w, c])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [batch, out_h * out_w, c])], initializer=inits)
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)])
    model.ir_version = 9
    imported = tvmattn.import_onnx(model)
    rules = imported.report.rule_of
    assert not [f for f in rules if "transpose" in f], rules
    assert [f for f in rules if "conv_per_channel" in f] == ["fused_conv_per_channel_add"], rules
    x = rng.standard_normal((2, h * w, c)).astype(np.float32)
    assert errors(imported.run({"x": x})[0], ort_run(model, {"x": x})[0])[1] <= 1e-5


@pytest.mark.parametrize("dims, first, shape, second, moves", [
    ((2, 64, 32), [0, 2, 1], (2, 32, 8, 8), [0, 2, 3, 1], False),  # tokens → image → channels last: x as it is
    ((2, 8, 8, 32), [0, 3, 1, 2], (2, 32, 64), [0, 2, 1], False),  # and back to tokens
    ((2, 8, 8, 32), [0, 3, 1, 2], (2, 32, 64), [0, 1, 2], True),  # channels first: a transposition
    ((2, 64, 32), [0, 2, 1], (2, 32, 8, 8), [0, 1, 3, 2], True),  # rows and columns swapped
    ((2, 64, 32), [0, 2, 1], (2, 16, 128), [0, 2, 1], True),  # channels merged with positions
])
def test_transpositions_around_a_reshape_cancel_only_when_nothing_moves(dims, first, shape, second, moves):
    """`layout._element_order`, against NumPy doing the three."""
    from tvmattn.schedules.ops.layout import _element_order

    x = np.arange(np.prod(dims)).reshape(dims)
    y = x.transpose(first).reshape(shape).transpose(second)
    assert np.array_equal(y.ravel(), x.ravel()) == (not moves)
    order = _element_order([tvm.tirx.IntImm("int64", d) for d in dims], first,
                           [tvm.tirx.IntImm("int64", d) for d in shape], second)
    assert (order is not None and order == sorted(order)) == (not moves), order


def test_a_pointwise_conv_keeps_its_length_symbolic_for_the_norm_after_it():
    """A grouped 1-wide conv over a symbolic n (SqueezeBERT's projections) → Transpose → LayerNorm: the
    conv's length came out as (n - 1) // 1 + 1, which the norm's function took as a size of its own,
    and it ran on the fallback rule."""
    model = conv_model(["b", 16, "n"], (16, 4, 1), True, **{"group": 4})
    rng = np.random.default_rng(3)
    g = oh.make_graph(
        list(model.graph.node) + [oh.make_node("Transpose", ["out"], ["t"], perm=[0, 2, 1]),
                                  oh.make_node("LayerNormalization", ["t", "g", "beta"], ["y"], axis=-1)],
        "squeeze", list(model.graph.input), [oh.make_tensor_value_info("y", TP.FLOAT, [None, None, 16])],
        initializer=[*model.graph.initializer, nh.from_array(rng.standard_normal(16).astype(np.float32), "g"),
                     nh.from_array(rng.standard_normal(16).astype(np.float32), "beta")])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)])
    model.ir_version = 9
    imported = tvmattn.import_onnx(model)
    assert "fallback" not in imported.report.rule_of.values(), imported.report.rule_of
    x = rng.standard_normal((2, 16, 37)).astype(np.float32)
    assert errors(imported.run({"x": x})[0], ort_run(model, {"x": x})[0])[1] <= 1e-5


@pytest.mark.parametrize("dtype, tolerance", [(None, 1e-5), ("bfloat16", 3e-2)])
def test_transposes_around_a_norm_cancel(dtype, tolerance):
    """conv → Transpose → LayerNorm → Transpose → Gelu → conv → Transpose (Wav2Vec2's feature extractor): the GEMM's
    rows go to the norm as they are, the GELU (and in bf16 the conversion) runs in the norm's function,
    once per element, and the next convolution's copy reads its output as it is: no function is a
    transposition alone, none but the norm's computes the GELU. In bf16 the GEMM hands the norm its
    product rounded (`precision._NormInputs`): the rounding is in the GEMM's function."""
    model = conv_model(["b", 1, "n"], (16, 1, 10), False, **{"strides": [5]})
    rng = np.random.default_rng(2)
    w2 = (rng.standard_normal((16, 16, 3)) / np.sqrt(48)).astype(np.float32)
    g = oh.make_graph(
        list(model.graph.node[:1]) + [
            oh.make_node("Transpose", ["out"], ["t"], perm=[0, 2, 1]),
            oh.make_node("LayerNormalization", ["t", "g", "beta"], ["ln"], axis=-1),
            oh.make_node("Transpose", ["ln"], ["back"], perm=[0, 2, 1]),
            oh.make_node("Gelu", ["back"], ["gelu"]),
            oh.make_node("Conv", ["gelu", "w2"], ["c2"], strides=[2]),
            oh.make_node("Transpose", ["c2"], ["y"], perm=[0, 2, 1])],  # (the encoder's channels-last input)
        "w2v", list(model.graph.input), [oh.make_tensor_value_info("y", TP.FLOAT, [None, None, 16])],
        initializer=[*model.graph.initializer, nh.from_array(rng.standard_normal(16).astype(np.float32), "g"),
                     nh.from_array(rng.standard_normal(16).astype(np.float32), "beta"), nh.from_array(w2, "w2")])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)])
    model.ir_version = 9
    rules = tvmattn.import_onnx(model, dtype=dtype).report.rule_of
    assert not [f for f in rules if f.startswith("transpose")], rules
    assert [f for f in rules if "gelu" in f] == [next(f for f in rules if "layer_norm" in f)], rules
    assert any("matmul" in f and "cast" in f for f in rules) == (dtype is not None), rules
    x = rng.standard_normal((2, 1, 203)).astype(np.float32)
    imported = tvmattn.import_onnx(model, dtype=dtype)
    got, want = imported.run({"x": x})[0], ort_run(model, {"x": x})[0]
    assert errors(got, want)[1] <= tolerance, errors(got, want)


@pytest.mark.parametrize("dtype, tolerance", [(None, 1e-5), ("bfloat16", 3e-2)])
def test_a_grouped_pointwise_conv_viewed_as_heads_hands_them_over_as_they_are(dtype, tolerance):
    """Tokens (a GELU's) → Transpose → a grouped 1×1 Conv with a bias (SqueezeBERT's Q projection, 4 groups) →
    Reshape to (b, 4, 16, n) → Transpose to (b, 4, n, 16): the GEMM's (b, 4, n, 16) product is the heads. The bias
    moves into the GEMM (through the merge of the groups' channels, `reshapes._through_reshape`), the two
    reshapes compose into one, and the transpositions cancel: no function is a transposition or the add."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((64, 16, 1)) / 4).astype(np.float32)
    g = oh.make_graph(
        [oh.make_node("Gelu", ["x"], ["a"]), oh.make_node("Transpose", ["a"], ["t"], perm=[0, 2, 1]),
         oh.make_node("Conv", ["t", "w", "b"], ["c"], group=4),
         oh.make_node("Reshape", ["c", "heads"], ["h"]),
         oh.make_node("Transpose", ["h"], ["y"], perm=[0, 1, 3, 2])],
        "sqb", [oh.make_tensor_value_info("x", TP.FLOAT, ["b", "n", 64])],
        [oh.make_tensor_value_info("y", TP.FLOAT, [None, 4, None, 16])],
        initializer=[nh.from_array(w, "w"), nh.from_array(rng.standard_normal(64).astype(np.float32), "b"),
                     nh.from_array(np.array([0, 4, 16, -1], np.int64), "heads")])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)])
    model.ir_version = 9
    imported = tvmattn.import_onnx(model, dtype=dtype)
    rules = imported.report.rule_of
    assert not [f for f in rules if "transpose" in f or f.startswith("add")], rules
    x = rng.standard_normal((2, 37, 64)).astype(np.float32)
    got, want = imported.run({"x": x})[0], ort_run(model, {"x": x})[0]
    assert got.shape == want.shape and errors(got, want)[1] <= tolerance, errors(got, want)
