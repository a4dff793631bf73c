"""Converters for the shape plumbing exporters emit, where TVM 0.27's stock ones fail on symbolic sizes.

Each returns None to let TVM's own converter handle the node (every case it already gets right).

Beyond single ops, TVM's converters lose shapes across the shape arithmetic of dynamic-shape exports
(a Reshape to a Concat of Shape values gives a tensor of unknown shape, and the next Reshape or
LayerNormalization then fails). ONNX shape inference knows those shapes, in terms of the graph
inputs' named sizes; `state_shape` tells TVM with a ``match_cast`` (checked when the model runs).

Expand   a constant target shape on data with symbolic dimensions (TorchScript's
         ``mask.expand(bsz, heads, -1, -1)``): the stock converter reads every data dimension as a number.
Range    integer bounds of shape arithmetic (the positions ``past .. past + seq`` of a decoder with a
         cache): the stock converter computes the length from a tensor, a size of its own making that
         Relax's memory planner uses before it is defined; `relax.op.arange` of the bounds keeps the
         length in the inputs' sizes (and `build.compile_model` keeps such producers unfused).
Slice    a start of shape arithmetic (T5's ``bias[:, :, -seq:]``, ends INT64_MAX): the stock converter then
         assumes every bound in range and sizes the axis ``INT64_MAX + seq``; ONNX's clamping is
         spelled out instead.
Reshape  a scalar of shape arithmetic (``batch * heads`` from Shape → Squeeze → Mul, as the dynamo
         exporter writes it) reshaped to one element: the stock converter wants a tensor; a
         one-element shape is what the following Concat builds a shape from.
Gather   constant 1-D indices into a shape (ONNX Runtime's transpose optimizer writes
         ``Shape(Transpose(x))`` as ``Gather(Shape(x), perm)``): the stock converter makes the shape a
         tensor, and the sizes after it are no longer symbolic (GPT-2's causal ``Slice`` of the window
         ``key_len - query_len``: a (1,) tensor of TVM's Sub, unsqueezed to 2-D ``starts``); the picked
         sizes stay a shape.
Add, Mul, …  a scalar of shape arithmetic beside a constant of more than one element (Funnel's relative
         positions ``arange(16)[:, None] + 2 * seq``): the stock converter folds them into one scalar and
         fails; the scalar becomes a 0-d tensor first (`scalars_beside_arrays`).
Min, Max sizes of shape arithmetic (dynamo's ``sym_min(1024, seq)``): the stock converter wants tensors;
         the result is a size (`extremum`).

TVM's importer keeps shape arithmetic as values (a scalar PrimExpr, a ShapeExpr) rather than tensors,
which only some converters read; `as_onnx_value` gives such a value the rank ONNX says it has, as an
int tensor where the next node cannot read it (the positions ``past + arange(seq)`` of a decoder with a cache,
unsqueezed twice: TVM's Unsqueeze takes a scalar to a ShapeExpr, and a ShapeExpr nowhere further).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import operator
from collections.abc import Callable, Iterator

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.expr import Expr as PrimExpr
from tvm.sym import Analyzer

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx.graph import check_shape_indices


def expand(inputs: list, _attrs: dict | None = None) -> relax.Expr | None:
    data, shape = inputs[0], inputs[1]
    if not isinstance(shape, tvm.ir.GenericConst) or not isinstance(data.ty, relax.TensorType):
        return None
    dims = list(data.ty.shape.values) if isinstance(data.ty.shape, relax.ShapeExpr) else None
    if dims is None or all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    target = [int(t) for t in shape.value.numpy().tolist()]
    rank = max(len(target), len(dims))
    dims = [tirx.IntImm("int64", 1)] * (rank - len(dims)) + dims
    target = [1] * (rank - len(target)) + target
    # ONNX broadcasting: a target 1 (or torch's -1) keeps the data's size, a data 1 takes the target's
    out = [d if t in (1, -1) else tirx.IntImm("int64", t) for d, t in zip(dims, target)]
    return relax.op.broadcast_to(data, relax.ShapeExpr(out))


def reshape(inputs: list, _attrs: dict | None = None) -> relax.Expr | None:
    data, shape = inputs[0], inputs[1]
    if not isinstance(data.ty, tvm.ir.PrimType) or not isinstance(shape, tvm.ir.GenericConst):
        return None
    if shape.value.numpy().size != 1 or "int" not in str(data.ty):
        return None
    return relax.ShapeExpr([data])  # in TVM 0.27 a Relax scalar of shape arithmetic is the PrimExpr itself


_TO_THE_END = 2**62  # an end at least this large means the axis' end (exporters write INT64_MAX)


def slice_(inputs: list, _attrs: dict | None = None) -> relax.Expr | None:
    data, starts, ends = inputs[:3]
    axes, steps = (inputs[i] if len(inputs) > i else None for i in (3, 4))
    start, end = _int_scalar(starts), _int_scalar(ends)
    dims = list(data.ty.shape.values) if isinstance(getattr(data, "ty", None), relax.TensorType) and \
        isinstance(data.ty.shape, relax.ShapeExpr) else None
    if dims is None or start is None or not isinstance(end, tirx.IntImm):
        return None  # a bound computed as a tensor: the stock converter's
    step = _int_scalar(steps) if steps is not None else tirx.IntImm("int64", 1)
    if not (isinstance(step, tirx.IntImm) and step.value == 1):
        return None  # other steps: the stock converter's
    axis = _int_scalar(axes) if axes is not None else tirx.IntImm("int64", 0)
    if not isinstance(axis, tirx.IntImm):
        return None
    axis = int(axis.value) % len(dims)
    size = dims[axis]
    if isinstance(start, tirx.IntImm):
        return _constant_bounds(data, axis, size, start, end)
    if end.value < _TO_THE_END:
        return None  # a symbolic start to another end: the stock converter's
    begin = _bound(start, size, bounded_below(start, 1))  # sizes: the importer refuses empty dimensions
    return None if begin is None else relax.op.strided_slice(data, [axis], [begin], [size], [1], assume_inbound=True)


def _constant_bounds(data: relax.Expr, axis: int, size: PrimExpr, start: PrimExpr, end: PrimExpr) -> relax.Expr | None:
    """A slice by constant bounds of a symbolic axis (MobileBERT's trigram embedding: x[:, 1:], x[:, :-1]),
    its length without a clamp where the axis's sizes being ≥ 1 (the importer refuses empty dimensions)
    proves one needless: TVM's converter sized x[:, :-1] min(max(n - 1, 0), n), and the concat of the
    three (padded) could not be proved n long. None (the stock converter's) where a clamp stays."""
    if isinstance(size, tirx.IntImm):
        return None
    analyzer = bounded_below(size, 1)
    begin, stop = _bound(start, size, analyzer), _bound(end, size, analyzer)
    if has_clamp(begin) or has_clamp(stop) or not analyzer.can_prove(stop >= begin):
        return None
    return relax.op.strided_slice(data, [axis], [begin], [stop], [1], assume_inbound=True)


def _bound(x: PrimExpr, size: PrimExpr, analyzer: Analyzer) -> PrimExpr | None:
    """ONNX's slice bound ``x`` on an axis of ``size``: a negative one counts from the end, then either
    clamps to the axis (an exporter's INT64_MAX is its end); None where ``analyzer`` cannot tell the sign."""
    if isinstance(x, tirx.IntImm) and x.value >= _TO_THE_END:
        return size
    if analyzer.can_prove(x < 0):
        return analyzer.simplify(tirx.max(size + x, 0))
    return analyzer.simplify(tirx.min(x, size)) if analyzer.can_prove(x >= 0) else None


def bounded_below(expr: PrimExpr, least: int = 0) -> Analyzer:
    """An analyzer that knows every variable of ``expr`` is ≥ ``least``: the variables of shape
    arithmetic are sizes (≥ 1 where the importer refuses empty dimensions) and indices (≥ 0)."""
    analyzer = Analyzer()
    for var in tirx.analysis.undefined_vars(expr):
        analyzer.update(var, tvm.sym.ConstIntBound(least, tvm.sym.ConstIntBound.POS_INF))
    return analyzer


def gather(inputs: list, _attrs: dict | None = None) -> relax.Expr | None:
    data, indices = inputs[0], inputs[1]
    if not isinstance(data, relax.ShapeExpr) or not isinstance(indices, tvm.ir.GenericConst):
        return None
    picks = indices.value.numpy()
    if picks.ndim != 1 or picks.dtype.kind not in "iu":
        return None  # a scalar index (the stock converter's PrimValue) or indices of another rank
    check_shape_indices(picks, len(data.values))  # (a shape is 1-D: the axis is 0)
    return relax.ShapeExpr([data.values[int(i)] for i in picks])


def extremum(pick: Callable[[PrimExpr, PrimExpr], PrimExpr]) -> Callable[..., PrimExpr | None]:
    """Min or Max (``pick``: tirx.min, tirx.max) of sizes of shape arithmetic, a size too (dynamo's
    ``torch.sym_min(1024, n)`` in GPT-Neo's reshapes, ``sym_max(0, max_len - n)`` in MPT's ALiBi slice):
    the stock converter takes only tensors."""
    def fix(inputs: list, _attrs: dict | None = None) -> PrimExpr | None:
        sizes = [_int_scalar(x) for x in inputs]
        if any(s is None for s in sizes) or all(isinstance(s, tirx.IntImm) for s in sizes):
            return None  # a tensor operand, or all constant: the stock converter's
        size = functools.reduce(pick, sizes)
        return bounded_below(size).simplify(size)
    return fix


def range_(inputs: list, _attrs: dict | None = None) -> relax.Expr | None:
    bounds = [_int_scalar(x) for x in inputs[:3]]
    if any(b is None for b in bounds) or all(isinstance(b, tirx.IntImm) for b in bounds):
        return None  # a float range, a bound computed as a tensor, or all constant: the stock converter's
    dtype = str(inputs[0].ty.dtype) if isinstance(inputs[0], tvm.ir.GenericConst) else str(inputs[0].ty)
    return relax.op.arange(*bounds, dtype=dtype)


def _int_scalar(x: relax.Expr) -> PrimExpr | None:
    """An integer scalar (a one-element constant, ShapeExpr or PrimExpr of shape arithmetic) as a PrimExpr."""
    if isinstance(x, tvm.ir.GenericConst):
        value = x.value.numpy()
        return tirx.IntImm("int64", int(value.item())) if value.size == 1 and value.dtype.kind in "iu" else None
    if isinstance(x, relax.ShapeExpr) and len(x.values) == 1:
        return x.values[0]
    if isinstance(getattr(x, "ty", None), tvm.ir.PrimType) and "int" in str(x.ty):
        return x if str(x.ty) == "int64" else tirx.Cast("int64", x)
    return None


def nonempty(inputs: list, axis: int) -> list:
    """A Concat's inputs without the tensors of static width 0 along ``axis`` (a rotary over the whole head
    concatenates a zero-width q[..., rot:]): they add nothing, and what computes them is then dead code."""
    def empty(x) -> bool:
        ty = getattr(x, "ty", None)
        if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
            return False
        dims = ty.shape.values
        return -len(dims) <= axis < len(dims) and isinstance(dims[axis], tirx.IntImm) and dims[axis].value == 0

    kept = [x for x in inputs if not empty(x)]
    return kept or inputs[:1]


def scalars_beside_arrays(inputs: list, attrs: dict) -> list:
    """A broadcasting op's scalars of shape arithmetic as 0-d tensors where another input is a constant of
    more than one element: TVM's converter folds constants and shape scalars into one scalar, which fails
    on such a constant (Funnel's relative positions ``arange(16)[:, None] + 2 * seq``)."""
    def many(x) -> bool:
        return isinstance(x, tvm.ir.GenericConst) and x.value.numpy().size > 1

    if not any(many(x) for x in inputs) or not any(tvm.ir.is_prim_expr(x) for x in inputs):
        return inputs
    return [relax.op.astype(relax.op.reshape(relax.op.shape_to_tensor(relax.ShapeExpr([_int_scalar(x)])), ()),
                            str(x.ty.dtype)) if tvm.ir.is_prim_expr(x) else x for x in inputs]


# The ops TVM 0.27's importer lets read a ShapeExpr (its `shape_compatible_ops`); any other raises.
READS_SHAPES = {"Reshape", "Resize", "ConstantOfShape", "Gather", "Slice", "Shape", "Expand", "Concat", "Equal",
                "Where", "Cast", "CastLike", "Squeeze"}


def as_onnx_value(value: relax.Expr, dims: tuple[int | str, ...] | None, readers: list[str]) -> relax.Expr:
    """A scalar or ShapeExpr of shape arithmetic in the form its ONNX shape ``dims`` and its ``readers``
    (op types) need: TVM's form can have another rank (a one-element Add of a scalar size is a scalar
    to TVM, a Gather of one size a one-element ShapeExpr), and only some readers take a ShapeExpr.
    It stays a symbolic value where it can (a Range's length must stay one); else it becomes the int
    tensor ONNX says it is."""
    ty = getattr(value, "ty", None)
    if isinstance(ty, relax.ShapeType):
        rank, length, dtype = 1, ty.ndim, "int64"
    elif isinstance(ty, tvm.ir.PrimType):
        rank, length, dtype = 0, 1, str(ty.dtype)
    else:
        return value
    if dims is None or not all(isinstance(d, int) for d in dims) or int(np.prod(dims)) != length:
        return value  # not a value ONNX's shape describes (or one of unknown length)
    if len(dims) == 0:
        if rank == 0:
            return value
        if isinstance(value, relax.ShapeExpr):
            return relax.prim_value(value.values[0])
    elif len(dims) == 1 and all(r in READS_SHAPES for r in readers):
        return value if rank == 1 else relax.ShapeExpr([value])
    tensor = relax.op.shape_to_tensor(value if rank else relax.ShapeExpr([value]))  # (length,) int64
    return relax.op.astype(relax.op.reshape(tensor, dims), dtype)


_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: tirx.floordiv}


def dimension(text: int | str, symbols: dict[str, tirx.Var]) -> tirx.PrimExpr | None:
    """An inferred dimension as a TIR expression over the graph inputs' named sizes (``symbols``), or None
    where it is unsized or names a size no input has."""
    if isinstance(text, int):
        return tirx.IntImm("int64", text)

    def build(e: ast.expr) -> tirx.PrimExpr:
        if isinstance(e, ast.Constant) and isinstance(e.value, int):
            return tirx.IntImm("int64", e.value)
        if isinstance(e, ast.Name) and e.id in symbols:
            return symbols[e.id]
        if isinstance(e, ast.BinOp) and type(e.op) in _ARITHMETIC:
            return _ARITHMETIC[type(e.op)](build(e.left), build(e.right))
        raise ValueError(text)

    try:
        return build(ast.parse(text.replace("/", "//").replace("////", "//"), mode="eval").body)
    except (SyntaxError, ValueError):
        return None


def state_shape(bb: relax.BlockBuilder, value: relax.Expr, dims: tuple[int | str, ...] | None,
                symbols: dict[str, tirx.Var], name: str) -> relax.Expr:
    """``value`` with the inferred shape ``dims`` where TVM lost its shape (or rank), or sized a dimension
    with a size of its own making (``range_len_0`` for a Range's length) that shape inference says in
    terms of the inputs; dimensions nothing sizes become fresh sizes named after the tensor ``name``
    (``q_dim1``), bound when the model runs."""
    ty = value.ty
    if dims is None or not isinstance(ty, relax.TensorType) or ty.ndim not in (-1, len(dims)):
        return value
    stated = [dimension(d, symbols) for d in dims]
    if isinstance(ty.shape, relax.ShapeExpr):
        known = set(symbols.values())
        shape = [s if s is not None and not _in_terms_of(d, known) else d
                 for d, s in zip(ty.shape.values, stated)]
        if _same_dims(shape, ty.shape.values):
            return value
    else:
        label = "".join(c if c.isalnum() else "_" for c in name)
        shape = [d if d is not None else tirx.Var(f"{label}_dim{i}", "int64") for i, d in enumerate(stated)]
    if not isinstance(value, relax.Var):  # legalization reaches only calls bound to variables
        value = bb.emit(value)
    return bb.match_cast(value, relax.TensorType(shape, ty.dtype))


def _in_terms_of(dim: tirx.PrimExpr, known: set) -> bool:
    """Whether ``dim`` is a number or an expression of the graph inputs' sizes only."""
    return all(any(v.same_as(k) for k in known) for v in tirx.analysis.undefined_vars(dim))


def state_broadcast(bb: relax.BlockBuilder, inputs: list, dims: tuple[int | str, ...] | None,
                    symbols: dict[str, tirx.Var]) -> list:
    """The inputs of a broadcasting op with each dimension that is not 1 stated as the output's, where
    TVM cannot prove them equal: a TorchScript export bakes a traced length (5) into one operand while
    the other keeps the named one (seq); the result's shape is then unknown to TVM, which cannot lower
    the op. Shape inference knows the output; the cast checks the sizes agree when the model runs.
    Where an operand's size is a min or max of the stated one (``min(1024, seq)`` for seq, from dynamo's
    ``sym_min``), the others are cast to that: a cast to seq would define seq by itself, and TVM's
    CanonicalizeBindings then substitutes it into itself without end (a segfault)."""
    stated = [dimension(d, symbols) for d in dims] if dims is not None else None
    if stated is None or any(d is None for d in stated):
        return _unclamped(bb, inputs)
    analyzer = Analyzer()
    for ty in (getattr(v, "ty", None) for v in inputs):
        if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr) and ty.ndim <= len(stated):
            for axis, h in enumerate(ty.shape.values, len(stated) - ty.ndim):
                if _by_itself(stated[axis], h, analyzer):
                    stated[axis] = h
    out = []
    for value in inputs:
        ty = getattr(value, "ty", None)
        if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
            out.append(value)
            continue
        have = list(ty.shape.values)
        want = stated[len(stated) - len(have):] if len(have) <= len(stated) else None
        if want is None:
            out.append(value)
            continue
        shape = [h if (isinstance(h, tirx.IntImm) and h.value == 1) or analyzer.can_prove_equal(h, w) else w
                 for h, w in zip(have, want)]
        if _same_dims(shape, have):
            out.append(value)
            continue
        if not isinstance(value, relax.Var):
            value = bb.emit(value)
        out.append(bb.match_cast(value, relax.TensorType(shape, ty.dtype)))
    return out


def _same_dims(a: list, b: list) -> bool:
    """Whether two shapes are the same expressions (a cast between them would check nothing)."""
    return len(a) == len(b) and all(tvm_ffi.structural_equal(x, y) for x, y in zip(a, b))


def _by_itself(size: PrimExpr, value: PrimExpr, analyzer: Analyzer) -> bool:
    """Whether casting a dimension of size ``value`` to the variable ``size`` defines it by a min or max of
    itself (seq as ``min(1024, seq)``), which TVM 0.27's CanonicalizeBindings substitutes into itself
    without end (each substitution a min more, none simplified away)."""
    return isinstance(size, tirx.Var) and has_clamp(value) and any(
        v.same_as(size) for v in tirx.analysis.undefined_vars(value)) and not analyzer.can_prove_equal(value, size)


def refuse_sizes_by_themselves(mod: tvm.IRModule) -> None:
    """A TvmAttnError for a cast that states a size by itself (`_by_itself`), rather than TVM's segfault
    when it compiles the model."""
    analyzer = Analyzer()
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            if not isinstance(b, relax.MatchCast) or not all(isinstance(t, relax.TensorType) and isinstance(
                    t.shape, relax.ShapeExpr) for t in (b.ty, b.value.ty)):
                continue
            for value, size in zip(b.value.ty.shape.values, b.ty.shape.values):
                if _by_itself(size, value, analyzer):
                    raise TvmAttnError(f"the model states its size {size} as {value}, which TVM cannot compile "
                                       f"(its CanonicalizeBindings recurses without end)")


def tighten_shapes(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each shape that holds a min or max (a Slice's clamp: ``min(max(L, 0), L + 1)`` for
    ``x[:-1]`` on an axis of L + 1) simplified with what every shape of the function says: each size is
    ≥ 0. TVM could not prove the shapes of ``a + b[:, :-1]`` equal (Wav2Vec2's positional convolution
    trims its padding so), left the sum's shape unknown and could not legalise it."""
    func = mod["main"]
    dims = [d for t in _tensor_types(func) for d in t.shape.values]
    if not any(has_clamp(d) for d in dims):
        return mod
    with _sizes(dims) as analyzer:
        return _Tighten(mod, analyzer).run()


def _unclamped(bb: relax.BlockBuilder, inputs: list) -> list:
    """The inputs of a broadcasting op whose output shape nothing states, each shape with a clamp
    simplified by what the operands' other sizes say (each ≥ 0), as `tighten_shapes` does later for
    the whole graph: TVM could not prove WavLM's ``x + conv(x)[:, :, :-1]`` sizes equal, lost the sum's
    shape, and every size after it became one of `state_shape`'s making (FuseTIR then failed on it)."""
    types = [getattr(v, "ty", None) for v in inputs]
    shapes = [t.shape.values if isinstance(t, relax.TensorType) and isinstance(t.shape, relax.ShapeExpr) else None
              for t in types]
    if not any(s is not None and any(has_clamp(d) for d in s) for s in shapes):
        return inputs
    out = []
    with _sizes([d for s in shapes if s is not None for d in s]) as analyzer:
        for value, ty, shape in zip(inputs, types, shapes):
            simpler = None if shape is None else [analyzer.simplify(d) for d in shape]
            if shape is None or not any(has_clamp(d) for d in shape) or _same_dims(simpler, shape):
                out.append(value)
                continue
            if not isinstance(value, relax.Var):
                value = bb.emit(value)
            out.append(bb.match_cast(value, relax.TensorType(simpler, ty.dtype)))
    return out


@contextlib.contextmanager
def _sizes(dims: list) -> Iterator[Analyzer]:
    """An analyzer that knows each of ``dims`` but the clamps is ≥ 0 (each sizes a tensor), as are the
    variables in them."""
    analyzer = Analyzer()
    for var in {v for d in dims for v in tirx.analysis.undefined_vars(d)}:
        analyzer.update(var, tvm.sym.ConstIntBound(0, tvm.sym.ConstIntBound.POS_INF))
    with contextlib.ExitStack() as scopes:
        for d in {str(d): d for d in dims if not isinstance(d, (tirx.Var, tirx.IntImm)) and not has_clamp(d)}.values():
            scopes.enter_context(analyzer.constraint_scope(d >= 0))
        yield analyzer


def without_unused_casts(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` without the casts of `state_shape` and `state_broadcast` nothing reads any more, which
    DeadCodeElimination keeps (a cast checks): MPT's symbolic scores cast to its ALiBi's length, read by
    the chain a kernel replaced (`patterns.rewrite`), kept the scores' matmul alive (a third of its run)."""
    func = mod["main"]
    used = {v for block in func.body.blocks for b in block.bindings for v in relax.analysis.free_vars(b.value)}
    used |= set(relax.analysis.free_vars(func.body.body))
    given = {v for p in func.params if isinstance(p.ty, relax.TensorType) and isinstance(p.ty.shape, relax.ShapeExpr)
             for d in p.ty.shape.values for v in tirx.analysis.undefined_vars(d)}

    def unused(b: relax.Binding) -> bool:  # (a cast that defines a size is kept: what follows reads it)
        return isinstance(b, relax.MatchCast) and b.var not in used and isinstance(b.ty, relax.TensorType) \
            and isinstance(b.ty.shape, relax.ShapeExpr) \
            and all(v in given for d in b.ty.shape.values for v in tirx.analysis.undefined_vars(d))

    blocks = [type(block)([b for b in block.bindings if not unused(b)]) for block in func.body.blocks]
    if all(len(a.bindings) == len(b.bindings) for a, b in zip(blocks, func.body.blocks)):
        return mod
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    out[mod.get_global_var("main")] = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body),
                                                     func.ret_ty, func.is_pure, func.attrs)
    return out


def _tensor_types(func: relax.Function) -> list:
    types = [p.ty for p in func.params] + [b.var.ty for block in func.body.blocks for b in block.bindings]
    return [t for t in types if isinstance(t, relax.TensorType) and isinstance(t.shape, relax.ShapeExpr)]


def has_clamp(dim: PrimExpr) -> bool:
    found = []
    tvm_ffi.structural_walk(dim, [((tirx.Min, tirx.Max), lambda n: found.append(n))])
    return bool(found)


@relax.expr_functor.mutator
class _Tighten(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, analyzer: Analyzer) -> None:
        super().__init__(mod)
        self.mod_, self.analyzer = mod, analyzer

    def run(self) -> tvm.IRModule:
        gvar = self.mod_.get_global_var("main")
        self.builder_.update_func(gvar, self.visit_expr(self.mod_["main"]))
        return self.builder_.get()

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        ty = binding.var.ty
        if not (isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr)
                and any(has_clamp(d) for d in ty.shape.values)):
            super().visit_var_binding_(binding)
            return
        shape = [self.analyzer.simplify(d) for d in ty.shape.values]
        if _same_dims(shape, ty.shape.values):  # (a cast to the same sizes hid SEW's scores from the patterns)
            super().visit_var_binding_(binding)
            return
        value = self.builder_.emit(self.visit_expr(binding.value))
        self.set_var_remap(binding.var, self.builder_.match_cast(value, relax.TensorType(shape, ty.dtype)))

