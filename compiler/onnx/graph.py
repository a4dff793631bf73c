"""Reading an ONNX model before TVM sees it: load and check it, name its nodes, fold what is static.

Exporters spell shapes as graphs (Shape → Gather → Concat → Reshape; Sqrt(Cast(Shape)) for 1/√d_k;
Range/Less/Where for a causal mask). Where the shapes are static, `fold_static` evaluates those
subgraphs with ONNX's reference implementation and leaves constants, which TVM's importer handles
and in which the attention patterns can read a scale or a causal mask.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from tvmattn.compiler.errors import TvmAttnError, first_line

DEFAULT_DOMAINS = ("", "ai.onnx")
# Ops whose value is not a function of their inputs, or which hold subgraphs: never folded.
_NOT_FOLDABLE = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
                 "Multinomial", "If", "Loop", "Scan", "Dropout"}
_FOLD_LIMIT_BYTES = 64 << 20  # a folded value larger than this stays a computation
_PROTOBUF_LIMIT = 2**31 - 1  # a serialised ModelProto must stay under it


@dataclass(frozen=True)
class Checked:
    """An ONNX model `load` read and checked: handing it on (to `import_onnx`) skips a second check."""

    proto: onnx.ModelProto


def load(model: Any, contrib_in_onnx_domain: Mapping[str, int | None] | None = None) -> Checked:
    """An ONNX model from a path, bytes, a ModelProto (or a `Checked` one, returned as it is), checked;
    TvmAttnError if it is not one. ``contrib_in_onnx_domain``: ONNX Runtime contrib ops its transformer
    optimizer writes in the ONNX domain, each with the opset from which ONNX defines an op of that name
    (None: never; below it the op is ONNX Runtime's). ONNX's checker knows no such op: it checks a copy
    with them in com.microsoft, a domain it does not look into; the model keeps them where ONNX Runtime
    finds them."""
    if isinstance(model, Checked):
        return model
    if isinstance(model, onnx.ModelProto):
        proto = model
    elif isinstance(model, (bytes, bytearray)):
        proto = _parse(bytes(model), "the given bytes")
    elif isinstance(model, (str, os.PathLike)):
        try:
            with open(model, "rb") as f:
                data = f.read()
        except OSError as err:
            raise TvmAttnError(f"cannot read ONNX model {os.fspath(model)!r}: {err.strerror}") from None
        proto = _parse(data, repr(os.fspath(model)))
        _load_external_data(proto, os.path.dirname(os.path.abspath(model)))
    else:
        raise TvmAttnError(f"import_onnx takes a path, bytes or an onnx.ModelProto, not {type(model).__name__}")
    external = _external_files(proto)
    if external:  # bytes or a ModelProto: there is no folder to read the side files from
        raise TvmAttnError(f"the model keeps its weights in external data ({external[0]!r}): import it from "
                           f"its path, import_onnx('model.onnx'), so the side files are read next to it")
    checked = _in_their_domain(proto, contrib_in_onnx_domain or {})
    try:
        # a model over protobuf's 2 GB limit is checked from its file (weights in side files are not read)
        big = isinstance(model, (str, os.PathLike)) and proto.ByteSize() >= _PROTOBUF_LIMIT
        onnx.checker.check_model(os.fspath(model) if big and checked is proto else checked)
    except (onnx.checker.ValidationError, ValueError) as err:
        first = first_line(err)
        raise TvmAttnError(f"not a valid ONNX model ({first}): re-export it, or check it with "
                           f"onnx.checker.check_model") from None
    if not proto.graph.node:
        raise TvmAttnError("the ONNX graph has no nodes: is the file complete?")
    _check_input_types(proto.graph)
    # ONNX Runtime rejects a graph whose shapes or types contradict each other; so do we, by name. ONNX's
    # data propagation finds more contradictions but fails on some sound graphs of its own (a Shape in
    # both branches of an If, as optimum's merged decoders have: "Data for input 0 already exists"), so
    # a model is refused only when the plain strict inference refuses it too
    for data_prop in (True, False):
        try:
            onnx.shape_inference.infer_shapes(checked, check_type=True, strict_mode=True, data_prop=data_prop)
            return Checked(proto)
        except _INFERENCE_ERRORS as err:
            first = first_line(err)
    raise TvmAttnError(f"the model's shapes or types are inconsistent ({first}): re-export it, or check "
                       f"it with onnx.shape_inference.infer_shapes(model, strict_mode=True)") from None


def _check_input_types(g: onnx.GraphProto) -> None:
    """Every graph input of a tensor type names an ONNX element type (ONNX's checker and shape inference pass
    one that no node reads; a corrupt file can hold any number)."""
    known = set(onnx.TensorProto.DataType.values())
    for info in g.input:
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type not in known:
            raise TvmAttnError(f"graph input {info.name!r} has element type {info.type.tensor_type.elem_type}, "
                               f"which is no ONNX tensor type: the file is corrupt; re-export it")


_INFERENCE_ERRORS = (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, ValueError, RuntimeError)


def _in_their_domain(model: onnx.ModelProto, contrib: Mapping[str, int | None]) -> onnx.ModelProto:
    opset = opset_of(model) or 1
    contrib = {op for op, onnx_from in contrib.items() if onnx_from is None or opset < onnx_from}
    if not any(n.domain in DEFAULT_DOMAINS and n.op_type in contrib for n in model.graph.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.domain in DEFAULT_DOMAINS and node.op_type in contrib:
            node.domain = "com.microsoft"
    if opset_of(out, "com.microsoft") is None:
        out.opset_import.add(domain="com.microsoft", version=1)
    return out


def _external_files(model: onnx.ModelProto) -> list[str]:
    """The side files of the initializers still stored as external data."""
    return [next((e.value for e in t.external_data if e.key == "location"), "?")
            for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]


def _load_external_data(model: onnx.ModelProto, folder: str) -> None:
    """Read the weights a model saved with external data keeps in side files (relative to ``folder``)."""
    for location in dict.fromkeys(_external_files(model)):
        if not os.path.isfile(os.path.join(folder, location)):
            raise TvmAttnError(f"the model's weights are in the external data file {location!r}, which is not "
                               f"in {folder!r}: copy it next to the .onnx file (as it was saved)")
    try:
        onnx.external_data_helper.load_external_data_for_model(model, folder)
    except (OSError, ValueError, onnx.checker.ValidationError) as err:
        first = first_line(err)
        raise TvmAttnError(f"cannot read the model's external data in {folder!r} ({first}): the side file is "
                           f"truncated or does not belong to this model") from None


def _parse(data: bytes, where: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        raise TvmAttnError(f"{where} is not an ONNX model (protobuf parse failed): the file is truncated or "
                           f"of another format") from None
    if proto.ir_version == 0 or not proto.HasField("graph"):
        raise TvmAttnError(f"{where} is not an ONNX model (no IR version or graph): the file is empty, "
                           f"truncated or of another format")
    return proto


def opset_of(model: onnx.ModelProto, domain: str = "") -> int | None:
    """The model's opset version for ``domain`` (the default domain: "" or "ai.onnx")."""
    names = DEFAULT_DOMAINS if domain in DEFAULT_DOMAINS else (domain,)
    return next((o.version for o in model.opset_import if o.domain in names), None)


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The graph's nodes and those of its subgraphs (an If's branches, a Loop's body), outer first."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                yield from all_nodes(sub)


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy in which every node, subgraphs' too, has a unique, non-empty name (reports and errors cite
    them)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    seen: set[str] = set()
    for i, node in enumerate(all_nodes(out.graph)):
        name = node.name or f"{node.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        node.name = name
        seen.add(name)
    return out


def fold_static(model: onnx.ModelProto, keep: Iterable[tuple[str, str]] = ()) -> onnx.ModelProto:
    """Evaluate every node whose inputs are constants or static shapes; keep (domain, op) pairs in ``keep``.

    Constants consumed by the remaining nodes become initializers. The static sizes are those ONNX
    shape inference finds; where it fails, TVM's importer sees the model as given. Inference runs
    again on what a round folded while it left sizes unknown (SEW's upsampling reshapes to a computed
    shape: its length known only once that is a constant, and a Pad's amounts after it), at most
    `FOLD_ROUNDS` rounds.
    """
    keep = set(keep)
    for _ in range(FOLD_ROUNDS):
        folded, unknown = _fold_round(model, keep)
        if folded is model or not unknown:
            return folded
        model = folded
    return model


FOLD_ROUNDS = 4


def _fold_round(model: onnx.ModelProto, keep: set[tuple[str, str]]) -> tuple[onnx.ModelProto, bool]:
    """`fold_static`'s model after one round, and whether inference left a size of a tensor unknown."""
    opset = opset_of(model) or 1
    inferred = symbolic_shapes(model, onnx_only=True)
    named = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param}
    unknown = any(not isinstance(d, int) and d not in named for dims in inferred.values() for d in dims)
    shapes = {name: tuple(d if isinstance(d, int) else None for d in dims) for name, dims in inferred.items()}
    consts: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    partial: dict[str, tuple[int | None, ...]] = {}  # outputs of Shape nodes with some dimensions unknown
    kept: list[onnx.NodeProto] = []
    for node in model.graph.node:
        value = _fold(node, consts, shapes, partial, opset) if (node.domain, node.op_type) not in keep else None
        if value is None:
            kept.append(node)
        else:
            consts.update(value)
    if len(kept) == len(model.graph.node):
        return model, unknown
    needed = {i for node in kept for i in node.input} | {o.name for o in model.graph.output}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(kept)
    del out.graph.initializer[:]
    out.graph.initializer.extend(numpy_helper.from_array(np.asarray(v), name) for name, v in consts.items()
                                 if name in needed)
    return out, unknown


def symbolic_shapes(model: onnx.ModelProto, onnx_only: bool = False) -> dict[str, tuple[int | str, ...]]:
    """Every tensor's shape in terms of the graph inputs' sizes: a size, a named size, an expression of
    named sizes (``batch*seq``), or a name of no input's (unsized). The importer states these shapes to
    TVM, whose converters lose them across shape arithmetic (Shape → Gather → Concat → Reshape, Range).

    Symbolic shape inference (ONNX Runtime's, sympy over the named sizes; see `_SYMBOLIC_INFERENCE`) sizes
    what ONNX's own inference leaves unknown in TorchScript exports (a Range to a Shape value, a
    Reshape to a Concat of them); ONNX's (with data propagation, and the exporter's value_info) is the
    fallback where it fails or leaves a dimension unknown. Symbolic inference merges sizes it cannot
    tell apart (``auto_merge``): right for the shapes stated to TVM, which the model checks when it runs,
    but not for a size baked into a constant, so `fold_static` asks for ONNX's alone (``onnx_only``).
    """
    shapes = _shapes_of(_quietly(lambda: onnx.shape_inference.infer_shapes(model, data_prop=True)))
    if onnx_only:
        return shapes
    symbolic = _shapes_of(_symbolic_inference(model))
    named = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param}
    for name, dims in symbolic.items():
        if name not in shapes or all(not isinstance(d, str) or _names_only(d, named) for d in dims):
            shapes[name] = dims
    return shapes


# ONNX Runtime's symbolic shape inference: its own module where ONNX Runtime is installed (the original,
# which ORT's transformer tools run), else onnxslim's copy (pure Python, a dependency of tvmattn).
_SYMBOLIC_INFERENCE = ("onnxruntime.tools.symbolic_shape_infer", "onnxslim.third_party.symbolic_shape_infer")


def _symbolic_inference(model: onnx.ModelProto) -> onnx.ModelProto | None:
    import importlib

    for module in _SYMBOLIC_INFERENCE:
        try:
            inference = importlib.import_module(module).SymbolicShapeInference
        except ImportError:
            continue
        with tempfile.TemporaryDirectory() as scratch:
            inferred = _quietly(lambda: _in(scratch, lambda: inference.infer_shapes(model, auto_merge=True)))
        if inferred is not None:
            return inferred
    return None


def _in(folder: str, call):
    """``call()`` with ``folder`` as the working directory: where the inference gives up it saves its
    partial model as sym_shape_infer_temp.onnx in the working directory, which is the user's."""
    here = os.getcwd()
    os.chdir(folder)
    try:
        return call()
    finally:
        os.chdir(here)


def _quietly(infer) -> onnx.ModelProto | None:
    """``infer()``, or None where it fails (load() already ran strict inference: the model is sound),
    without the inference's log lines."""
    logging.disable(logging.WARNING)
    try:
        return infer()
    except Exception:  # both inferences raise many types on ops or cases they do not cover
        return None
    finally:
        logging.disable(logging.NOTSET)


def _shapes_of(model: onnx.ModelProto | None) -> dict[str, tuple[int | str, ...]]:
    if model is None:
        return {}
    shapes = {}
    for info in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        t = info.type.tensor_type
        if info.type.HasField("tensor_type") and t.HasField("shape"):
            shapes[info.name] = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim)
    return shapes


def _names_only(expr: str, named: set[str]) -> bool:
    """Whether every name in the dimension expression ``expr`` is a graph input's named size."""
    return all(word in named for word in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", expr))


def bind_shapes(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int | str]]) -> onnx.ModelProto:
    """A copy with the graph inputs in ``shapes`` given those dimensions (a size, or a name: symbolic)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inputs = {i.name: i for i in out.graph.input}
    for name, dims in shapes.items():
        if name not in inputs:
            raise TvmAttnError(f"shapes names {name!r}, which is not an input of the model (its inputs are "
                               f"{', '.join(inputs)})")
        shape = inputs[name].type.tensor_type.shape
        if len(shape.dim) and len(shape.dim) != len(dims):
            raise TvmAttnError(f"shapes gives input {name!r} {len(dims)} dimensions; it has {len(shape.dim)}")
        del shape.dim[:]
        for d in dims:
            if isinstance(d, str) and d.isdigit():
                d = int(d)
            if isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0:
                shape.dim.add().dim_value = int(d)
            elif isinstance(d, str) and d.isidentifier():
                shape.dim.add().dim_param = d
            else:
                raise TvmAttnError(f"shapes gives input {name!r} the dimension {d!r}: use a positive size or a "
                                   f"name (symbolic), e.g. {{{name!r}: (1, 'n')}}")
    return out


def name_dims(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy in which every unnamed dynamic dimension of a graph input has a name of its own
    (``input_ids_1``): TVM's importer reads every unnamed dimension as one and the same size. An input of
    unknown rank is a TvmAttnError saying how to bind its shape."""
    initializers = {t.name for t in model.graph.initializer}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = {d.dim_param for i in out.graph.input for d in i.type.tensor_type.shape.dim}
    for info in out.graph.input:
        if info.name in initializers or not info.type.HasField("tensor_type"):
            continue
        if not info.type.tensor_type.HasField("shape"):
            raise TvmAttnError(f"input {info.name!r} has no shape (not even a rank): bind it, "
                               f"import_onnx(model, shapes={{{info.name!r}: (1, 'n')}}) or tvmattn import "
                               f"--shape {info.name}=1xn")
        for axis, dim in enumerate(info.type.tensor_type.shape.dim):
            if not dim.HasField("dim_value") and not dim.dim_param:
                name = "".join(c if c.isalnum() else "_" for c in f"{info.name}_{axis}")
                while name in taken:
                    name += "_"
                dim.dim_param = name
                taken.add(name)
    return out


def _fold(node: onnx.NodeProto, consts: dict[str, np.ndarray], shapes: dict[str, tuple[int | None, ...]],
          partial: dict[str, tuple[int | None, ...]], opset: int) -> dict[str, np.ndarray] | None:
    """The node's outputs if they are known now, else None (recording partly known Shape values)."""
    if node.domain not in DEFAULT_DOMAINS or node.op_type in _NOT_FOLDABLE:
        return None
    if node.op_type in ("Shape", "Size") and node.input[0] not in consts:
        shape = shapes.get(node.input[0])
        value = _shape_value(node, shape) if shape is not None else None
        if value is None:  # partly known: a Gather may still pick a static dimension of it
            if node.op_type == "Shape" and shape is not None:
                partial[node.output[0]] = _shape_slice(node, shape)
            return None
        return {node.output[0]: value}
    if node.op_type == "Gather" and node.input[0] in partial and node.input[1] in consts:
        try:
            check_shape_indices(consts[node.input[1]], len(partial[node.input[0]]))
        except TvmAttnError as err:
            raise TvmAttnError(f"node {node.name!r} (Gather): {err}") from None
        picked = np.asarray(partial[node.input[0]], dtype=object)[consts[node.input[1]]]
        known = all(d is not None for d in np.ravel(picked))
        return {node.output[0]: np.asarray(picked, dtype=np.int64)} if known else None
    inputs = [i for i in node.input if i]
    if any(i not in consts for i in inputs):
        return None
    try:
        results = ReferenceEvaluator(node, opsets={"": opset}).run(None, {i: consts[i] for i in inputs})
    except Exception:  # the reference may not implement an op or a case: then TVM computes it
        return None
    if sum(np.asarray(r).nbytes for r in results) > _FOLD_LIMIT_BYTES:
        return None
    return {name: np.asarray(r) for name, r in zip(node.output, results) if name}


def check_shape_indices(indices: np.ndarray, rank: int) -> None:
    """TvmAttnError naming the first of constant ``indices`` into a shape of ``rank`` entries that is out of range."""
    flat = np.ravel(indices)
    outside = flat[(flat < -rank) | (flat >= rank)]
    if outside.size:
        raise TvmAttnError(f"index {int(outside[0])} is out of range: axis 0 (a shape) has {rank} entries, so "
                           f"indices lie in [{-rank}, {rank - 1}]")


def _shape_value(node: onnx.NodeProto, shape: tuple[int | None, ...]) -> np.ndarray | None:
    """A Shape or Size node's value where every dimension it reports is known."""
    dims = shape if node.op_type == "Size" else _shape_slice(node, shape)
    if any(d is None for d in dims):
        return None
    if node.op_type == "Size":
        return np.array(int(np.prod(dims)), dtype=np.int64)
    return np.array(dims, dtype=np.int64)


def _shape_slice(node: onnx.NodeProto, shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return shape[slice(attrs.get("start", 0), attrs.get("end", None))]
