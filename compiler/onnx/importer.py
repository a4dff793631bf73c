"""`import_onnx`: an ONNX model → Relax (TVM's importer plus tvmattn's attention converters) →
decomposed attention rewritten to tvmattn kernels → one compiled module you run with NumPy.

    m = tvmattn.import_onnx("model.onnx", target="cpu")
    outs = m.run({"input_ids": ids})      # NumPy arrays, in graph-output order
    print(m.report)                       # every attention found, its spec and kernel

The rest of the graph is compiled by TVM as its stock importer converts it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.target import Target

from tvmattn.compiler import concurrency
from tvmattn.compiler.build import compile_model
from tvmattn.compiler.cross import emulate
from tvmattn.compiler.errors import TvmAttnError, first_line, tvm_reason
from tvmattn.compiler.kernel import host_tensor, numpy_dtype
from tvmattn.compiler.logs import tvm_logs_to_logging
from tvmattn.compiler.onnx import cache16, calling, graph, patterns, registry
from tvmattn.compiler.onnx.converters import Node
from tvmattn.compiler.onnx.kernels import Kernels, Replacement
from tvmattn.compiler.onnx.profile import Profile, profile
from tvmattn.compiler.onnx.shape_ops import (
    as_onnx_value,
    refuse_sizes_by_themselves,
    state_broadcast,
    state_shape,
    tighten_shapes,
)
from tvmattn.compiler.spec import DTYPES, AttentionSpec
from tvmattn.compiler.target import is_cpu, is_foreign, resolve_target
from tvmattn.compiler.work import AttentionWork


@dataclass(frozen=True)
class GraphInput:
    name: str
    shape: tuple[int | str | None, ...]  # a size, a named (symbolic) size, or None: unknown
    dtype: str


@dataclass(frozen=True)
class SoftmaxFate:
    """What became of one Softmax node of the model as given."""

    node: str
    kernel: str | None  # the tvmattn kernel that computes it, or None
    reason: str = ""  # why not, where ``kernel`` is None

    def line(self) -> str:
        return f"softmax {self.node}: " + (f"on {self.kernel}" if self.kernel else f"left to TVM: {self.reason}")


@dataclass
class ImportReport:
    """Which attention subgraphs of the model became which tvmattn kernels, and every Softmax's fate."""

    model: str
    target: str
    replacements: list[Replacement]
    left_to_tvm: list[str] = field(default_factory=list)  # softmax nodes TVM computes as it imported them
    seconds: float = 0.0
    softmaxes: list[SoftmaxFate] = field(default_factory=list)  # every Softmax of the graph, in graph order
    rule_of: dict[str, str] = field(default_factory=dict)  # the other functions: name → the schedule rule it took
    tuned: list[str] = field(default_factory=list)  # those built from a tuning record (`tvmattn tune model.onnx`)
    work: dict[str, Any] = field(default_factory=dict, repr=False)  # function → its FLOPs by shape (`compiler.work`)
    dtype: str | None = None  # the matmuls' precision where the import was asked for one (`import_onnx(dtype=…)`)
    cache: list[tuple[str, str]] = field(default_factory=list)  # (past, present) stored in ``cache_dtype``
    cache_dtype: str | None = None
    in_place: dict[str, str] = field(default_factory=dict)  # output → the input written in place (its alias)

    @property
    def scheduled(self) -> dict[str, int]:
        """Schedule rule → how many of the model's other functions it took."""
        return dict(Counter(self.rule_of.values()))

    @property
    def softmaxes_on_kernels(self) -> int:
        return sum(f.kernel is not None for f in self.softmaxes)

    def __str__(self) -> str:
        lines = [f"{self.model}: {len(self.replacements)} attention(s) on tvmattn kernels, target {self.target}, "
                 f"imported and compiled in {self.seconds:.2f} s"
                 + (f"; matmuls by the weights in {self.dtype}, accumulated in float32" if self.dtype else "")]
        if self.cache:
            lines.append(f"  KV cache in {self.cache_dtype} ({len(self.cache)} pairs, as "
                         f"{self.cache[0][0]} → {self.cache[0][1]}): feed the present outputs back as they are")
        lines += [f"  {i}. {r.line()}" for i, r in enumerate(self.replacements, 1)]
        lines += [f"  {out} is {into}, written in place: the array passed as {into} comes back updated"
                  for out, into in self.in_place.items()]
        if self.softmaxes:
            lines.append(f"  {self.softmaxes_on_kernels} of {len(self.softmaxes)} Softmax node(s) on tvmattn kernels:")
            lines += [f"    {f.line()}" for f in self.softmaxes]
        if self.scheduled:
            lines.append("  the rest of the model, by schedule rule: "
                         + ", ".join(f"{rule} {n}" for rule, n in self.scheduled.items())
                         + (f"; {len(self.tuned)} from tuning records" if self.tuned else ""))
        fallback = sorted(name for name, rule in self.rule_of.items() if rule == "fallback")
        if fallback:
            lines.append(f"  on the fallback rule (parallel loops, nothing tiled or vectorised): {', '.join(fallback)}")
        named = {f.node for f in self.softmaxes}
        lines += [f"  left to TVM: softmax at {where}" for where in self.left_to_tvm if where not in named]
        return "\n".join(lines)


def _softmax_fates(softmax_nodes: list[str], replacements: list[Replacement], remaining: list[str],
                   reasons: dict[str, str]) -> list[SoftmaxFate]:
    """Each Softmax node → the kernel it is on, or why it is not."""
    fates = []
    for name in softmax_nodes:
        on = [r for r in replacements if name in r.nodes]
        if on:
            best = next((r for r in on if r.spec.output == "attn"), on[0])
            fates.append(SoftmaxFate(name, best.kernel))
        elif name in reasons:
            fates.append(SoftmaxFate(name, None, reasons[name]))
        elif name in remaining:
            fates.append(SoftmaxFate(name, None, patterns.NOT_ATTENTION))
        else:
            fates.append(SoftmaxFate(name, None, "its value is a constant or unused: folded or removed at import"))
    return fates


@dataclass
class ImportedModel:
    """A compiled ONNX model: ``run`` it with NumPy inputs by name."""

    target: Target
    executable: Any  # relax VMExecutable
    inputs: list[GraphInput]
    output_names: list[str]
    report: ImportReport
    output_dtypes: tuple[str, ...]  # as the compiled function returns them (a 16-bit KV cache's present_*)

    @property
    def device(self) -> tvm.runtime.Device:
        dev = tvm.cuda(0) if self.target.kind.name == "cuda" else tvm.cpu(0)
        if not dev.exist:
            raise TvmAttnError("no CUDA device on this machine: export_library() and run it where one is")
        return dev

    def declared(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``feed`` with each float array converted to its input's declared float dtype: a 16-bit KV cache
        (``cache_dtype``) filled from the fp32 arrays a peer takes. `run` itself converts nothing."""
        kinds = {spec.name: numpy_dtype(spec.dtype) for spec in self.inputs}
        return {name: arr.astype(kinds[name]) if name in kinds and arr.dtype != kinds[name]
                and np.dtype(arr.dtype).kind == "f" and np.dtype(kinds[name]).kind in "fV" else arr
                for name, arr in feed.items()}

    def run(self, feed: Mapping[str, Any]) -> list[np.ndarray]:
        """The graph's outputs, in order, for the inputs in ``feed`` (name → array)."""
        how = self._calling
        args = self._arguments(feed)
        if how.foreign:
            return self._emulated(args)
        # CPU: the arrays cross without a copy (a decode step's KV cache is megabytes; the functions take
        # arrays at any element offset, `passes.element_aligned_arguments`)
        tensors = [host_tensor(a) for a in args] if how.on_cpu else \
            [tvm.runtime.tensor(a, self.device) for a in args]
        main = self._mains.take()  # a VM keeps per-call state: one per concurrent run (`concurrency`)
        try:
            out = concurrency.run_on_tvm_pool(main, *tensors) if how.on_cpu else main(*tensors)
        except Exception as err:  # a check the model makes at run time: say which, without TVM's traceback
            raise TvmAttnError(calling.run_failure(err, args)) from None
        finally:
            self._mains.give_back(main)
        outs = calling.outputs(out)
        if not how.on_cpu:
            return [o if isinstance(o, np.ndarray) else o.numpy() for o in outs]
        return calling.host_outputs(outs, how, args, tensors)

    @functools.cached_property
    def _calling(self) -> calling.Calling:
        """What every `run` reads (`calling`), decided once."""
        foreign = is_foreign(self.target)
        on_cpu = not foreign and self.target.kind.name != "cuda"  # (`device`'s choice)
        names = [i.name for i in self.inputs]
        into = [self.report.in_place.get(name) for name in self.output_names]
        return calling.Calling(
            foreign, on_cpu,
            tuple(calling.expected(i.name, numpy_dtype(i.dtype), i.dtype, i.shape) for i in self.inputs),
            tuple(names.index(i) if i in names else None for i in into),
            tuple(dtype == "bfloat16" for dtype in self.output_dtypes))

    def _emulated(self, args: list[np.ndarray]) -> list[np.ndarray]:
        """Another CPU's model: its library run by TVM's runtime for that CPU under qemu-user (slowly; said once)."""
        emulate.warn_once(self.report.model, "model")
        return emulate.run_model(self._library(), self.target, args)

    def _library(self) -> Path:
        """The library `_emulated` runs (exported on the first run), in a directory kept with the model."""
        return Path(concurrency.once(self, "_library_dir", self._new_library).name) / "model.so"

    def _new_library(self) -> tempfile.TemporaryDirectory:
        directory = tempfile.TemporaryDirectory(prefix="tvmattn-model-")
        self.export_library(str(Path(directory.name) / "model.so"))
        return directory

    def export_library(self, path: str) -> None:
        """A shared library of the model (another CPU's: linked by its cross gcc, `cross.toolchain`)."""
        emulate.export_library(self.executable, self.target, path)

    def profile(self, feed: Mapping[str, Any], runs: int = 5) -> Profile:
        """Where a run's time goes, function by function (`compiler.onnx.profile`; this machine's CPU)."""
        if self.target.kind.name != "llvm" or is_foreign(self.target):
            raise TvmAttnError(f"profile times the functions of a model for this CPU, not {self.target}: import it "
                               "with target='cpu' (another CPU's model runs here only emulated, which times nothing)")
        return profile(self, feed, runs)

    @functools.cached_property
    def _mains(self) -> concurrency.Pool:
        """The ``main`` of a VM each over the one executable (its weights are read in place, not copied)."""
        return concurrency.Pool(lambda: relax.VirtualMachine(self.executable, self.device)["main"])

    def _arguments(self, feed: Mapping[str, Any]) -> list[np.ndarray]:
        return calling.arguments(self._calling.inputs, feed)


def import_onnx(model: Any, target: Any = "cpu", *, arch: str | None = None, mcpu: str | None = None,
                shapes: Mapping[str, Sequence[int | str]] | None = None, dtype: str | None = None,
                cache_dtype: str | None = None) -> ImportedModel:
    """Import an ONNX model (a path, bytes, a ModelProto, or one `graph.load` checked), compile it for
    ``target``, attention on tvmattn (``"aarch64"``/``"riscv64"`` with the CPU ``mcpu``: a library to
    `export_library` for that CPU, which runs it on TVM's runtime there).

    ``shapes`` binds graph inputs' dimensions (input name → sizes or names, e.g. ``{"input_ids": (1, "n")}``):
    a size makes it static, a name keeps it symbolic. Dimensions the model leaves dynamic stay symbolic.
    ``dtype`` ("bfloat16" or "float16"): matrix products by the model's weights in that precision,
    accumulated in fp32 (`schedules.ops.precision`); inputs and outputs keep the model's dtypes, but for
    ``cache_dtype`` ("bfloat16" or "float16"): a decoder's KV cache (past_* inputs, present_* outputs)
    stored in that dtype, half the bytes a decode step reads (`onnx.cache16`).
    """
    if dtype is not None and dtype not in DTYPES:
        raise TvmAttnError(f"dtype={dtype!r}: use 'bfloat16' or 'float16' (or None: the model's own)")
    precision = None if dtype is None or DTYPES[dtype] == "float32" else DTYPES[dtype]
    if cache_dtype is not None and DTYPES.get(cache_dtype) not in ("bfloat16", "float16"):
        raise TvmAttnError(f"cache_dtype={cache_dtype!r}: use 'bfloat16' or 'float16' (or None: the model's own)")
    cache_dtype = DTYPES[cache_dtype] if cache_dtype is not None else None
    try:
        with tvm_logs_to_logging():
            return _import(model, resolve_target(target, arch, mcpu), None, shapes or {}, precision, cache_dtype)
    except UnicodeDecodeError:  # protobuf decodes string fields when they are first read
        raise TvmAttnError("the ONNX model is corrupt: one of its names or string attributes is not valid "
                           "UTF-8; re-export it") from None


def _import(model: Any, target: Any, arch: str | None, shapes: Mapping[str, Sequence[int | str]],
            dtype: str | None = None, cache_dtype: str | None = None) -> ImportedModel:
    start = time.perf_counter()
    tgt = resolve_target(target, arch)
    c = _convert(model, tgt, shapes, dtype, cache_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            executable, scheduler = compile_model(c.mod, tgt, dtype)
        except Exception as err:
            raise TvmAttnError(f"TVM could not compile the imported model for {tgt.kind.name}: "
                               f"{tvm_reason(err)}") from err
    remaining = patterns.remaining_softmax(c.mod, c.importer.provenance)
    work = {r.kernel: AttentionWork(r.spec) for r in c.kernels.replacements if isinstance(r.spec, AttentionSpec)}
    report = ImportReport(c.proto.graph.name or "model", tgt.kind.name, list(c.kernels.replacements), remaining,
                          time.perf_counter() - start,
                          _softmax_fates(c.softmax_nodes, c.kernels.replacements, remaining, c.reasons),
                          scheduler.rule_of if scheduler else {}, scheduler.tuned_functions if scheduler else [],
                          (scheduler.work if scheduler else {}) | work, dtype, c.cache, cache_dtype,
                          dict(c.kernels.in_place))
    return ImportedModel(tgt, executable, graph_inputs(c.proto), [o.name for o in c.proto.graph.output], report,
                         _output_dtypes(c.mod["main"].ret_ty))


def relax_module(model: Any, target: Target, shapes: Mapping[str, Sequence[int | str]] | None = None) -> tvm.IRModule:
    """The model as the Relax module `import_onnx` compiles (attention already on tvmattn kernels)."""
    return _convert(model, target, shapes or {}).mod


@dataclass
class _Converted:
    proto: onnx.ModelProto
    mod: tvm.IRModule
    kernels: Kernels
    importer: "_Importer"
    reasons: dict[str, str]
    softmax_nodes: list[str]
    cache: list[tuple[str, str]]


def _convert(model: Any, tgt: Target, shapes: Mapping[str, Sequence[int | str]],
             precision: str | None = None, cache_dtype: str | None = None) -> _Converted:
    proto = load(model).proto
    cache: list[tuple[str, str]] = []
    if cache_dtype is not None:
        proto, cache = cache16.caches_in(proto, cache_dtype)
    if shapes:
        proto = graph.bind_shapes(proto, shapes)
        try:  # the bound sizes must fit the graph, as ONNX Runtime would find when it runs
            onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
        except Exception as err:  # onnx raises several error types
            first = first_line(err)
            raise TvmAttnError(f"the shapes given do not fit the model ({first})") from None
    proto = graph.name_nodes(graph.name_dims(proto))
    softmax_nodes = [n.name for n in graph.all_nodes(proto.graph)
                     if n.op_type == "Softmax" and n.domain in graph.DEFAULT_DOMAINS]
    proto = graph.fold_static(proto, keep=[(n.domain, n.op_type) for n in proto.graph.node if registry.converter(n)])
    kernels = Kernels(tgt, precision=precision, cache_16=cache_dtype is not None)
    importer = _Importer(proto, kernels)
    reasons: dict[str, str] = {}
    try:
        mod = patterns.rewrite(importer.convert(), kernels, importer.provenance, reasons)
        mod = tighten_shapes(mod)  # after: the position rules compare sizes as the graph wrote them
        refuse_sizes_by_themselves(mod)
    except TvmAttnError as err:
        raise TvmAttnError(str(err) + _binding_hint(str(err), graph_inputs(proto))) from None
    return _Converted(proto, mod, kernels, importer, reasons, softmax_nodes, cache)


class _Importer(onnx_frontend.ONNXGraphImporter):
    """TVM's ONNX importer with tvmattn's converters first, errors as TvmAttnError naming the node, and
    a record of which ONNX node produced each Relax call (for the report)."""

    def __init__(self, model: onnx.ModelProto, kernels: Kernels) -> None:
        super().__init__(shape_dict=None, dtype_dict="float32")
        self.model = model
        self.kernels = kernels
        self.provenance: dict[relax.Expr, str] = {}
        self._by_name = {n.name: n for n in graph.all_nodes(model.graph)}
        self._readers: dict[str, list[str]] = {}  # tensor name → the op types of the nodes reading it
        for n in self._by_name.values():
            for name in n.input:
                self._readers.setdefault(name, []).append(n.op_type)
        self._current: onnx.NodeProto | None = None
        self._shapes = graph.symbolic_shapes(model)
        self._declared = {info.name: _dims(info) for info in (*model.graph.input, *model.graph.output,
                                                                 *model.graph.value_info)}
        self._symbols: dict[str, tirx.Var] = {}  # the graph inputs' named sizes, as TVM's importer made them

    def _parse_graph_input(self, graph_proto: onnx.GraphProto) -> None:
        super()._parse_graph_input(graph_proto)
        for var in self._inputs.values():
            if isinstance(var, relax.Var) and isinstance(var.ty, relax.TensorType) and \
                    isinstance(var.ty.shape, relax.ShapeExpr):
                self._symbols.update({d.name: d for d in var.ty.shape.values if isinstance(d, tirx.Var)})

    def convert(self) -> tvm.IRModule:
        opset = graph.opset_of(self.model) or 1
        # TVM's importer warns about renamed inputs and dynamic shapes, and prints the node it failed on
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            try:
                return self.from_onnx(self.model.graph, opset)
            except TvmAttnError as err:
                raise TvmAttnError(self._where() + str(err)) from None
            except Exception as err:  # TVM's converters raise many types; the user gets the node and a line
                raise TvmAttnError(f"{self._where()}TVM's ONNX importer cannot convert it: {tvm_reason(err)}") from err

    def _where(self) -> str:
        node = self._current
        if node is None:
            return ""
        op = f"{node.domain}.{node.op_type}" if node.domain else node.op_type
        return f"node {node.name!r} ({op}): "

    def _check_for_unsupported_ops(self, graph: onnx.GraphProto) -> None:
        stock = onnx_frontend._get_convert_map()
        for node in graph.node:
            if not registry.converter(node) and node.op_type not in stock and node.op_type not in ("Constant", "If"):
                op = f"{node.domain}.{node.op_type}" if node.domain else node.op_type
                raise TvmAttnError(f"node {node.name!r}: operator {op} is not supported (neither by tvmattn "
                                   f"nor by TVM's ONNX importer)")

    def _convert_operator(self, op_name: str, inputs: list, attrs: dict, opset: int) -> relax.Expr:
        node = self._by_name.get(attrs["tvm_custom"]["name"])
        self._current = node
        op = registry.op_of(node.domain, node.op_type) if node is not None else registry.op_of("", op_name)
        if op.convert is not None:
            outs = op.convert(Node(node, self.bb, self.kernels, self._declared), list(inputs))
            outs = [o if o is not None else outs[0] for o in outs[:max(len(node.output), 1)]]
            return outs[0] if len(outs) == 1 else relax.Tuple(outs)
        # (``inputs`` stays TVM's onnx_input where nothing changes it: its converters index past the end)
        if op.broadcasting and node is not None and len(node.output) == 1:
            inputs = state_broadcast(self.bb, list(inputs), self._shapes.get(node.output[0]), self._symbols)
        if op.before is not None:
            inputs = op.before(list(inputs), attrs)
        sym = op.fix(list(inputs), attrs) if op.fix is not None else None
        cpu = node is not None and is_cpu(self.kernels.target)  # (run-time checks: CPU kernels)
        if sym is None and op.checked is not None and cpu:
            sym = op.checked(self.bb, node.name, list(inputs), attrs)
        if sym is None:
            sym = super()._convert_operator(op_name, inputs, attrs, opset)
        if op.check_after is not None and cpu:
            sym = op.check_after(self.bb, node.name, sym)
        sym = self.bb.normalize(sym)
        if node is not None and len(node.output) == 1:
            out = node.output[0]
            sym = self.bb.normalize(as_onnx_value(sym, self._shapes.get(out), self._readers.get(out, [])))
            sym = state_shape(self.bb, sym, self._shapes.get(out), self._symbols, out)
        if node is not None:
            self.provenance[sym] = node.name
        return sym


def load(model: Any) -> graph.Checked:
    """``model`` read and checked (`graph.load`), the ONNX Runtime ops exporters write in the ONNX domain
    checked in theirs."""
    return graph.load(model, registry.CONTRIB_IN_ONNX_DOMAIN)


def _output_dtypes(ret: Any) -> tuple[str, ...]:
    """The dtype of each output of a Relax function returning ``ret`` (one tensor or a tuple of them; ""
    for one that is not a tensor)."""
    return tuple(str(getattr(f, "dtype", "")) for f in (ret.fields if isinstance(ret, tvm.ir.TupleType) else [ret]))


def _binding_hint(message: str, inputs: list[GraphInput]) -> str:
    """For a size that must be static but is symbolic in the model, or shape arithmetic TVM's converter
    cannot take (dynamo's ``torch.sym_min(1024, n)`` in GPT-Neo): how to bind the inputs' sizes."""
    symbolic = [i for i in inputs if any(isinstance(d, str) for d in i.shape)]
    if not ("not a number" in message or "(shape arithmetic)" in message) or not symbolic:
        return ""
    first = symbolic[0]
    sizes = [d if isinstance(d, int) else 1 for d in first.shape]
    named = ', '.join(f'{i.name} {calling.pretty(i.shape)}' for i in symbolic)
    return (f"; bind the model's dynamic sizes (inputs {named}):"
            f" import_onnx(model, shapes={{{first.name!r}: {tuple(sizes)}}}) or tvmattn import --shape "
            f"{first.name}={'x'.join(map(str, sizes))}")


def graph_inputs(model: onnx.ModelProto) -> list[GraphInput]:
    initializers = {t.name for t in model.graph.initializer}
    return [GraphInput(info.name, _dims(info), _dtype_name(info.type.tensor_type.elem_type))
            for info in model.graph.input if info.name not in initializers]


def _dims(info: onnx.ValueInfoProto) -> tuple[int | str | None, ...]:
    """A tensor's declared sizes: a number, a name, or None where unknown."""
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                 for d in info.type.tensor_type.shape.dim)


def _dtype_name(elem_type: int) -> str:
    if elem_type == onnx.TensorProto.BFLOAT16:
        return "bfloat16"
    return str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)))


