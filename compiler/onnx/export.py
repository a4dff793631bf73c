"""An AttentionSpec as a standard ONNX model: ONNX's ``Attention`` op (opset ≥ 23), or the decomposed
MatMul/Softmax graph older runtimes need (opset 17). The full layer carries its weights as initializers.

    model, weights = export_onnx(spec, opset=23)   # weights: {"w_q": …} as the kernel takes them
    model = peer_model(spec, "bool")               # the core as one Attention node over q, k, v and a mask M

Graph inputs are the kernel's arguments (x[, x_kv] or q, k, v; kv_lens; attn_mask), with symbolic
sizes as named dimensions. Masks the ``Attention`` op has no attribute for (bottom-right alignment,
windows, key padding) are written out as a bool mask computed from positions. Where every key of a
row is masked ONNX Runtime gives NaN; the kernel gives zeros.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tvmattn.compiler import variant
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.kernel import numpy_dtype
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.verify import random_inputs

_ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
         "int32": TensorProto.INT32, "bool": TensorProto.BOOL}


def export_onnx(spec: AttentionSpec, opset: int = 23, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The attention of ``spec`` as an ONNX model, and the weights it holds (seeded random)."""
    spec.validate()
    if opset != 17 and opset < 23:
        raise TvmAttnError(f"--opset {opset}: use 23 or later (the Attention op) or 17 (decomposed ops)")
    if spec.output != "attn":
        raise TvmAttnError(f"output={spec.output!r}: only the attention output exports")
    if spec.sinks:
        raise TvmAttnError("sinks=True: ONNX's Attention has no sink logits (ONNX Runtime's GroupQueryAttention "
                           "takes them as head_sink)")
    weights = {n: a for n, a in random_inputs(spec, _sizes(spec), seed).items() if n.startswith("w_")}
    return _Builder(spec, opset).build(weights), weights


def peer_model(spec: AttentionSpec, mask: str | None) -> onnx.ModelProto:
    """The core of ``spec`` (BHSD) as one ONNX ``Attention`` node (opset 23), for the benchmark's ONNX
    Runtime peer: inputs q, k, v and, where ``mask`` says, M, the mask with every rule the spec has
    ("bool": True attends, "additive": float32 added); without one, ``is_causal`` where the spec is causal."""
    b = _Builder(spec, 23)
    keep, bias = ("M", None) if mask == "bool" else (None, "M") if mask == "additive" else (None, None)
    b.attention_op("q", "k", "v", keep, bias, "BHSD", causal=mask is None and spec.causal)
    b.nodes[-1].output[0] = "out"
    shapes = spec.input_shapes()
    inputs = [helper.make_tensor_value_info(n, b.elem, list(shapes[n])) for n in ("q", "k", "v")]
    if mask is not None:
        inputs.append(helper.make_tensor_value_info("M", _ELEM["bool" if mask == "bool" else "float32"], None))
    out = helper.make_tensor_value_info("out", b.elem, list(spec.output_shape()))
    return helper.make_model(helper.make_graph(b.nodes, "attention", inputs, [out], initializer=b.inits),
                             opset_imports=[helper.make_opsetid("", 23)])


def _sizes(spec: AttentionSpec) -> dict[str, int]:
    return {name: 1 for name in spec.symbolic_dims}  # weights do not depend on them


class _Builder:
    def __init__(self, spec: AttentionSpec, opset: int) -> None:
        self.spec, self.opset = spec, opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.elem = _ELEM[spec.dtype]

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        out = f"{op_type.lower()}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"{op_type}_{len(self.nodes)}",
                                           **attrs))
        return out

    def const(self, value, name: str | None = None) -> str:
        name = name or f"const_{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def build(self, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
        spec = self.spec
        shapes = spec.input_shapes()
        inputs = [helper.make_tensor_value_info(n, _ELEM[spec.input_dtype(n)], list(s))
                  for n, s in shapes.items() if not n.startswith("w_")]
        for name, w in weights.items():
            self.const(w, name)
        if spec.projections:
            x, x_kv = "x", "x_kv" if spec.is_cross else "x"
            q, k, v = (self.op("MatMul", src, w) for src, w in ((x, "w_q"), (x_kv, "w_k"), (x_kv, "w_v")))
            self.op("MatMul", self.attention(q, k, v, "BSH"), "w_o")
        else:
            self.attention("q", "k", "v", spec.layout)
        self.nodes[-1].output[0] = "out"  # the last node's output is the model's
        out = helper.make_tensor_value_info("out", self.elem, list(spec.output_shape()))
        graph = helper.make_graph(self.nodes, "tvmattn_attention", inputs, [out], initializer=self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)],
                                  producer_name="tvmattn", doc_string=spec.describe())
        model.ir_version = 10 if self.opset >= 23 else 8
        onnx.checker.check_model(model)
        return model

    # ---- the attention: (B, n, h·d) "BSH", or 4-D in the spec's layout ------------------------------
    def attention(self, q: str, k: str, v: str, layout: str) -> str:
        spec = self.spec
        if layout == "BSHD":
            q, k, v = (self.op("Transpose", t, perm=[0, 2, 1, 3]) for t in (q, k, v))
        keep, bias = self.mask(structural=self.opset < 23 or not variant.plain_causal(self.spec))
        if self.opset >= 23:
            o = self.attention_op(q, k, v, keep, bias, layout)
        else:
            if layout == "BSH":
                q, k, v = (self.split(t, h, d) for t, h, d in ((q, spec.h, spec.d_k), (k, spec.h_kv, spec.d_k),
                                                                (v, spec.h_kv, spec.d_v)))
            o = self.decomposed(q, k, v, keep, bias)
            if layout == "BSH":
                o = self.merge(o)
        return self.op("Transpose", o, perm=[0, 2, 1, 3]) if layout == "BSHD" else o

    def attention_op(self, q, k, v, keep: str | None, bias: str | None, layout: str,
                     causal: bool | None = None) -> str:
        """The ``Attention`` node; ``causal``: its is_causal (default: where the spec is plainly causal)."""
        spec = self.spec
        attrs = {"scale": spec.softmax_scale}
        if layout == "BSH":
            attrs.update(q_num_heads=spec.h, kv_num_heads=spec.h_kv)
        if spec.softcap is not None:
            attrs["softcap"] = spec.softcap
        mask = keep
        if bias is not None:
            if spec.dtype != "float32":
                bias = self.op("Cast", bias, to=self.elem)
            hidden = self.const(np.array(-np.inf, dtype=numpy_dtype(spec.dtype)))
            mask = bias if keep is None else self.op("Where", keep, bias, hidden)
        if variant.plain_causal(self.spec) if causal is None else causal:
            attrs["is_causal"] = 1
        return self.op("Attention", q, k, v, *([mask] if mask else []), **attrs)

    def decomposed(self, q, k, v, keep: str | None, bias: str | None) -> str:
        """softmax(cap(scale·q·kᵀ) + mask)·v, q (B, h, n, d_k), k/v (B, h_kv, n_kv, ·)."""
        spec = self.spec
        if spec.group > 1:
            k, v = self.repeat(k, spec.d_k), self.repeat(v, spec.d_v)
        s = self.op("Mul", self.op("MatMul", q, self.op("Transpose", k, perm=[0, 1, 3, 2])),
                    self.const(np.array(spec.softmax_scale, dtype=numpy_dtype(spec.dtype))))
        if spec.softcap is not None:
            cap = self.const(np.array(spec.softcap, dtype=numpy_dtype(spec.dtype)))
            s = self.op("Mul", self.op("Tanh", self.op("Div", s, cap)), cap)
        if bias is not None:
            s = self.op("Add", s, self.op("Cast", bias, to=self.elem))
        if keep is not None:
            s = self.op("Where", keep, s, self.const(np.array(-np.inf, dtype=numpy_dtype(spec.dtype))))
        return self.op("MatMul", self.op("Softmax", s, axis=-1), v)

    # ---- masks ---------------------------------------------------------------------------------------
    def mask(self, structural: bool) -> tuple[str | None, str | None]:
        """The bool keep-mask (the position rules when ``structural``, and a bool attn_mask) and the
        additive attn_mask."""
        spec = self.spec
        keep = None
        if structural and variant.has_position_rules(spec):
            keep = self.positions()
        bias = None
        if spec.attn_mask == "bool":
            keep = "attn_mask" if keep is None else self.op("And", keep, "attn_mask")
        elif spec.attn_mask == "additive":
            bias = "attn_mask"
        return keep, bias

    def positions(self) -> str:
        """(B|1, 1, n, n_kv) bool: the spec's position rules (`variant.visible`) as ONNX nodes."""
        spec = self.spec
        src_q = "x" if spec.projections else "q"
        src_kv = ("x_kv" if spec.is_cross else "x") if spec.projections else "k"
        q_axis = 1 if spec.projections or spec.layout == "BSHD" else 2
        n = self.op("Gather", self.op("Shape", src_q), self.const(np.int64(q_axis)), axis=0)
        n_kv = self.op("Gather", self.op("Shape", src_kv), self.const(np.int64(q_axis)), axis=0)
        zero, one = self.const(np.int64(0)), self.const(np.int64(1))
        i = self.op("Unsqueeze", self.op("Range", zero, n, one), self.const(np.array([1])))  # (n, 1)
        j = self.op("Unsqueeze", self.op("Range", zero, n_kv, one), self.const(np.array([0])))  # (1, n_kv)
        length = n_kv
        if spec.key_padding:  # (B, 1, 1, 1)
            length = self.op("Reshape", self.op("Cast", "kv_lens", to=TensorProto.INT64),
                             self.const(np.array([-1, 1, 1, 1])))
        keep = variant.visible(spec, _Value(self, i), _Value(self, j), _Value(self, length), _Value(self, n),
                               lambda rules: functools.reduce(lambda a, b: a & b, rules)).name
        return keep if spec.key_padding else self.op("Unsqueeze", keep, self.const(np.array([0, 1])))

    # ---- head split, merge, repeat ---------------------------------------------------------------------
    def split(self, t: str, heads: int, width: int) -> str:
        return self.op("Transpose", self.op("Reshape", t, self.const(np.array([0, 0, heads, width]))),
                       perm=[0, 2, 1, 3])

    def merge(self, o: str) -> str:
        spec = self.spec
        return self.op("Reshape", self.op("Transpose", o, perm=[0, 2, 1, 3]),
                       self.const(np.array([0, 0, spec.h * spec.d_v])))

    def repeat(self, t: str, width: int) -> str:
        """(B, h_kv, n, d) → (B, h, n, d), head i reading i // group, as HF's repeat_kv."""
        spec = self.spec
        shape = self.op("Shape", t)
        batch = self.op("Slice", shape, self.const(np.array([0])), self.const(np.array([1])))
        seq = self.op("Slice", shape, self.const(np.array([2])), self.const(np.array([3])))
        wide = self.op("Concat", batch, self.const(np.array([spec.h_kv, spec.group])), seq,
                       self.const(np.array([width])), axis=0)
        t = self.op("Expand", self.op("Unsqueeze", t, self.const(np.array([2]))), wide)
        return self.op("Reshape", t, self.op("Concat", batch, self.const(np.array([spec.h])), seq,
                                             self.const(np.array([width])), axis=0))


class _Value:
    """An int64 ONNX value whose Python operators add nodes: the variant's position rules, written
    with operators, build the graph unchanged."""

    def __init__(self, builder: _Builder, name: str) -> None:
        self.builder, self.name = builder, name

    def _apply(self, op_type: str, other) -> "_Value":
        rhs = other.name if isinstance(other, _Value) else self.builder.const(np.int64(other))
        return _Value(self.builder, self.builder.op(op_type, self.name, rhs))


_OPERATORS = {"__add__": "Add", "__sub__": "Sub", "__mul__": "Mul", "__floordiv__": "Div", "__mod__": "Mod",
              "__lt__": "Less", "__le__": "LessOrEqual", "__gt__": "Greater", "__ge__": "GreaterOrEqual",
              "__eq__": "Equal", "__and__": "And", "__or__": "Or"}  # Div and Mod floor on the non-negative positions
for _name, _op_type in _OPERATORS.items():
    setattr(_Value, _name, lambda self, other, _op_type=_op_type: self._apply(_op_type, other))
