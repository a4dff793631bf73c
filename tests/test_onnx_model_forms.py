"""Forms of attention and of graphs from models outside the test matrix, each a small reproduction against
ONNX Runtime: a rotary over the whole head (a zero-width slice concatenated back), attention on (B·h, n, d)
batches (torch.nn.MultiheadAttention's own form as a pooling head; BLOOM's baddbmm with ALiBi), zero-size
outputs, and a corrupt input type."""

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


class Bloom(nn.Module):
    """A one-layer BLOOM (random weights): baddbmm(alibi, q, kᵀ) on (B·h, n, d), viewed as (B, h, n, n_kv)
    for the causal mask and softmax, then back for P·V."""

    def __init__(self):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        cfg = transformers.BloomConfig(vocab_size=128, hidden_size=32, n_layer=1, n_head=4)
        self.model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


@functools.cache
def exported(name: str, exporter: str) -> onnx.ModelProto:
    torch.manual_seed(0)
    module = {"rotary": WholeHeadRotary, "pooling": PoolingHead, "bloom": Bloom}[name]().eval()
    x = torch.randint(0, 128, (2, 7)) if name == "bloom" else torch.randn(2, 7, 32)
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
    if name == "bloom":
        return [{"x": rng.integers(0, 128, shape).astype(np.int64)} for shape in ((2, 7), (1, 12))]
    # (TorchScript writes the pooling head's key length into a Reshape: only its batch varies)
    shapes = ((2, 7, 32), (3, 7 if name == "pooling" else 12, 32))
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for shape in shapes]


@pytest.mark.parametrize("name, exporter", [
    ("rotary", "torchscript"), ("pooling", "torchscript"), ("bloom", "torchscript"),
    pytest.param("pooling", "dynamo", marks=pytest.mark.slow), pytest.param("bloom", "dynamo", marks=pytest.mark.slow)])
def test_attention_forms_on_kernels(name, exporter):
    imported = assert_matches_ort(exported(name, exporter), feeds(name), attentions=1, softmaxes=1)
    spec = imported.report.replacements[0].spec
    if name == "bloom":  # the heads split back off the (B·h) batches; ALiBi proved slopes·positions; causal proved
        assert (spec.h, spec.causal, spec.alibi, spec.attn_mask) == (4, True, "signed", None)


def test_bloom_at_static_shapes_folds_alibi_into_a_constant_it_still_proves():
    """Bound to (2, 7) the ALiBi bias folds into a constant (B·h, 1, n_kv): read back as slopes·positions."""
    feed = feeds("bloom")[0]
    imported = tvmattn.import_onnx(exported("bloom", "torchscript"), shapes={"x": (2, 7)})
    (r,) = {r.spec for r in imported.report.replacements}
    assert (r.alibi, r.attn_mask, r.batch, r.n_q) == ("signed", None, 2, 7), str(imported.report)
    for got, want in zip(imported.run(feed), ort_run(exported("bloom", "torchscript"), feed), strict=True):
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
