"""tvmattn's attention kernel inside a Relax module: one scheduled PrimFunc per AttentionSpec, called
with ``call_tir``.

Both ONNX front ends use it: the op converters and the decomposed-attention patterns. Every attention
it emits is recorded as a `Replacement`, the import report's lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import relax, tirx
from tvm.ir.expr import Expr as PrimExpr
from tvm.sym import Analyzer
from tvm.target import Target

from tvmattn.compiler import arguments
from tvmattn.compiler.annotations import IS_SCHEDULED, OP_PATTERN, OPAQUE
from tvmattn.compiler.build import head_widths, schedule_attention, schedule_paged
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.paged import PagedSpec
from tvmattn.compiler.spec import AttentionSpec, Dim


@dataclass(frozen=True)
class Replacement:
    """One attention of the model that runs as a tvmattn kernel."""

    nodes: tuple[str, ...]  # the ONNX nodes it replaces
    source: str  # the converter or pattern that found it
    spec: AttentionSpec | PagedSpec
    kernel: str  # the PrimFunc's name in the compiled module
    schedule: str  # how that kernel was scheduled: default knobs or a tuned record

    def line(self) -> str:
        nodes = ", ".join(self.nodes) if len(self.nodes) <= 3 else f"{self.nodes[0]} … {self.nodes[-1]}"
        return (f"{self.source} [{nodes}] -> {self.kernel}: {self.spec.describe()}; {self.schedule}")


@dataclass
class Kernels:
    """The attention kernels of one Relax module being built, one per distinct spec."""

    target: Target
    replacements: list[Replacement] = field(default_factory=list)
    _funcs: dict[Any, tuple[relax.GlobalVar, str]] = field(default_factory=dict)  # by spec (and buffer rows)
    precision: str | None = None  # fp32 attention computed in this 16-bit dtype (`import_onnx(dtype=…)`)
    cache_16: bool = False  # the KV cache arrives in 16 bits (`import_onnx(cache_dtype=…)`)
    in_place: dict[str, str] = field(default_factory=dict)  # output → the input it is written into (an alias)

    def call(self, bb: relax.BlockBuilder, spec: AttentionSpec, args: list[relax.Expr], sizes: "Sizes",
             nodes: tuple[str, ...], source: str) -> relax.Var:
        """Emit ``call_tir`` of the kernel of ``spec`` on ``args`` (its inputs in call order)."""
        gvar, how = self._kernel(bb, spec)
        shape = [sizes.expr(d) for d in spec.output_shape()]
        out = bb.emit(relax.call_tir(gvar, args, relax.TensorType(shape, spec.dtype)))
        self.replacements.append(Replacement(tuple(nodes), source, spec, gvar.name_hint, how))
        return out

    def call_paged(self, bb: relax.BlockBuilder, spec: PagedSpec, args: list[relax.Expr], out_shape: list,
                   nodes: tuple[str, ...], source: str, rows: int | None = None) -> relax.Var:
        """Emit ``call_tir`` of the paged kernel of ``spec`` (`paged.with_unused`'s arguments, in order), or
        with ``rows``, of its decode kernel over contiguous (B, h_kv, rows, d) buffers (`buffer_kernel`)."""
        gvar, how = self._kernel(bb, spec, rows)
        out = bb.emit(relax.call_tir(gvar, args, relax.TensorType(out_shape, spec.dtype)))
        self.replacements.append(Replacement(tuple(nodes), source, spec, gvar.name_hint, how))
        return out

    def _kernel(self, bb: relax.BlockBuilder, spec: AttentionSpec | PagedSpec,
                rows: int | None = None) -> tuple[relax.GlobalVar, str]:
        key = spec if rows is None else (spec, rows)
        if key not in self._funcs:
            mod, how = _schedule(spec, self.target, rows)
            output = getattr(spec, "output", "attn")
            name = f"tvmattn_{'paged' if isinstance(spec, PagedSpec) else 'attention'}{len(self._funcs)}" + (
                "" if output == "attn" else f"_{output}")
            func = (mod["main"].with_attr("global_symbol", name).with_attr(OP_PATTERN, OPAQUE)
                    .with_attr(IS_SCHEDULED, True))  # dlight must not reschedule it (CUDA)
            self._funcs[key] = (bb.add_func(func, name), how)
        return self._funcs[key]


_SCHEDULED: dict[tuple[AttentionSpec | PagedSpec, str, int | None], tuple[tvm.IRModule, str]] = {}


def _schedule(spec: AttentionSpec | PagedSpec, target: Target, rows: int | None = None) -> tuple[tvm.IRModule, str]:
    """`schedule_attention` (`schedule_paged`), cached: models repeat their attention shapes, and
    scheduling is a pure function of the spec and the target (Targets compare by identity, hence their text)."""
    key = (spec, str(target), rows)
    if key not in _SCHEDULED:
        _SCHEDULED[key] = schedule_paged(spec, target, rows) if isinstance(spec, PagedSpec) else \
            schedule_attention(spec, target)
    return _SCHEDULED[key]


def _conform(bb: relax.BlockBuilder, x: relax.Expr, want: list, sizes: "Sizes", what: str) -> relax.Expr:
    """``x`` with shape ``want``: as it is where provably so, through a run-time checked match_cast
    where sizes are symbolic and unrelated (a model's "T" that must be "P + S"); an error if not."""
    shape = shape_of(x, what)
    if len(shape) == len(want) and all(sizes.equal(a, b) for a, b in zip(shape, want)):
        return x
    if len(shape) != len(want) or any(isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm)
                                      for a, b in zip(shape, want) if not sizes.equal(a, b)):
        raise TvmAttnError(f"{what} has shape {tuple(shape)}, where the attention needs {tuple(want)}")
    return bb.match_cast(x, relax.TensorType(want, str(x.ty.dtype)))


class Sizes:
    """AttentionSpec sizes for Relax shape expressions: an int where static, else a name (the same name
    for provably equal expressions), so that one kernel serves every length."""

    def __init__(self) -> None:
        self._exprs: dict[str, PrimExpr] = {}
        self._analyzer = Analyzer()

    def dim(self, value: PrimExpr, name: str) -> Dim:
        if isinstance(value, tirx.IntImm):
            return int(value.value)
        for known, expr in self._exprs.items():
            if self.equal(expr, value):
                return known
        if isinstance(value, tirx.Var) and value.name.isidentifier():
            name = value.name
        base, i = name, 1
        while name in self._exprs:
            name, i = f"{base}{i}", i + 1
        self._exprs[name] = value
        return name

    def expr(self, d: Dim) -> PrimExpr | int:
        return self._exprs[d] if isinstance(d, str) else d

    def equal(self, a: PrimExpr, b: PrimExpr) -> bool:
        if isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm):
            return int(a.value) == int(b.value)
        return str(a.ty) == str(b.ty) and self._analyzer.can_prove_equal(a, b)


def shape_of(expr: relax.Expr, what: str) -> list[PrimExpr]:
    """The shape of a tensor expression; TvmAttnError if TVM could not infer it."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        raise TvmAttnError(f"the shape of {what} cannot be inferred: give the model's inputs static or "
                           f"named dimensions (onnx.shape_inference can add them)")
    return list(ty.shape.values)


def static(value: PrimExpr, what: str) -> int:
    """A size that must be known when the model is compiled (head counts, head widths)."""
    if not isinstance(value, tirx.IntImm):
        raise TvmAttnError(f"{what} is {value}, not a number: tvmattn compiles one kernel per head "
                           f"count and width, so these must be static in the model")
    return int(value.value)


@dataclass
class Mask:
    """An attention mask tensor as a front end found it: any shape that broadcasts to (B, h, n, n_kv)."""

    value: relax.Expr
    kind: str  # "bool" (True = attend) or "additive"


def attend(bb: relax.BlockBuilder, kernels: Kernels, q: relax.Expr, k: relax.Expr, v: relax.Expr, *,
           layout: str, nodes: tuple[str, ...], source: str, mask: Mask | None = None,
           kv_lens: relax.Expr | None = None, outputs: tuple[str, ...] = ("attn",),
           sinks: relax.Expr | None = None, alibi_slopes: relax.Expr | None = None, **options) -> list[relax.Var]:
    """Emit the attention of q, k, v (4-D, in ``layout``) as tvmattn kernels, one per requested output.

    ``options`` are AttentionSpec fields (causal, causal_align, window, scale, softcap, alibi); the sizes,
    heads, dtype and mask fields come from the tensors. ``kv_lens`` is an int32 (B,) tensor, ``sinks``
    and ``alibi_slopes`` float32 (h,) ones; the kernel takes them in `arguments.TABLE`'s order.
    """
    if kernels.precision and str(q.ty.dtype) == "float32" and outputs == ("attn",) \
            and _worth_16_bits(kernels, q, layout):
        # the kernel in 16 bits on q, k, v cast where they are produced, its output back in fp32
        q, k, v = (bb.emit(relax.op.astype(x, kernels.precision)) for x in (q, k, v))
        out = attend(bb, kernels, q, k, v, layout=layout, nodes=nodes, source=source, mask=mask, kv_lens=kv_lens,
                     outputs=outputs, sinks=sinks, alibi_slopes=alibi_slopes, **options)
        return [bb.emit(relax.op.astype(o, "float32")) for o in out]
    sizes = Sizes()
    qs, ks, vs = (shape_of(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    if layout == "BSHD":
        qs, ks, vs = ([s[0], s[2], s[1], s[3]] for s in (qs, ks, vs))
    batch, heads, n_q, d_k = qs
    n_kv = ks[2]
    order = (0, 2, 1, 3) if layout == "BSHD" else (0, 1, 2, 3)
    k = _conform(bb, k, [[batch, ks[1], n_kv, d_k][i] for i in order], sizes, "k")
    v = _conform(bb, v, [[batch, ks[1], n_kv, vs[3]][i] for i in order], sizes, "v")
    dtype = str(q.ty.dtype)
    if str(k.ty.dtype) != dtype or str(v.ty.dtype) != dtype:
        raise TvmAttnError(f"q, k and v have dtypes {dtype}, {k.ty.dtype}, {v.ty.dtype}: they must agree")
    fields = dict(batch=sizes.dim(batch, "B"), seq_len=sizes.dim(n_q, "n"), kv_seq_len=sizes.dim(n_kv, "n_kv"),
                  num_heads=static(heads, "the query head count"), num_kv_heads=static(ks[1], "the key head count"),
                  head_dim=static(d_k, "the head width d_k"), v_head_dim=static(vs[3], "the value head width d_v"),
                  layout=layout, dtype=dtype, projections=False, key_padding=kv_lens is not None, **options)
    given = {"q": q, "k": k, "v": v, "kv_lens": kv_lens}
    if mask is not None:
        given["attn_mask"], dims = _broadcast_mask(bb, mask, [batch, heads, n_q, n_kv], sizes)
        fields.update(attn_mask=mask.kind, attn_mask_dims=dims)
    if sinks is not None:
        fields["sinks"] = True
        given["sinks"] = _conform(bb, sinks, [heads], sizes, "the sinks")
    if alibi_slopes is not None:
        fields.setdefault("alibi", "signed")
        given["alibi_slopes"] = _conform(bb, alibi_slopes, [heads], sizes, "the ALiBi slopes")
    spec = AttentionSpec(**fields)
    padded = head_widths(spec, kernels.target) if outputs == ("attn",) else None
    if padded is not None:  # head widths the tiles (or dot products) do not take: zero columns, sliced off after
        widths = {"q": padded.d_k, "k": padded.d_k, "v": padded.d_v}
        given.update({x: _zero_padded(bb, given[x], width) for x, width in widths.items()})
        args = [given[a.name] for a in arguments.taken(padded)]
        out = kernels.call(bb, padded, args, sizes, nodes, source)
        return [bb.emit(relax.op.strided_slice(out, axes=[3], begin=[0], end=[spec.d_v]))]
    args = [given[a.name] for a in arguments.taken(spec)]
    return [kernels.call(bb, spec.replace(output=o), args, sizes, nodes, source) for o in outputs]


def _zero_padded(bb: relax.BlockBuilder, x: relax.Expr, width: int) -> relax.Expr:
    """``x`` (4-D, its last axis the head width) with zero columns up to ``width``."""
    extra = width - int(shape_of(x, "q, k or v")[3])
    return bb.emit(relax.op.nn.pad(x, [0, 0, 0, 0, 0, 0, 0, extra]))


def _worth_16_bits(kernels: Kernels, q: relax.Expr, layout: str) -> bool:
    """Whether a 16-bit import runs this attention in 16 bits. Not a one-query step (decode) over an
    fp32 cache: it is bound by reading K and V, and casting the whole cache every step reads all of it
    and writes half again (GPT-2's decode step: 4 casts of its cache a token). A cache that arrives in
    16 bits (`import_onnx(cache_dtype=...)`: widened by the graph, narrowed back for free) is read in 16."""
    n_q = shape_of(q, "q")[2 if layout == "BHSD" else 1]
    return kernels.cache_16 or not (isinstance(n_q, tirx.IntImm) and n_q.value == 1)


def _broadcast_mask(bb: relax.BlockBuilder, mask: Mask, scores: list[PrimExpr], sizes: Sizes) -> tuple[relax.Expr, str]:
    """The mask as the kernel reads it, (B|1, h|1, n|1, n_kv|1), and the axes it varies along."""
    shape = shape_of(mask.value, "the attention mask")
    if not 1 <= len(shape) <= 4:
        raise TvmAttnError(f"an attention mask of rank {len(shape)}: it must broadcast to (B, h, n, n_kv)")
    one = tirx.IntImm("int64", 1)
    shape = [one] * (4 - len(shape)) + shape
    broadcast = [isinstance(m, tirx.IntImm) and m.value == 1 for m in shape]
    dims = "".join(axis for axis, b in zip("bhst", broadcast) if not b)
    value = mask.value
    if len(shape_of(value, "the attention mask")) != 4:
        value = bb.emit(relax.op.reshape(value, shape))
    value = _conform(bb, value, [one if b else s for b, s in zip(broadcast, scores)], sizes, "the attention mask")
    want = "bool" if mask.kind == "bool" else "float32"
    if str(value.ty.dtype) != want:
        value = bb.emit(relax.op.astype(value, want))
    return value, dims

