"""Small real-world attention blocks as ONNX models, built with ``onnx.helper`` (seeded random weights,
nothing downloaded), written the way exporters write them: decomposed ops, shapes computed from
``Shape``, masks through Where/Expand chains. Batch and sequence dimensions are symbolic.

    gpt2_block         causal self-attention, fused QKV projection, causal mask sliced from a
                       constant tril buffer and applied with Where(…, finfo.min) (HF GPT-2)
    bert_block         bidirectional, padding mask (B, n) of 1/0 → additive (1 - m)·finfo.min (HF BERT)
    llama_block        GQA (repeat_kv: Unsqueeze → Expand → Reshape), rotary embeddings and an additive
                       causal mask from position_ids (HF Llama as optimum exports it)
    cross_attention_block   queries from x, keys/values from an encoder memory (T5 / Whisper decoder)

Each has one attention; `ATTENTIONS` says so, for tests and examples.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT_MIN = float(np.finfo(np.float32).min)


class _Graph:
    """A graph under construction: ``op`` adds a node and returns its output name."""

    def __init__(self, name: str, seed: int) -> None:
        self.name, self.rng = name, np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []

    def input(self, name: str, elem: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def const(self, name: str, value) -> str:
        taken = {t.name for t in self.inits}
        unique, i = name, 1
        while unique in taken:
            unique, i = f"{name}_{i}", i + 1
        self.inits.append(numpy_helper.from_array(np.asarray(value), unique))
        return unique

    def weight(self, name: str, rows: int, cols: int) -> str:
        return self.const(name, (self.rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32))

    def bias(self, name: str, size: int) -> str:
        return self.const(name, (0.1 * self.rng.standard_normal(size)).astype(np.float32))

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        out = f"{op_type.lower()}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"{op_type}_{len(self.nodes)}", **attrs))
        return out

    def linear(self, x: str, name: str, rows: int, cols: int, bias: bool = True) -> str:
        y = self.op("MatMul", x, self.weight(f"{name}.weight", rows, cols))
        return self.op("Add", y, self.bias(f"{name}.bias", cols)) if bias else y

    def dim(self, x: str, axis: int) -> str:
        """Size ``axis`` of ``x`` as a 1-element int64 tensor (Shape → Slice)."""
        return self.op("Shape", x, start=axis, end=axis + 1)

    def size(self, x: str, axis: int) -> str:
        """Size ``axis`` of ``x`` as a scalar (Shape → Gather), for arithmetic as TorchScript writes it."""
        return self.op("Gather", self.op("Shape", x), self.const("index", np.int64(axis)), axis=0)

    def vector(self, scalar: str) -> str:
        return self.op("Unsqueeze", scalar, self.const("axis0", np.array([0])))

    def split_heads(self, x: str, heads: int, width: int) -> str:
        """(B, n, heads·width) → (B, heads, n, width)."""
        shape = self.op("Concat", self.dim(x, 0), self.dim(x, 1), self.const(f"heads{len(self.nodes)}",
                                                                          np.array([heads, width])), axis=0)
        return self.op("Transpose", self.op("Reshape", x, shape), perm=[0, 2, 1, 3])

    def merge_heads(self, o: str, d_model: int) -> str:
        """(B, h, n, d) → (B, n, h·d)."""
        o = self.op("Transpose", o, perm=[0, 2, 1, 3])
        shape = self.op("Concat", self.dim(o, 0), self.dim(o, 1), self.const(f"width{len(self.nodes)}",
                                                                          np.array([d_model])), axis=0)
        return self.op("Reshape", o, shape)

    def model(self, outputs: list[tuple[str, list]], opset: int = 17) -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in outputs]
        graph = helper.make_graph(self.nodes, self.name, self.inputs, outs, initializer=self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                  producer_name="tvmattn.models")
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


def _attend(g: _Graph, q: str, k_t: str, v: str, d_k: int, mask: Callable[[str], str] | None) -> str:
    """softmax(mask(q·kᵀ / √d_k))·v with q (B, h, n, d_k), k_t (B, h, d_k, n_kv), v (B, h, n_kv, d_v)."""
    scores = g.op("Div", g.op("MatMul", q, k_t), g.const(f"sqrt_dk{len(g.nodes)}", np.float32(np.sqrt(d_k))))
    if mask is not None:
        scores = mask(scores)
    return g.op("MatMul", g.op("Softmax", scores, axis=-1), v)


def gpt2_block(d_model: int = 64, heads: int = 4, max_len: int = 256, seed: int = 0) -> onnx.ModelProto:
    """x (batch, seq, d) → c_proj(causal attention(c_attn(x))) + x."""
    g, d_k = _Graph("gpt2_block", seed), d_model // heads
    x = g.input("x", TensorProto.FLOAT, ["batch", "seq", d_model])
    q, k, v = (f"qkv_{i}" for i in range(3))
    g.nodes.append(helper.make_node("Split", [g.linear(x, "c_attn", d_model, 3 * d_model),
                                              g.const("split", np.array([d_model] * 3))], [q, k, v],
                                    name="Split_qkv", axis=2))
    q, k, v = (g.split_heads(t, heads, d_k) for t in (q, k, v))
    k_t = g.op("Transpose", k, perm=[0, 1, 3, 2])
    tril = np.tril(np.ones((max_len, max_len), dtype=bool))[None, None]

    def causal(scores: str) -> str:  # bias[:, :, n_kv - n : n_kv, :n_kv], as GPT-2 slices its buffer
        n, n_kv = g.size(q, 2), g.size(k, 2)
        start, end = g.vector(g.op("Sub", n_kv, n)), g.vector(n_kv)
        keep = g.op("Slice", g.const("bias", tril), start, end, g.const("axis2", np.array([2])))
        keep = g.op("Slice", keep, g.const("zero", np.array([0])), end, g.const("axis3", np.array([3])))
        return g.op("Where", keep, scores, g.const("mask_value", np.float32(FLOAT_MIN)))

    o = _attend(g, q, k_t, v, d_k, causal)
    y = g.linear(g.merge_heads(o, d_model), "c_proj", d_model, d_model)
    return g.model([(g.op("Add", y, x), ["batch", "seq", d_model])])


def bert_block(d_model: int = 64, heads: int = 4, seed: int = 0) -> onnx.ModelProto:
    """x (batch, seq, d), attention_mask (batch, seq) int64 1/0 → LayerNorm(x + dense(attention))."""
    g, d_k = _Graph("bert_block", seed), d_model // heads
    x = g.input("x", TensorProto.FLOAT, ["batch", "seq", d_model])
    m = g.input("attention_mask", TensorProto.INT64, ["batch", "seq"])
    q, k, v = (g.split_heads(g.linear(x, name, d_model, d_model), heads, d_k) for name in ("query", "key", "value"))

    def padding(scores: str) -> str:  # (1 - m[:, None, None, :]) · finfo.min
        ext = g.op("Cast", g.op("Unsqueeze", m, g.const("axes12", np.array([1, 2]))), to=TensorProto.FLOAT)
        ext = g.op("Mul", g.op("Sub", g.const("one", np.float32(1.0)), ext), g.const("min", np.float32(FLOAT_MIN)))
        return g.op("Add", scores, ext)

    o = _attend(g, q, g.op("Transpose", k, perm=[0, 1, 3, 2]), v, d_k, padding)
    y = g.op("Add", g.linear(g.merge_heads(o, d_model), "dense", d_model, d_model), x)
    y = g.op("LayerNormalization", y, g.const("ln.weight", np.ones(d_model, np.float32)),
             g.const("ln.bias", np.zeros(d_model, np.float32)), axis=-1)
    return g.model([(y, ["batch", "seq", d_model])])


def llama_block(d_model: int = 64, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> onnx.ModelProto:
    """x (batch, seq, d), position_ids (batch, seq) int64 → o_proj(causal GQA with rotary embeddings) + x.

    As optimum exports Llama: positions are an input, rotary angles and the causal mask derive from them.
    """
    g, d_k = _Graph("llama_block", seed), d_model // heads
    x = g.input("x", TensorProto.FLOAT, ["batch", "seq", d_model])
    pos = g.input("position_ids", TensorProto.INT64, ["batch", "seq"])
    q = g.split_heads(g.linear(x, "q_proj", d_model, heads * d_k, bias=False), heads, d_k)
    k = g.split_heads(g.linear(x, "k_proj", d_model, kv_heads * d_k, bias=False), kv_heads, d_k)
    v = g.split_heads(g.linear(x, "v_proj", d_model, kv_heads * d_k, bias=False), kv_heads, d_k)
    inv_freq = (1.0 / 10000 ** (np.arange(0, d_k, 2) / d_k)).astype(np.float32)
    pos_f = g.op("Cast", pos, to=TensorProto.FLOAT)
    freqs = g.op("Mul", g.op("Unsqueeze", pos_f, g.const("last", np.array([-1]))), g.const("inv_freq", inv_freq))
    angles = g.op("Unsqueeze", g.op("Concat", freqs, freqs, axis=-1), g.const("axis1", np.array([1])))
    cos, sin = g.op("Cos", angles), g.op("Sin", angles)  # (B, 1, n, d_k)
    half = g.const("half", np.array([d_k // 2, d_k // 2]))

    def rotary(t: str) -> str:  # t·cos + rotate_half(t)·sin
        lo, hi = f"{t}_lo", f"{t}_hi"
        g.nodes.append(helper.make_node("Split", [t, half], [lo, hi], name=f"Split_{t}", axis=-1))
        rotated = g.op("Concat", g.op("Neg", hi), lo, axis=-1)
        return g.op("Add", g.op("Mul", t, cos), g.op("Mul", rotated, sin))

    q, k = rotary(q), rotary(k)
    group = heads // kv_heads

    def repeat_kv(t: str) -> str:  # t[:, :, None].expand(B, h_kv, g, n, d).reshape(B, h, n, d)
        batch, seq = g.dim(t, 0), g.dim(t, 2)
        wide = g.op("Concat", batch, g.const("hkv_g", np.array([kv_heads, group])), seq,
                    g.const("dk", np.array([d_k])), axis=0)
        t = g.op("Expand", g.op("Unsqueeze", t, g.const("axis2", np.array([2]))), wide)
        shape = g.op("Concat", batch, g.const("h", np.array([heads])), seq, g.const("dk", np.array([d_k])), axis=0)
        return g.op("Reshape", t, shape)

    k, v = repeat_kv(k), repeat_kv(v)

    def causal(scores: str) -> str:  # finfo.min where key position > query position, added
        later = g.op("Greater", g.op("Unsqueeze", pos, g.const("keys", np.array([1]))),
                     g.op("Unsqueeze", pos, g.const("queries", np.array([2]))))
        bias = g.op("Where", later, g.const("fmin", np.float32(FLOAT_MIN)), g.const("fzero", np.float32(0.0)))
        return g.op("Add", scores, g.op("Unsqueeze", bias, g.const("heads_axis", np.array([1]))))

    o = _attend(g, q, g.op("Transpose", k, perm=[0, 1, 3, 2]), v, d_k, causal)
    y = g.linear(g.merge_heads(o, d_model), "o_proj", heads * d_k, d_model, bias=False)
    return g.model([(g.op("Add", y, x), ["batch", "seq", d_model])])


def cross_attention_block(d_model: int = 64, heads: int = 4, seed: int = 0) -> onnx.ModelProto:
    """x (batch, seq, d), memory (batch, mem_seq, d) → out_proj(attention(q(x), k(memory), v(memory)))."""
    g, d_k = _Graph("cross_attention_block", seed), d_model // heads
    x = g.input("x", TensorProto.FLOAT, ["batch", "seq", d_model])
    mem = g.input("memory", TensorProto.FLOAT, ["batch", "mem_seq", d_model])
    q = g.split_heads(g.linear(x, "q", d_model, d_model), heads, d_k)
    k = g.split_heads(g.linear(mem, "k", d_model, d_model), heads, d_k)
    v = g.split_heads(g.linear(mem, "v", d_model, d_model), heads, d_k)
    o = _attend(g, q, g.op("Transpose", k, perm=[0, 1, 3, 2]), v, d_k, None)
    return g.model([(g.linear(g.merge_heads(o, d_model), "out", d_model, d_model), ["batch", "seq", d_model])])


BUILDERS: dict[str, Callable[..., onnx.ModelProto]] = {
    "gpt2": gpt2_block, "bert": bert_block, "llama": llama_block, "cross": cross_attention_block}
ATTENTIONS = {"gpt2": 1, "bert": 1, "llama": 1, "cross": 1}  # attention subgraphs in each model
