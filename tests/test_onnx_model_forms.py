"""Forms of attention and of graphs from models outside the test matrix, each a small reproduction against
ONNX Runtime: a rotary over the whole head (a zero-width slice concatenated back), attention on (B·h, n, d)
batches (torch.nn.MultiheadAttention's own form as a pooling head; BLOOM's baddbmm with ALiBi; XGLM's and
MPT's masks), zero-size
outputs, a corrupt input type, and GPT-2's attention as ONNX Runtime's transformer optimizer leaves it."""

from __future__ import annotations

import functools
import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh
from onnx_testing import assert_matches_ort, kernels_used, ort_run

import tvmattn
from tvmattn.compiler.verify import errors

torch = pytest.importorskip("torch")
nn = torch.nn


class WholeHeadRotary(nn.Module):
    """GPT-NeoX's partial rotary written for any width, rotating the whole head: t[..., rot:] has width 0."""

    def __init__(self, d: int = 32, h: int = 2):
        super().__init__()
        self.h, self.rot = h, d // h
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        angles = torch.arange(64).float()[:, None] / 10000 ** (torch.arange(0, self.rot, 2).float() / self.rot)
        self.register_buffer("cos", torch.cat([angles, angles], -1).cos())
        self.register_buffer("sin", torch.cat([angles, angles], -1).sin())

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)

        def rope(t):
            rotated, passed = t[..., :self.rot], t[..., self.rot:]
            x1, x2 = rotated.chunk(2, -1)
            return torch.cat((rotated * self.cos[:n] + torch.cat((-x2, x1), -1) * self.sin[:n], passed), -1)

        o = nn.functional.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(b, n, -1))


class PoolingHead(nn.Module):
    """A learned probe attending over the tokens (SigLIP's MAP head): nn.MultiheadAttention, whose
    exported form computes on (B·h, n, d) batches with Kᵀ a permutation (1, 2, 0) of (n_kv, B·h, d)."""

    def __init__(self, d: int = 32, h: int = 4):
        super().__init__()
        self.probe = nn.Parameter(torch.randn(1, 1, d))
        self.mha = nn.MultiheadAttention(d, h, batch_first=True)

    def forward(self, x):
        return self.mha(self.probe.expand(x.shape[0], -1, -1), x, x)[0][:, 0]


class CausalLM(nn.Module):
    """A one-layer causal LM of transformers (random weights, eager attention) returning its logits."""

    def __init__(self, config: str, **sizes):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        cfg = getattr(transformers, config)(vocab_size=128, **sizes)
        self.model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


LMS = {  # models of token ids, and the form each writes
    # baddbmm(alibi, q, kᵀ) on (B·h, n, d), viewed as (B, h, n, n_kv) for the causal mask and softmax, back for P·V
    "bloom": ("BloomConfig", dict(hidden_size=32, n_layer=1, n_head=4)),
    # scores on (B·h, n, d) viewed as (B, h, n, n_kv) for the causal mask, clamped at finfo.min, viewed back
    "xglm": ("XGLMConfig", dict(d_model=32, num_layers=1, attention_heads=4, ffn_dim=64)),
    # ALiBi a constant buffer sliced to the length and added to the scores, the causal mask over the sum:
    # where(mask, finfo.min, s + alibi)
    "mpt": ("MptConfig", dict(d_model=32, n_heads=4, n_layers=1, max_seq_len=64)),
}
TOKENS = tuple(LMS)


@functools.cache
def exported(name: str, exporter: str) -> onnx.ModelProto:
    torch.manual_seed(0)
    if name in LMS:
        config, sizes = LMS[name]
        module = CausalLM(config, **sizes).eval()
    else:
        module = {"rotary": WholeHeadRotary, "pooling": PoolingHead}[name]().eval()
    x = torch.randint(0, 128, (2, 7)) if name in TOKENS else torch.randn(2, 7, 32)
    if exporter == "dynamo":
        dims = ({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},)
        return torch.onnx.export(module, (x,), dynamo=True, input_names=["x"], output_names=["y"],
                                 dynamic_shapes=dims).model_proto
    buffer = io.BytesIO()
    torch.onnx.export(module, (x,), buffer, dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "B", 1: "S"}}, opset_version=17)
    return onnx.load_from_string(buffer.getvalue())


def feeds(name: str) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    if name in TOKENS:
        return [{"x": rng.integers(0, 128, shape).astype(np.int64)} for shape in ((2, 7), (1, 12))]
    # (TorchScript writes the pooling head's key length into a Reshape: only its batch varies)
    shapes = ((2, 7, 32), (3, 7 if name == "pooling" else 12, 32))
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for shape in shapes]


@pytest.mark.parametrize("name, exporter", [
    ("rotary", "torchscript"), ("pooling", "torchscript"), ("bloom", "torchscript"), ("xglm", "torchscript"),
    pytest.param("pooling", "dynamo", marks=pytest.mark.slow), pytest.param("bloom", "dynamo", marks=pytest.mark.slow)])
def test_attention_forms_on_kernels(name, exporter):
    imported = assert_matches_ort(exported(name, exporter), feeds(name), attentions=1, softmaxes=1)
    spec = imported.report.replacements[0].spec
    if name == "bloom":  # the heads split back off the (B·h) batches; ALiBi proved slopes·positions; causal proved
        assert (spec.h, spec.causal, spec.alibi, spec.attn_mask) == (4, True, "signed", None)
    if name == "xglm":  # the clamp at finfo.min dropped over a finite mask; the causal rule proved from it
        assert (spec.h, spec.causal, spec.attn_mask) == (4, True, None)


def test_bloom_at_static_shapes_folds_alibi_into_a_constant_it_still_proves():
    """Bound to (2, 7) the ALiBi bias folds into a constant (B·h, 1, n_kv): read back as slopes·positions."""
    feed = feeds("bloom")[0]
    imported = tvmattn.import_onnx(exported("bloom", "torchscript"), shapes={"x": (2, 7)})
    (r,) = {r.spec for r in imported.report.replacements}
    assert (r.alibi, r.attn_mask, r.batch, r.n_q) == ("signed", None, 2, 7), str(imported.report)
    for got, want in zip(imported.run(feed), ort_run(exported("bloom", "torchscript"), feed), strict=True):
        assert errors(got, want)[1] <= 1e-4


@pytest.mark.parametrize("shapes", [{"x": (2, 7)}, None], ids=["bound", "symbolic"])
def test_mpt_masked_fill_over_its_alibi_is_causal_alibi(shapes):
    """MPT (transformers 5, dynamo): where(causal mask, finfo.min, s + alibi): on the kernel with the causal
    rule and the slopes, no tensor mask; against ONNX Runtime. It was left to TVM: the mask over the sum
    matched no form. Symbolic, the ALiBi is its table's keys from max(0, L - n) (dynamo's sym_max), the
    scores and the mask cast to that length; the import stopped at the Max, then left it to TVM."""
    imported = tvmattn.import_onnx(exported("mpt", "dynamo"), shapes=shapes)
    (r,) = {r.spec for r in imported.report.replacements}
    assert (r.causal, r.alibi, r.attn_mask) == (True, "signed", None), str(imported.report)
    assert len(imported.report.replacements) == 1 and not imported.report.left_to_tvm, str(imported.report)
    scores = [f for f in imported.report.rule_of if "matmul" in f and "multiply" in f]  # q·kᵀ·scale, left dead
    assert not scores, scores
    feed = feeds("mpt")[0]
    for got, want in zip(imported.run(feed), ort_run(exported("mpt", "dynamo"), feed), strict=True):
        assert errors(got, want)[1] <= 1e-4


@pytest.mark.parametrize("bias", [
    np.where(np.tri(5, 6, 0, bool), 0, -np.inf),  # a causal mask, -inf or finfo.min: no distance
    np.where(np.tri(5, 6, 0, bool), 0, np.finfo(np.float32).min),
    np.zeros((1, 5, 6)),  # no bias at all
    np.random.default_rng(0).standard_normal((4, 5, 6)),
], ids=["causal-inf", "causal-finfo-min", "zeros", "random"])
def test_a_constant_bias_that_is_not_alibi_stays_a_bias(bias):
    from tvmattn.compiler.onnx.alibi import _constant_slopes

    assert _constant_slopes(np.asarray(bias, np.float32), 4, batched=False) is None
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    bloom = (slopes[:, None, None] * np.arange(6)).astype(np.float32)  # (h, 1, n_kv), as BLOOM's is
    np.testing.assert_array_equal(_constant_slopes(np.tile(bloom, (2, 1, 1)), 4, batched=True), slopes)


def test_zero_size_output():
    """A zero-width slice as a graph output: an empty array, as ONNX Runtime's."""
    nodes = [oh.make_node("Slice", ["x", "s", "e", "a"], ["rest"]), oh.make_node("Relu", ["rest"], ["y"]),
             oh.make_node("Relu", ["x"], ["z"])]
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, ["B", 4, 8])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["B", 4, 0]),
                       oh.make_tensor_value_info("z", TP.FLOAT, ["B", 4, 8])],
                      [nh.from_array(np.array([8], np.int64), "s"), nh.from_array(np.array([2**62], np.int64), "e"),
                       nh.from_array(np.array([-1], np.int64), "a")])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 10
    feed = {"x": np.random.default_rng(1).standard_normal((2, 4, 8)).astype(np.float32)}
    imported = tvmattn.import_onnx(model)
    for got, want in zip(imported.run(feed), ort_run(model, feed), strict=True):
        assert got.shape == want.shape and np.array_equal(got, want)
    assert kernels_used(imported) == 0


def test_graph_input_of_no_onnx_type_is_one_error():
    """An element type no ONNX type has (999, a corrupt file) on an input no node reads."""
    g = oh.make_graph([oh.make_node("Identity", ["x"], ["y"])], "g",
                      [oh.make_tensor_value_info("x", TP.FLOAT, [2]), oh.make_tensor_value_info("z", TP.FLOAT, [2])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [2])])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 10
    model.graph.input[1].type.tensor_type.elem_type = 999
    with pytest.raises(tvmattn.TvmAttnError, match="graph input 'z' has element type 999"):
        tvmattn.import_onnx(model)


def gpt2_optimized(opset: int, padding_mask: bool) -> onnx.ModelProto:
    """One layer of GPT-2's eager attention (transformers 4.x) as ONNX Runtime's transformer optimizer leaves
    it (optimize_model(model_type="gpt2") of a TorchScript export) when it fuses no Attention: the causal
    window ``bias[:, :, k_len - q_len : k_len, :k_len]`` of a tril buffer, k_len from Gather(Shape(k), perm),
    as ORT's transpose optimizer writes Shape(Transpose(k)); where(causal, scores, finfo.min), then (with
    ``padding_mask``) the padding mask (1 - mask)·finfo.min added; the norm before it a LayerNormalization
    in the ONNX domain even below opset 17, where it is ONNX Runtime's contrib op."""
    hidden, heads, width, positions, lowest = 32, 2, 16, 16, float(np.finfo(np.float32).min)
    rng = np.random.default_rng(3)
    consts = {"gamma": 1 + 0.1 * rng.standard_normal(hidden), "beta": 0.1 * rng.standard_normal(hidden),
              "w": rng.standard_normal((hidden, 3 * hidden)) / np.sqrt(hidden),
              "split": np.array([hidden] * 3), "heads_shape": np.array([0, 0, heads, width]),
              "merged_shape": np.array([0, 0, hidden]), "perm": np.array([0, 2, 1, 3]),
              "m2": np.array([-2]), "m1": np.array([-1]), "i0": np.array([0]), "i1": np.array([1]),
              "i2": np.array([2]), "i3": np.array([3]), "i12": np.array([1, 2]), "sqrt_d": np.float32(4.0),
              "one": np.float32(1.0), "lowest": np.float32(lowest),
              "tril": np.tri(positions, dtype=bool)[None, None]}
    initializers = [nh.from_array(v.astype(np.float32) if v.dtype == np.float64 else v, k) for k, v in consts.items()]
    n = oh.make_node
    nodes = [n("LayerNormalization", ["x", "gamma", "beta"], ["ln"], epsilon=1e-5),
             n("MatMul", ["ln", "w"], ["qkv"]), n("Split", ["qkv", "split"], ["q", "k", "v"], axis=2)]
    nodes += [n("Reshape", [t, "heads_shape"], [f"{t}_heads"]) for t in "qkv"]
    nodes += [n("Transpose", ["q_heads"], ["qt"], perm=[0, 2, 1, 3]),
              n("Transpose", ["k_heads"], ["kt"], perm=[0, 2, 3, 1]),
              n("Transpose", ["v_heads"], ["vt"], perm=[0, 2, 1, 3]),
              n("MatMul", ["qt", "kt"], ["qk"]), n("Div", ["qk", "sqrt_d"], ["scores"]),
              n("Shape", ["qt"], ["q_shape"]), n("Slice", ["q_shape", "m2", "m1", "i0"], ["q_len1"]),
              n("Squeeze", ["q_len1", "i0"], ["q_len"]),
              n("Shape", ["k_heads"], ["k_heads_shape"]), n("Gather", ["k_heads_shape", "perm"], ["k_shape"], axis=0),
              n("Slice", ["k_shape", "m2", "m1", "i0"], ["k_len1"]), n("Squeeze", ["k_len1", "i0"], ["k_len"]),
              n("Sub", ["k_len", "q_len"], ["past"]), n("Unsqueeze", ["past", "i0"], ["start"]),
              n("Unsqueeze", ["k_len", "i0"], ["end"]),
              n("Slice", ["tril", "start", "end", "i2", "i1"], ["rows"]),
              n("Slice", ["rows", "i0", "end", "i3", "i1"], ["causal"]),
              n("Where", ["causal", "scores", "lowest"], ["masked"])]
    logits, inputs = "masked", [oh.make_tensor_value_info("x", TP.FLOAT, ["B", "S", hidden])]
    if padding_mask:
        inputs.append(oh.make_tensor_value_info("attention_mask", TP.INT64, ["B", "S"]))
        nodes += [n("Unsqueeze", ["attention_mask", "i12"], ["mask4"]), n("Cast", ["mask4"], ["maskf"], to=TP.FLOAT),
                  n("Sub", ["one", "maskf"], ["hidden_keys"]), n("Mul", ["hidden_keys", "lowest"], ["pad"]),
                  n("Add", ["masked", "pad"], ["padded"])]
        logits = "padded"
    nodes += [n("Softmax", [logits], ["probs"], axis=-1), n("MatMul", ["probs", "vt"], ["o"]),
              n("Transpose", ["o"], ["o_bshd"], perm=[0, 2, 1, 3]), n("Reshape", ["o_bshd", "merged_shape"], ["y"])]
    g = oh.make_graph(nodes, "gpt2_layer", inputs, [oh.make_tensor_value_info("y", TP.FLOAT, ["B", "S", hidden])],
                      initializers)
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("opset", [14, 17])
@pytest.mark.parametrize("padding_mask", [False, True])
def test_gpt2_ort_optimizer_form(opset, padding_mask):
    """An ORT-transformer-optimizer export of GPT-2 from transformers 4.47 (#44): TVM's Gather made the
    key length a tensor, its Sub with the query length a (1,) tensor, the Unsqueeze after it the causal
    Slice's ``starts`` 2-D ("Expected a 1-D tensor, but got ndim=2"); at opset 14 the LayerNormalization
    was refused as no ONNX op. It imports, matches ONNX Runtime, the attention one kernel: causal where
    the buffer is the only mask, the two masks' sum as one additive mask with the padding one (left and
    right padded rows, a row that sees no key)."""
    model = gpt2_optimized(opset, padding_mask)
    rng = np.random.default_rng(0)
    masks = [np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]]), np.array([[0] * 12, [1] * 12, [1] * 12])]
    feeds = [{"x": rng.standard_normal((m.shape[0], m.shape[1], 32)).astype(np.float32),
              **({"attention_mask": m} if padding_mask else {})} for m in masks]
    spec = assert_matches_ort(model, feeds, attentions=1, softmaxes=1).report.replacements[0].spec
    if padding_mask:
        assert (spec.causal, spec.attn_mask, spec.attn_mask_dims) == (False, "additive", "bst")
    else:
        assert (spec.causal, spec.attn_mask) == (True, None)


@pytest.mark.parametrize("fill", [np.finfo(np.float32).min, -np.inf])
def test_a_clamp_at_finfo_min_goes_only_where_it_changes_nothing(fill):
    """softmax(max(q·kᵀ + where(keep, 0, fill), finfo.min)) · v with a query that sees no key: over a finite
    fill the clamp is dropped (a kernel); over -inf it is what gives that row uniform weights (left to TVM)."""
    lowest = np.float32(np.finfo(np.float32).min)
    nodes = [oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), oh.make_node("MatMul", ["q", "kt"], ["s"]),
             oh.make_node("Where", ["keep", "zero", "fill"], ["m"]), oh.make_node("Add", ["s", "m"], ["masked"]),
             oh.make_node("Max", ["masked", "lowest"], ["clamped"]),
             oh.make_node("Softmax", ["clamped"], ["p"], axis=-1), oh.make_node("MatMul", ["p", "v"], ["y"])]
    dims = [2, 2, 5, 8]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info(n, TP.FLOAT, dims) for n in "qkv"]
                          + [oh.make_tensor_value_info("keep", TP.BOOL, [2, 1, 5, 5])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, dims)],
                          [nh.from_array(np.float32(0), "zero"), nh.from_array(np.float32(fill), "fill"),
                           nh.from_array(lowest, "lowest")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    keep = rng.random((2, 1, 5, 5)) < 0.6
    keep[0, 0, 2] = False  # a query that sees no key
    feed = {n: rng.standard_normal(dims).astype(np.float32) for n in "qkv"} | {"keep": keep}
    imported = tvmattn.import_onnx(model)
    assert kernels_used(imported) == (1 if np.isfinite(fill) else 0), str(imported.report)
    assert errors(imported.run(feed)[0], ort_run(model, feed)[0])[1] <= 1e-5


def test_a_softmax_over_another_axis_keeps_its_axis():
    """ConvBERT's span convolution: weights (B·n, taps, 1) softmaxed over the taps (axis 1), then a product."""
    nodes = [oh.make_node("Softmax", ["w"], ["p"], axis=1), oh.make_node("MatMul", ["x", "p"], ["y"])]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, ["m", 8, 9]),
                                       oh.make_tensor_value_info("w", TP.FLOAT, ["m", 9, 1])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, ["m", 8, 1])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    feed = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in (("x", (6, 8, 9)), ("w", (6, 9, 1)))}
    assert errors(tvmattn.import_onnx(model).run(feed)[0], ort_run(model, feed)[0])[1] <= 1e-5
