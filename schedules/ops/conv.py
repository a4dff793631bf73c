"""Convolutions as GEMMs on the micro-kernel (im2col), rewritten in Relax before legalisation.

A transformer's convolutions are its front end (ViT / CLIP / SigLIP patch embedding: stride =
kernel; Whisper's and Wav2Vec2's 1-D convolutions over audio frames). TVM legalises a convolution
to one reduction block that no rule tiles (it ran on the fallback rule at 2 GFLOP/s). Rewritten as

    cols = im2col(x)        (B, OH, OW, C, KH, KW) → (B, OH·OW, C·KH·KW), with groups (B, g, OH, OW,
                            C/g, KH, KW) → (B, g, OH·OW, C/g·KH·KW): a copy, the `injective` rule's
                            (vectorised along KW, contiguous in x's rows); 1-D: channels last,
                            (B, OL, K, C) from x (B, L, C) (`_im2col_nwc`)
    y    = cols · W'        W' (C/g·KH·KW, N) or (g, C/g·KH·KW, N/g), folded from the constant weight
                            at compile time: the `matmul` rule's GEMM, its weight packed
    out  = y back to NCHW   (a transposition that Relax fuses into the consumer: a ViT flattens and
                            transposes it straight back)

every stride, padding, dilation and group count runs at the GEMM's rate; the copy costs one pass
over KH·KW/(SH·SW) times the input (once the input for a patch embedding). A depthwise convolution (one
output channel per group) sums its taps in place instead: channels last where its input is a
transformer's tokens viewed as an image (`_depthwise_nhwc`; the model's transpositions cancel), else
channels first over a padded copy (`_margins`, `_per_channel`). An average pooling without padding (SEW's
frames pooled by 2) is such a depthwise convolution, each tap weighed 1/k: TVM's pooling is a reduction
block, which no rule takes (it ran on the fallback rule, with the GELU before it fused in).
"""

from __future__ import annotations

import functools

import numpy as np
import tvm
from tvm import relax, te, tirx

from tvmattn.compiler.annotations import OP_PATTERN, OUT_ELEMWISE_FUSABLE
from tvmattn.schedules.ops.rewrite import rewrite_functions

MAX_TAPS = 64  # a per-channel convolution's terms, unrolled (a larger one stays TVM's)
MARGIN = 16  # the zeros before a depthwise convolution's rows: a whole vector (`_margins`)
_CONVS = {"relax.nn.conv1d": ("NCW", "OIW"), "relax.nn.conv2d": ("NCHW", "OIHW")}
_POOLS = {"relax.nn.avg_pool1d": "NCW", "relax.nn.avg_pool2d": "NCHW"}


def conv_as_gemm(dtype: str | None = None, row_block: int | None = None) -> tvm.transform.Pass:
    """The pass rewriting every convolution of a supported layout with a constant weight as im2col +
    GEMM. With ``dtype`` (a 16-bit import's, `precision`), an fp32 input is converted before the copy,
    not after: the copy moves half the bytes, the conversion joins x's producer (a GELU), and the GEMM
    reads the copy through a widening that `precision` cancels, exactly. With ``row_block`` (the rows a
    bf16 GEMM pads to: AMX's blocks, the dot product's tiles), a 1-D convolution's copy writes its
    static rows in whole blocks of them (`_im2col_nwc`)."""

    @tvm.transform.module_pass(opt_level=0, name="tvmattn.ConvAsGemm")
    def transform(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return _ConvAsGemm(mod, dtype, row_block).run()

    return transform


@relax.expr_functor.mutator
class _ConvAsGemm(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, dtype: str | None = None, row_block: int | None = None) -> None:
        super().__init__(mod)
        self.mod_, self.dtype, self.row_block = mod, dtype, row_block

    def run(self) -> tvm.IRModule:
        return rewrite_functions(self, self.mod_)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") in _POOLS:
            return self._pool(call)
        layouts = _CONVS.get(getattr(call.op, "name", ""))
        if layouts is None or not _supported(call, layouts):
            return call
        return self._as_gemm(call)

    def _pool(self, call: relax.Call) -> relax.Expr:
        """An average pooling without padding as a depthwise convolution of weights 1/k (`_depthwise`), else
        ``call``."""
        a, x = call.attrs, call.args[0]
        ty = x.ty
        kernel, strides, dilation = ([int(v) for v in t] for t in (a.pool_size, a.strides, a.dilation))
        if str(a.layout) != _POOLS[call.op.name] or str(a.out_layout) not in ("", str(a.layout)) or a.ceil_mode \
                or any(int(p) for p in a.padding) or not isinstance(ty, relax.TensorType) or ty.shape is None \
                or str(ty.dtype) not in ("float32", "float16", "bfloat16") or int(np.prod(kernel)) > MAX_TAPS \
                or not isinstance(list(ty.shape)[1], tirx.IntImm):
            return call
        channels, spatial = int(list(ty.shape)[1]), list(ty.shape)[2:]
        w = np.full((channels, 1, *kernel), 1 / np.prod(kernel), np.float32)  # (NumPy has no bfloat16)
        padding = [0] * 2 * len(kernel)
        out_sizes = _out_sizes(spatial, kernel, strides, padding, dilation)
        return self._depthwise(x, relax.const(w, str(ty.dtype)), strides, padding, dilation, out_sizes)

    def _as_gemm(self, call: relax.Call) -> relax.Expr:
        x, weight = call.args
        a = call.attrs
        w = weight.value.numpy()
        dims = w.ndim - 2  # 1 or 2 spatial dimensions
        n_out, c_group, kernel = w.shape[0], w.shape[1], w.shape[2:]
        groups = int(a.groups)
        strides, dilation = [int(s) for s in a.strides], [int(d) for d in a.dilation]
        padding = [int(p) for p in a.padding]  # before each dimension, then after each
        shape = list(x.ty.shape)
        spatial = shape[2:]
        out_sizes = _out_sizes(spatial, kernel, strides, padding, dilation)
        if n_out == groups:  # one column per group (depthwise): a GEMM of width 1; the taps summed in place
            tokens = self._tokens(x) if c_group == 1 and dims == 2 else None
            if tokens is not None:
                return self._depthwise_channels_last(tokens, shape, w, strides, padding, dilation, out_sizes)
            return self._depthwise(x, relax.const(w), strides, padding, dilation, out_sizes)
        batch = shape[0]
        positions = out_sizes[0] if dims == 1 else out_sizes[0] * out_sizes[1]
        k = c_group * int(np.prod(kernel))
        narrowed = self.dtype is not None and str(x.ty.dtype) == "float32"
        if narrowed:
            x = self.builder_.emit(relax.op.astype(x, self.dtype))
        if narrowed and self.row_block and groups == 1 and dims == 2 and k % 2:
            # one zero channel: the bf16 dot product takes the reduction in pairs, and an odd one (an RGB
            # stem's 3·7·7 = 147) ran widened to fp32 FMAs, SegFormer's first GEMM at 200 GFLOP/s
            x = self.builder_.emit(relax.op.nn.pad(x, [0, 0, 0, 1, 0, 0, 0, 0]))
            w = np.concatenate([w, np.zeros((n_out, 1, *kernel), w.dtype)], axis=1)
            k += int(np.prod(kernel))
        rows = positions
        if dims == 1:  # channels last, the taps outside the channels: (…, K, C/g) rows
            x = self.builder_.emit(relax.op.permute_dims(x, [0, 2, 1]))
            block = self.row_block
            if narrowed and block and isinstance(positions, tirx.IntImm) and int(positions) % block:
                rows = tirx.IntImm("int64", -(-int(positions) // block) * block)
            cols = self.builder_.emit_te(_im2col_nwc, x, kernel[0], strides[0], padding[0], dilation[0],
                                         out_sizes[0], groups, None if rows is positions else int(rows),
                                         primfunc_name_hint="im2col")
            w = w.transpose(0, 2, 1)  # (N, K, C/g): the reduction in the rows' order
        else:
            if any(padding):  # padded once, apart: the copy then reads whole vectors of x, not every tap tested
                x = self.builder_.emit_te(_margins, x, padding, padding[dims - 1], primfunc_name_hint="pad")
            cols = self.builder_.call_te(_im2col, x, kernel, strides, dilation, out_sizes, groups,
                                         primfunc_name_hint="im2col")
            cols = self.builder_.emit(self._apart(cols) if any(padding) else cols)
        if groups == 1:
            flat = self.builder_.emit(relax.op.reshape(cols, [batch, rows, k]))
            panel = w.reshape(n_out, k).T  # (C·KH·KW, N): the GEMM's (reduction, columns)
        else:  # a batch GEMM over the groups
            flat = self.builder_.emit(relax.op.reshape(cols, [batch, groups, rows, k]))
            panel = w.reshape(groups, n_out // groups, k).transpose(0, 2, 1)
        if narrowed:
            flat = self.builder_.emit(relax.op.astype(flat, "float32"))
        y = self.builder_.emit(relax.op.matmul(flat, relax.const(np.ascontiguousarray(panel))))
        if rows is not positions:  # the zero rows' products off again, in the GEMM's epilogue
            y = self.builder_.emit(relax.op.strided_slice(y, axes=[len(y.ty.shape) - 2], begin=[0], end=[positions]))
        if groups == 1:  # (B, P, N) → (B, N, P)
            y = self.builder_.emit(relax.op.permute_dims(y, [0, 2, 1]))
        else:  # (B, g, P, N/g) → (B, g, N/g, P)
            y = self.builder_.emit(relax.op.permute_dims(y, [0, 1, 3, 2]))
        return relax.op.reshape(y, [batch, n_out, *out_sizes])

    def _depthwise(self, x: relax.Expr, w: relax.Constant, strides, padding, dilation, out_sizes) -> relax.Expr:
        """A depthwise convolution: padded first (`_margins`), then every tap a plain load, vectors along
        the output's rows. The convolution keeps its padded input apart (TVM's own convolutions do the
        same): fused in, each tap of each lane tested the padding again and the copy ran scalar."""
        dims = len(out_sizes)
        offsets = [0] * dims
        if any(padding):
            margin = -(-padding[dims - 1] // MARGIN) * MARGIN  # at least the padding, whole vectors
            x = self.builder_.emit_te(_margins, x, padding, margin, primfunc_name_hint="pad")
            offsets = [0] * (dims - 1) + [margin - padding[dims - 1]]  # (x's row r is the padded r + top)
        # the call itself, not a variable bound to it: fusion does not see through a binding of one
        # variable to another, and the bias and activation after it ran as functions of their own
        out = self.builder_.call_te(_per_channel, x, w, strides, offsets, dilation, out_sizes,
                                    primfunc_name_hint="conv_per_channel")
        return self._apart(out) if any(padding) else out

    def _tokens(self, x: relax.Expr) -> relax.Expr | None:
        """y (B, H·W, C) where x (B, C, H, W) is ``reshape(permute_dims(y, [0, 2, 1]))``: a transformer's
        tokens viewed as an image (SegFormer's and PVT's convolutions in their MLPs), else None."""
        bound = self.lookup_binding(x) if isinstance(x, relax.Var) else None
        if not isinstance(bound, relax.Call) or getattr(bound.op, "name", "") != "relax.reshape":
            return None
        source = bound.args[0]
        permuted = self.lookup_binding(source) if isinstance(source, relax.Var) else None
        if not isinstance(permuted, relax.Call) or getattr(permuted.op, "name", "") != "relax.permute_dims" \
                or permuted.attrs.axes is None or [int(a) for a in permuted.attrs.axes] != [0, 2, 1]:
            return None
        y = permuted.args[0]
        dims = getattr(getattr(y.ty, "shape", None), "values", None)
        b, c, h, w = x.ty.shape.values
        analyzer = tvm.sym.Analyzer()
        if dims is None or len(dims) != 3 or not all(analyzer.can_prove_equal(p, q) for p, q in
                                                     zip(dims, (b, h * w, c))):
            return None
        return y

    def _depthwise_channels_last(self, tokens: relax.Expr, image: list, w: np.ndarray, strides, padding,
                                 dilation, out_sizes) -> relax.Expr:
        """A depthwise convolution of tokens (B, H·W, C) viewed as the ``image`` (B, C, H, W), computed
        channels last: each tap a vector along the channels, its padding test the same for all of them
        (a branch a vector); handed back channels-first as the model has it, where the model's own
        transposition back to tokens cancels it (`layout.cancel_transposes`). Channels-first, the
        model's transpositions each way (with the activation after them) cost SegFormer more than the
        convolution itself."""
        batch, channels, height, width = image
        x = self.builder_.emit(relax.op.reshape(tokens, [batch, height, width, channels]))
        taps = relax.const(np.ascontiguousarray(w[:, 0].transpose(1, 2, 0)))  # (KH, KW, C)
        z = self.builder_.emit(self.builder_.call_te(_depthwise_nhwc, x, taps, strides, padding, dilation, out_sizes,
                                                     primfunc_name_hint="conv_per_channel"))
        return relax.op.permute_dims(z, [0, 3, 1, 2])

    def _apart(self, call: relax.Call) -> relax.Call:
        """``call`` (of a function reading a padded copy) with no producer fused into it: fused, the padding
        is tested again in every tap of every lane (a branch per element, where a select would read outside
        x), as TVM keeps the padding of its own convolutions apart; consumers that are elementwise (a bias,
        an activation) still join it."""
        gv = call.args[0]
        self.builder_.update_func(gv, self.builder_.get()[gv].with_attr(OP_PATTERN, OUT_ELEMWISE_FUSABLE))
        return call


def _out_sizes(spatial: list, kernel, strides: list[int], padding: list[int], dilation: list[int]) -> list:
    """A convolution's (or pooling's) output sizes, ``padding`` before each axis then after each; simplified: a
    symbolic size kept as (n - 1) // 1 + 1 differs from n for the functions after it (a LayerNorm over it
    took a size parameter of its own, and no rule scheduled it)."""
    dims = len(spatial)
    return [tvm.sym.Analyzer().simplify((spatial[i] + padding[i] + padding[dims + i]
                                         - dilation[i] * (kernel[i] - 1) - 1) // strides[i] + 1) for i in range(dims)]


def _supported(call: relax.Call, layouts: tuple[str, str]) -> bool:
    a = call.attrs
    x, weight = call.args
    ty = x.ty
    per_channel = isinstance(weight, tvm.ir.GenericConst) and int(weight.value.shape[0]) == int(a.groups)
    if per_channel and int(np.prod(weight.value.shape[1:])) > MAX_TAPS:
        return False
    return (str(a.data_layout) == layouts[0] and str(a.kernel_layout) == layouts[1]
            and str(a.out_layout) in (layouts[0], "") and isinstance(weight, tvm.ir.GenericConst)
            and isinstance(ty, relax.TensorType) and ty.shape is not None
            and str(ty.dtype) in ("float32", "float16", "bfloat16")
            and (a.out_dtype is None or str(a.out_dtype) in ("", str(ty.dtype)))
            and isinstance(list(ty.shape)[1], tirx.IntImm))


def _im2col(x: te.Tensor, kernel, strides, dilation, out_sizes, groups: int = 1) -> te.Tensor:
    """(B, OH, OW, C, KH, KW): each output position's receptive field in x (padded already, `_margins`).
    With groups, (B, g, OH, OW, C/g, KH, KW): each group's rows contiguous, as its GEMM reads them (a
    transposition after the copy cost Wav2Vec2's positional convolution, 128 taps, a second pass over
    128 times its input)."""
    dims = len(kernel)
    if groups == 1:
        return te.compute((x.shape[0], *out_sizes, x.shape[1], *kernel),
                          lambda b, *i: _tap(x, b, i[dims], i[:dims], i[dims + 1:], strides, dilation),
                          name="im2col")
    per_group = int(x.shape[1]) // groups
    return te.compute((x.shape[0], groups, *out_sizes, per_group, *kernel),
                      lambda b, g, *i: _tap(x, b, g * per_group + i[dims], i[:dims], i[dims + 1:], strides,
                                            dilation),
                      name="im2col")


def _im2col_nwc(x: te.Tensor, kernel: int, stride: int, padding: int, dilation: int, out_size,
                groups: int, rows=None) -> te.Tensor:
    """A 1-D convolution's rows from channels-last x (B, L, C): (B, OL, K, C), with groups (B, g, OL, K,
    C/g); zero in the padding. Vectors along the channels, contiguous in x: a convolution's input is
    mostly the previous GEMM's output, (B, L, C) in memory, which TVM fuses in (the model's transpose to
    NCW and this one cancel, a GELU between them included). In NCW order, (…, C, K), the copy had K = 3
    taps innermost, too few for a vector, and ran scalar. With ``rows`` (more than OL), zero rows after
    OL up to them: a bf16 GEMM takes its rows in whole blocks (`conv_as_gemm`'s), and padded by the GEMM
    the whole copy was copied again (Wav2Vec2's 2 × 3199 rows of 1536: 20 MB for two rows)."""
    per_group = int(x.shape[2]) // groups
    rows = out_size if rows is None else rows

    extra = rows is not out_size  # zero rows after OL

    def row(b, g, p, tap, c):
        q = p * stride + tap * dilation - padding
        inside = ([p < out_size] if extra else []) + ([0 <= q] if padding else []) + \
            ([q < x.shape[1]] if extra or padding else [])
        if not inside:
            return x[b, q, g * per_group + c]
        # the same for every channel: one test per vector; a branch, not a select (which reads both sides)
        return tirx.if_then_else(tirx.all(*inside), x[b, q, g * per_group + c], tirx.const(0, x.dtype))

    if groups == 1:
        return te.compute((x.shape[0], rows, kernel, x.shape[2]), lambda b, p, tap, c: row(b, 0, p, tap, c),
                          name="im2col")
    return te.compute((x.shape[0], groups, rows, kernel, per_group), row, name="im2col")


def _margins(x: te.Tensor, padding, margin: int) -> te.Tensor:
    """x with zeros around its spatial axes: ``padding`` (before each, then after each), but ``margin``
    (whole vectors) before the last axis, and that axis rounded up to multiples of `MARGIN` where static: each
    bound of the padding then falls between vectors, and the copy runs in whole vectors
    (`injective._uniform_lanes`)."""
    dims = len(padding) // 2
    sizes = [x.shape[2 + i] for i in range(dims)]
    before = [*padding[:dims - 1], margin]
    shape = [sizes[i] + padding[i] + padding[dims + i] for i in range(dims - 1)]
    last = margin + sizes[-1] + padding[-1]
    shape.append(-(-int(last) // MARGIN) * MARGIN if isinstance(last, (int, tirx.IntImm)) else last)

    def value(b, c, *i):
        coords = [i[k] - before[k] for k in range(dims)]
        inside = tirx.all(*[tirx.all(0 <= q, q < sizes[k]) for k, q in enumerate(coords)])
        # a branch, not a select: TVM simplifies away a clamp of the index under a select's own test, and a
        # select loads both sides (x[-1] before the start of x)
        return tirx.if_then_else(inside, x[(b, c, *coords)], tirx.const(0, x.dtype))

    return te.compute((x.shape[0], x.shape[1], *shape), value, name="pad")


def _depthwise_nhwc(x: te.Tensor, w: te.Tensor, strides, padding, dilation, out_sizes) -> te.Tensor:
    """out[b, i, j, c] = Σ over the taps of x[b, i·s + t·d − pad, j·s + u·d − pad, c] · w[t, u, c], zero
    in the padding: a tap's test is on (i, j) alone, one branch for a whole vector of channels."""
    kernel = [int(k) for k in w.shape[:2]]
    sizes = [x.shape[1], x.shape[2]]

    def out(b, i, j, c):
        terms = []
        for taps in np.ndindex(*kernel):
            coords = [p * strides[k] + taps[k] * dilation[k] - padding[k] for k, p in enumerate((i, j))]
            tests = [0 <= q for k, q in enumerate(coords) if padding[k]] + \
                [q < sizes[k] for k, q in enumerate(coords) if padding[2 + k]]  # (no padding: inside x)
            value = x[b, coords[0], coords[1], c]
            if tests:  # a branch, not a select, which would load outside x
                value = tirx.if_then_else(tirx.all(*tests), value, tirx.const(0, x.dtype))
            terms.append(value * w[taps[0], taps[1], c])
        return functools.reduce(lambda s, t: s + t, terms)

    return te.compute((x.shape[0], *out_sizes, x.shape[3]), out, name="conv_per_channel")


def _per_channel(x: te.Tensor, w: te.Tensor, strides, offsets, dilation, out_sizes) -> te.Tensor:
    """out[b, o, pos] = Σ over o's group's channels and the taps of x · w, unrolled (at most `MAX_TAPS`
    terms), x read at ``pos · stride + tap · dilation + offset`` (x padded already: every read inside it):
    elementwise along the output positions, the `injective` rule's."""
    per_group, kernel = [int(s) for s in w.shape[1:2]][0], [int(s) for s in w.shape[2:]]

    def out(b, o, *pos):
        terms = [x[(b, o * per_group + ci, *[pos[i] * strides[i] + taps[i] * dilation[i] + offsets[i]
                                             for i in range(len(pos))])] * w[(o, ci, *taps)]
                 for ci in range(per_group) for taps in np.ndindex(*kernel)]
        return functools.reduce(lambda s, t: s + t, terms)

    return te.compute((x.shape[0], w.shape[0], *out_sizes), out, name="conv_per_channel")


def _tap(x: te.Tensor, b, c, pos, taps, strides, dilation):
    """x (padded already) at output position ``pos``'s tap ``taps`` of channel ``c``."""
    return x[(b, c, *[pos[i] * strides[i] + taps[i] * dilation[i] for i in range(len(pos))])]
