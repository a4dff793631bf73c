"""A decoder's KV cache in 16 bits (``import_onnx(..., cache_dtype="bfloat16")``): a one-token step reads
the whole cache, so half its bytes is most of what a 16-bit import can save there.

A cache, as exporters write it, is a graph input (``past_key_0``) concatenated with the step's new keys
into a graph output (``present_key_0``) that the decode loop feeds back as the next step's input. Each
such pair is rewritten in the ONNX graph before the import: the input and the output take the 16-bit
dtype, the new keys are cast to it before the Concat, and the graph's own readers of the Concat (the
attention's K or V) read it cast back to fp32: the same graph with the cache rounded to 16 bits. The
attention kernels of a 16-bit import then read the concatenated cache as it is (`schedules.ops.precision`: a cast back
to the dtype it came from is no cast), so no step converts the cache again.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from tvmattn.compiler.errors import TvmAttnError

ELEM_TYPES = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16}


def caches_in(proto: onnx.ModelProto, dtype: str) -> tuple[onnx.ModelProto, list[tuple[str, str]]]:
    """``proto`` with every KV cache pair (fp32 graph input → Concat → graph output) stored in ``dtype``,
    and the pairs' (input, output) names. A model without one is an error: the caller asked for a cache."""
    if dtype not in ELEM_TYPES:
        raise TvmAttnError(f"cache_dtype={dtype!r}: use 'bfloat16' or 'float16' (or None: the model's own)")
    elem = ELEM_TYPES[dtype]
    g = proto.graph
    initializers = {t.name for t in g.initializer}
    inputs = {i.name: i for i in g.input if i.name not in initializers}
    outputs = {o.name: o for o in g.output}
    producer = {o: n for n in g.node for o in n.output}
    pairs: dict[str, str] = {}  # the cache's Concat output → the graph input it extends
    passing: set[str] = set()  # names between the two (an exporter's one-input Concat or Identity)
    for node in g.node:
        if node.op_type != "Concat" or node.output[0] not in outputs or not _float(outputs[node.output[0]]):
            continue
        for name in node.input:
            chain = []
            while name in producer and _passes_through(producer[name]):
                chain.append(name)
                name = producer[name].input[0]
            if name in inputs and _float(inputs[name]):
                pairs[node.output[0]] = name
                passing.update(chain)
                break
    if not pairs:
        raise TvmAttnError(f"cache_dtype={dtype!r}, but the model has no KV cache to store in it (a float32 "
                           f"graph input concatenated into a graph output, as past_* → present_*): drop "
                           f"cache_dtype")
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    g = out.graph
    pasts, sixteen = set(pairs.values()), set(pairs) | set(pairs.values()) | passing
    for info in [*g.input, *g.output]:
        if info.name in pasts or info.name in pairs:
            info.type.tensor_type.elem_type = elem
    for info in list(g.value_info):  # the declared types of what is now 16-bit go: inference redoes them
        if info.name in sixteen:
            g.value_info.remove(info)
    nodes: list[onnx.NodeProto] = []
    wide: dict[str, str] = {}  # a 16-bit name → its fp32 cast, made once

    def widened(name: str) -> str:
        if name not in wide:
            wide[name] = f"{name}/float32"
            nodes.append(helper.make_node("Cast", [name], [wide[name]], to=TensorProto.FLOAT,
                                          name=f"{name}/cast_to_float32"))
        return wide[name]

    for node in g.node:
        if node.op_type == "Concat" and node.output[0] in pairs:
            for i, name in enumerate(node.input):
                if name not in sixteen:  # the step's new keys, rounded as the cache will hold them
                    nodes.append(helper.make_node("Cast", [name], [f"{name}/{dtype}"], to=elem,
                                                  name=f"{name}/cast_to_{dtype}"))
                    node.input[i] = f"{name}/{dtype}"
        elif not (node.output[0] in passing or node.op_type == "Shape"):
            for i, name in enumerate(node.input):  # the graph's own readers of the cache read it in fp32
                if name in sixteen:
                    node.input[i] = widened(name)
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    return out, [(past, present) for present, past in pairs.items()]


def _passes_through(node: onnx.NodeProto) -> bool:
    """A node that hands its one input on unchanged (the torchscript exporter's one-input Concat)."""
    return node.op_type in ("Identity", "Concat") and len(node.input) == 1


def _float(info: onnx.ValueInfoProto) -> bool:
    return info.type.tensor_type.elem_type == TensorProto.FLOAT
