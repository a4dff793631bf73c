"""Every ONNX op the import treats otherwise than TVM's importer would, in one table: what becomes of
a node of it before, instead of and after TVM's converter.

    OPS[(domain, op type)] = Op(convert=…, fix=…, before=…, checked=…, check_after=…, broadcasting=…,
                                contrib_in_onnx_domain=…)

convert       tvmattn's converter (`converters.Node`, inputs → outputs): the attention ops, and ops TVM
              0.27's importer lacks or gets wrong (`ops`); TVM's converter never sees the node.
fix           (inputs, attrs) → a Relax expression, or None to leave the node to TVM's converter: shape
              arithmetic TVM's converter loses (`shape_ops`), pads computed from it (`pads`).
before        (inputs, attrs) → inputs for TVM's converter (a Concat's empty parts dropped).
checked       CPU targets, where ``fix`` gave None: (bb, node name, inputs, attrs) → the node with its
              index inputs checked when the model runs (`run_checks`), or None: TVM's converter.
check_after   CPU targets: (bb, node name, converted) → it with a run-time check (`run_checks`).
broadcasting  the op broadcasts its inputs: their shapes are stated first (`shape_ops.state_broadcast`).
contrib_in_onnx_domain
              an ONNX Runtime contrib op its transformer optimizer writes in the ONNX domain: ONNX's checker
              reads a copy with it in com.microsoft (`graph.load`). True, or the opset from which ONNX
              defines the same op itself: a contrib op only in a model of a lower opset (ONNX Runtime's
              optimizer fuses GPT-2's and BERT's norms into LayerNormalization whatever the opset).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import onnx
from tvm import tirx

from tvmattn.compiler.onnx import gqa, ops, ort_attention, pads, paged_attention, run_checks, shape_ops
from tvmattn.compiler.onnx.converters import Converter, onnx_attention
from tvmattn.compiler.onnx.graph import DEFAULT_DOMAINS


@dataclass(frozen=True)
class Op:
    convert: Converter | None = None
    fix: Callable | None = None
    before: Callable | None = None
    checked: Callable | None = None
    check_after: Callable | None = None
    broadcasting: bool = False
    contrib_in_onnx_domain: bool | int = False


MS = "com.microsoft"
_BROADCASTING = ("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Where", "Equal", "Less", "LessOrEqual", "Greater",
                 "GreaterOrEqual", "And", "Or", "Xor", "Max", "Min", "Sum", "Mean", "BitShift")

OPS: dict[tuple[str, str], Op] = {
    # attention
    ("", "Attention"): Op(onnx_attention),
    (MS, "Attention"): Op(ort_attention.ms_attention),
    (MS, "MultiHeadAttention"): Op(ort_attention.ms_multi_head_attention),
    (MS, "GroupQueryAttention"): Op(gqa.ms_group_query_attention),
    (MS, "PagedAttention"): Op(paged_attention.ms_paged_attention),
    # norms, GELUs, rotary embeddings
    ("", "RMSNormalization"): Op(ops.rms_normalization),
    ("", "Einsum"): Op(ops.einsum),  # as a batched matmul where it is one (`schedules.ops.einsum`)
    ("", "LayerNormalization"): Op(contrib_in_onnx_domain=17),  # TVM's converter (ONNX's at 17, the same op)
    ("", "SimplifiedLayerNormalization"): Op(ops.simplified_layer_normalization, contrib_in_onnx_domain=True),
    (MS, "SkipLayerNormalization"): Op(ops.skip_layer_normalization),
    (MS, "SkipSimplifiedLayerNormalization"): Op(ops.skip_simplified_layer_normalization),
    (MS, "EmbedLayerNormalization"): Op(ops.embed_layer_normalization),
    (MS, "Gelu"): Op(ops.ms_gelu),
    (MS, "BiasGelu"): Op(ops.bias_gelu),
    (MS, "FastGelu"): Op(ops.fast_gelu),
    (MS, "QuickGelu"): Op(ops.quick_gelu),
    ("", "RotaryEmbedding"): Op(ops.rotary_embedding),
    (MS, "RotaryEmbedding"): Op(ops.ms_rotary_embedding),
    # TVM's converter, around shape arithmetic and index inputs
    ("", "Expand"): Op(fix=shape_ops.expand),
    ("", "Pad"): Op(fix=pads.pad),
    ("", "Range"): Op(fix=shape_ops.range_),
    ("", "Reshape"): Op(fix=shape_ops.reshape),
    ("", "Slice"): Op(fix=shape_ops.slice_, check_after=run_checks.slice_bounds),
    ("", "Concat"): Op(before=lambda inputs, attrs: shape_ops.nonempty(inputs, int(attrs.get("axis", 0)))),
    ("", "Gather"): Op(fix=shape_ops.gather, checked=run_checks.gather),
    ("", "GatherElements"): Op(checked=run_checks.gather_elements),
    ("", "GatherND"): Op(checked=run_checks.gather_nd),
    **{("", name): Op(broadcasting=True, before=shape_ops.scalars_beside_arrays) for name in _BROADCASTING},
    **{("", name): Op(broadcasting=True, before=shape_ops.scalars_beside_arrays, fix=shape_ops.extremum(pick))
       for name, pick in (("Min", tirx.min), ("Max", tirx.max))},
}

# op type → the opset from which ONNX defines it (None: never)
CONTRIB_IN_ONNX_DOMAIN = {op_type: None if op.contrib_in_onnx_domain is True else op.contrib_in_onnx_domain
                          for (_, op_type), op in OPS.items() if op.contrib_in_onnx_domain}
_NONE = Op()


def op_of(domain: str, op_type: str) -> Op:
    """The table's entry for an op (an empty one: TVM's converter as it is)."""
    return OPS.get(("" if domain in DEFAULT_DOMAINS else domain, op_type), _NONE)


def converter(node: onnx.NodeProto) -> Converter | None:
    """tvmattn's converter of ``node``, if it has one."""
    return op_of(node.domain, node.op_type).convert
