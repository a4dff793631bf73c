"""Multi-head attention as a TVM tensor expression, one `te.compute` per stage of the seeds.

    x (B,n,d) ──q_proj──► (B,n,h·d_k) ──q_heads──► (B,h,n,d_k) ─┐
    x_kv (B,n_kv,d) ─k_proj/v_proj─► k_heads, v_heads (B,h_kv,n_kv,d_k|d_v)
    scores  = q·kᵀ                         (B,h,n,n_kv)   fp32 accumulation
    logits  = log2(e)·(cap(scale·scores)   (B,h,n,n_kv)   cap: softcap·tanh(·/softcap) if set;
                       + alibi + bias),    masked to -inf alibi: slope·distance (`variant.alibi`),
                                                          bias: an additive attn_mask
    row_max = max_t logits                 (B,h,n)
    probs   = exp2(logits - row_max)       (B,h,n,n_kv)   = exp(x - max x); 0 where masked
    row_sum = Σ_t probs                    (B,h,n)
    pv      = probs·v                      (B,h,n,d_v)
    attn    = pv / row_sum                 (B,h,n,d_v)    0 for a row that sees no key; with sinks,
                                                          pv / (row_sum + exp2(log2(e)·sink - row_max))
    merged  = heads side by side           (B,n,h·d_v)
    out     = merged·W_O                   (B,n,d)

The core kernel (``projections=False``) starts at q, k, v in the spec's layout and ends at attn in
that layout, or, when ``spec.output`` names one, at an intermediate (B,h,n,n_kv) stage. Built with a
``block`` (the CPU's bf16 dot products), symbolic lengths run in whole blocks from scores to pv, with
the queries, keys, values and a per-query mask padded as stages of their own, q_rows, k_rows, v_rows
and mask_rows (`_core`). Cross-attention, GQA, both layouts and broadcast masks only change index maps.

Axis names are part of the contract: b batch, i query head, s query position, t key position,
e the q·k dot product, c a value column. TVM names a block's iterators after them (v_b, v_s, v_t, …),
and the stages that range over keys carry ``tvmattn.key_stage``: the block-skipping pass reads both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection

from tvm import te, tirx
from tvm.ir.expr import Expr as PrimExpr

from tvmattn.compiler import arguments, variant
from tvmattn.compiler.annotations import KEY_BLOCKS, KEY_STAGE
from tvmattn.compiler.spec import AttentionSpec, Dim
from tvmattn.compiler.variant import ACC, MASK_AXES, Operand, size_expr

LOG2E = 1.4426950408889634  # 1/ln 2: the softmax runs in base 2, exp(x) = exp2(x·log2 e)

Reader = Callable[..., PrimExpr]  # (b, head, pos, c) -> element


@dataclass
class AttentionTE:
    """The tensor expression of one spec: inputs in call order, the output, every named stage."""

    spec: AttentionSpec
    inputs: list[te.Tensor]
    output: te.Tensor
    stages: dict[str, te.Tensor]
    dims: dict[str, tirx.Var]  # symbolic sizes by name

    def prim_func(self) -> tirx.PrimFunc:
        return te.create_prim_func(self.inputs + [self.output]).with_attr("global_symbol", "main")


def attention_te(spec: AttentionSpec, block: int = 1, parts: Collection[str] = (), half_keys: int = 0) -> AttentionTE:
    """Build the tensor expression of ``spec`` (see the module docstring for the stages); ``block``:
    the core's symbolic lengths run in whole blocks of it; ``parts``: the products whose fp16
    operands are sums of two bf16 parts (`bf16_parts`), "core" (QKᵀ and P·V, `_core`) and any of the
    projections, q_proj, k_proj, v_proj and out (`linear`); ``half_keys``: fp16 P·V summed in fp16
    over blocks of that many keys (`_core`)."""
    dims: dict[str, tirx.Var] = {}

    def dim(x: Dim):
        return dims.setdefault(x, te.var(x)) if isinstance(x, str) else x

    stages: dict[str, te.Tensor] = {}
    inputs: list[te.Tensor] = []
    if spec.projections:
        q_at, k_at, v_at = _projections(spec, dim, inputs, stages, parts)
    else:
        q_at, k_at, v_at = _core_inputs(spec, dim, inputs, stages)
    _core(spec, dim, inputs, stages, q_at, k_at, v_at, block, "core" in parts, half_keys)
    out = _epilogue(spec, dim, stages, {t.op.name: t for t in inputs}, "out" in parts)
    return AttentionTE(spec, inputs, out, stages, dims)


# ---- prologue: q, k, v as (b, head, pos, c) readers ---------------------------------------------
def _projections(spec: AttentionSpec, dim: Callable, inputs: list[te.Tensor], stages: dict[str, te.Tensor],
                 parts: Collection[str] = ()) -> tuple[Reader, Reader, Reader]:
    """X → W_Q, W_K, W_V → head split; W_O joins the inputs here for the call order. A projection
    in ``parts`` reads its x's parts, {x}_hi and {x}_lo, stages shared with the others."""
    B, n, n_kv, d, dt = dim(spec.batch), dim(spec.n_q), dim(spec.n_kv), spec.d, spec.dtype
    x = te.placeholder((B, n, d), dt, "x")
    x_kv = te.placeholder((B, n_kv, d), dt, "x_kv") if spec.is_cross else x
    w_q = te.placeholder((d, spec.h * spec.d_k), dt, "w_q")
    w_k = te.placeholder((d, spec.h_kv * spec.d_k), dt, "w_k")
    w_v = te.placeholder((d, spec.h_kv * spec.d_v), dt, "w_v")
    w_o = te.placeholder((spec.h * spec.d_v, d), dt, "w_o")
    inputs += [x] + ([x_kv] if spec.is_cross else []) + [w_q, w_k, w_v, w_o]
    for c, src, w, heads, width in (("q", x, w_q, spec.h, spec.d_k), ("k", x_kv, w_k, spec.h_kv, spec.d_k),
                                    ("v", x_kv, w_v, spec.h_kv, spec.d_v)):
        name = f"{c}_proj"
        x_parts = _parts_of_input(stages, src) if name in parts else None
        stages[name] = linear(src, w, name, x_parts)  # (B, n, heads·width)
        stages[f"{c}_heads"] = _split_heads(stages[f"{c}_proj"], heads, width, f"{c}_heads")  # (B, heads, n, width)
    return tuple(_reader(stages[f"{c}_heads"], Operand("BHSD", 0, 0)) for c in "qkv")


def _core_inputs(spec: AttentionSpec, dim: Callable, inputs: list[te.Tensor],
                 stages: dict[str, te.Tensor]) -> tuple[Reader, Reader, Reader]:
    """q, k, v in the spec's layout."""
    shapes = spec.input_shapes()
    q, k, v = (te.placeholder(tuple(dim(x) for x in shapes[name]), spec.dtype, name) for name in "qkv")
    inputs += [q, k, v]
    return tuple(_reader(t, Operand(spec.layout, 0, 0)) for t in (q, k, v))


# ---- the core: scores → logits → softmax → P·V ---------------------------------------------------
def _core(spec: AttentionSpec, dim: Callable, inputs: list[te.Tensor], stages: dict[str, te.Tensor],
          q_at: Reader, k_at: Reader, v_at: Reader, block: int = 1, parts: bool = False, half_keys: int = 0) -> None:
    """scores … pv. With ``block`` > 1, a symbolic query or key length L, or a static one that is no
    multiple of it, runs to `_whole` blocks, so a kernel's tiles never end inside a block (a tensor
    intrinsic takes no tail predicate): the rows past L read row L-1 again, the keys past it are
    hidden, and the epilogue stores rows < n only.
    The queries, keys and values then have stages of their own, q_rows (B, h, n_rows, d_k), k_rows
    (B, h_kv, n_keys, d_k) and v_rows (B, h_kv, n_keys, d_v), that the schedule packs or inlines; so
    has an attn_mask that varies along queries and keys, mask_rows (its clamped index inside a packed
    tile overflows TVM's simplifier).

    With ``parts`` (fp16 on bf16 tile products, `bf16_parts`), each operand of QKᵀ and P·V is the sum
    of two bf16 stages, q_hi + q_lo, k_hi + k_lo, P's p_hi + p_lo, v_hi + v_lo (they replace q_rows,
    k_rows and v_rows), and each product is hi·hi + hi·lo + lo·hi.

    With ``half_keys`` (fp16 on a CPU's fp16 FMAs, a static n_kv in whole blocks of it), P·V's products
    and sums are fp16 within each block of that many keys, pv_block (B, h, n_rows, n_kv/half_keys, d_v),
    and the blocks' sums are added in fp32: fp16 sums over all keys would stop growing (2048 + 1 is 2048),
    over a block they err by about fp16's rounding of the block's sum. QKᵀ keeps fp32 sums: an error
    in a logit is one in exp's argument, which fp16 sums over d_k make exceed fp16's tolerance."""
    B, n, n_kv, h, g = dim(spec.batch), dim(spec.n_q), dim(spec.n_kv), spec.h, spec.group
    pad_rows, pad_keys = (block > 1 and (not isinstance(x, int) or x % block > 0) for x in (n, n_kv))
    n_rows = (n + block - 1) // block * block if pad_rows else n  # as the split of n by the tile writes it
    n_keys = (_whole(n_kv, block) if isinstance(n_kv, tirx.Var) else -(-n_kv // block) * block) if pad_keys else n_kv
    row = (lambda s: tirx.min(s, n - 1)) if pad_rows else (lambda s: s)  # noqa: E731
    key = (lambda t: tirx.min(t, n_kv - 1)) if pad_keys else (lambda t: t)  # noqa: E731
    q_in, k_in, v_in = q_at, k_at, v_at
    q_at = lambda b, i, s, e: q_in(b, i, row(s), e)  # noqa: E731
    k_at = lambda b, i, t, e: k_in(b, i, key(t), e)  # noqa: E731
    v_at = lambda b, i, t, c: v_in(b, i, key(t), c)  # noqa: E731
    if parts:  # (the stages of the parts read the clamped rows and keys)
        q_parts = _parts(stages, "q", (B, h, n_rows, spec.d_k), q_at)
        k_parts = _parts(stages, "k", (B, spec.h_kv, n_keys, spec.d_k), k_at)
        v_parts = _parts(stages, "v", (B, spec.h_kv, n_keys, spec.d_v), v_at)
    if pad_rows and not parts:
        q_rows = stages["q_rows"] = te.compute((B, h, n_rows, spec.d_k), q_at, name="q_rows")
        q_at = lambda b, i, s, e: q_rows[b, i, s, e]  # noqa: E731
    if pad_keys and not parts:
        k_rows = stages["k_rows"] = te.compute((B, spec.h_kv, n_keys, spec.d_k), k_at, name="k_rows")
        k_at = lambda b, i, t, e: k_rows[b, i, t, e]  # noqa: E731
        v_rows = stages["v_rows"] = te.compute((B, spec.h_kv, n_keys, spec.d_v), v_at, name="v_rows")
        v_at = lambda b, i, t, c: v_rows[b, i, t, c]  # noqa: E731
    # kv_lens, attn_mask, sinks (read by the epilogue: `variant.denominator`), alibi_slopes
    extras = {a.name: te.placeholder(tuple(dim(x) for x in a.shape(spec)), a.dtype(spec), a.name)
              for a in arguments.extras(spec)}
    inputs += extras.values()
    if spec.key_padding:
        kv_len = lambda b: extras["kv_lens"][b]  # noqa: E731
    else:
        kv_len = lambda b: size_expr(n_kv)  # noqa: E731
    mask_in = _attn_mask(spec, extras.get("attn_mask"))
    slope = (lambda i: extras["alibi_slopes"][i]) if spec.alibi is not None else (lambda i: None)  # noqa: E731
    mask_at = lambda b, i, s, t: mask_in(b, i, row(s), key(t))  # noqa: E731
    if spec.attn_mask is not None and (pad_rows or pad_keys) and {"s", "t"} <= set(spec.attn_mask_dims):
        # a stage of its own, like q_rows: the schedule packs it per tile
        full = dict(zip(MASK_AXES, (B, h, n_rows, n_keys)))
        shape = tuple(full[a] if a in spec.attn_mask_dims else 1 for a in MASK_AXES)
        mask_rows = stages["mask_rows"] = te.compute(shape, mask_at, name="mask_rows")
        mask_at = lambda b, i, s, t: mask_rows[tuple(variant.mask_index(spec, b, i, s, t))]  # noqa: E731

    def visible(b, i, s, t):
        past_the_end = (t < n_kv,) if pad_keys else ()
        return variant.sees(spec, s, t, kv_len(b), size_expr(n), mask_at(b, i, s, t), *past_the_end)

    e = te.reduce_axis((0, spec.d_k), "e")
    if parts:
        product = lambda b, i, s, t: _sum_of_parts(q_parts, k_parts, (b, i, s, e), (b, i // g, t, e))  # noqa: E731
    else:
        product = lambda b, i, s, t: q_at(b, i, s, e).astype(ACC) * k_at(b, i // g, t, e).astype(ACC)  # noqa: E731
    scores = te.compute(  # (B, h, n_rows, n_keys): n, n_kv unless padded
        (B, h, n_rows, n_keys), lambda b, i, s, t: te.sum(product(b, i, s, t), axis=e),
        name="scores", attrs={KEY_STAGE: 1})
    # In base 2 (log2 e folded into the scale's multiply: exp2 is the cheaper polynomial), but in
    # natural units where the kernel returns them: then no softmax follows.
    base = 1.0 if spec.output == "logits" else LOG2E
    logits = te.compute(
        (B, h, n_rows, n_keys),
        lambda b, i, s, t: tirx.Select(visible(b, i, s, t),
                                       variant.logit(spec, scores[b, i, s, t], s, t, kv_len(b), size_expr(n),
                                                     mask_at(b, i, s, t), slope(i), base),
                                       -tirx.infinity(ACC)),
        name="logits", attrs={KEY_STAGE: 1})
    t = te.reduce_axis((0, n_keys), "t")
    row_max = te.compute((B, h, n_rows), lambda b, i, s: te.max(logits[b, i, s, t], axis=t),
                         name="row_max", attrs={KEY_STAGE: 1})
    probs = te.compute(
        (B, h, n_rows, n_keys),
        lambda b, i, s, t: tirx.Select(visible(b, i, s, t), tirx.exp2(logits[b, i, s, t] - row_max[b, i, s]),
                                       tirx.const(0, ACC)),
        name="probs", attrs={KEY_STAGE: 1})
    t = te.reduce_axis((0, n_keys), "t")
    row_sum = te.compute((B, h, n_rows), lambda b, i, s: te.sum(probs[b, i, s, t], axis=t),
                         name="row_sum", attrs={KEY_STAGE: 1})
    t = te.reduce_axis((0, n_keys), "t")
    if parts:
        # (key-major, (B, h, n_keys, n_rows): as P's panels pack pairs of keys)
        p_parts = _parts(stages, "p", (B, h, n_keys, n_rows), lambda b, i, t, s: probs[b, i, s, t])
        weighted = lambda b, i, s, c: _sum_of_parts(p_parts, v_parts, (b, i, t, s), (b, i // g, t, c))  # noqa: E731
    else:
        weighted = lambda b, i, s, c: probs[b, i, s, t] * v_at(b, i // g, t, c).astype(ACC)  # noqa: E731
    if half_keys:
        pv = _pv_in_half(stages, (B, h, n_rows, n_keys, spec.d_v), probs, lambda b, i, t, c: v_at(b, i // g, t, c),
                         half_keys)
    else:
        pv = te.compute((B, h, n_rows, spec.d_v), lambda b, i, s, c: te.sum(weighted(b, i, s, c), axis=t),
                        name="pv", attrs={KEY_STAGE: 1})
    stages.update(scores=scores, logits=logits, row_max=row_max, probs=probs, row_sum=row_sum, pv=pv)


def _pv_in_half(stages: dict[str, te.Tensor], shape: tuple, probs: te.Tensor, v_at: Reader, keys: int) -> te.Tensor:
    """pv in fp32 as the sum of pv_block, fp16 P·V over blocks of ``keys`` keys (`_core`); both stages
    range over keys in whole blocks (`KEY_BLOCKS`: the key stages compute whole blocks, P 0 where hidden)."""
    B, h, n_rows, n_keys, d_v = shape
    blocks = f"b=v_b,s=v_s,t=v_tb*{keys}"
    ti = te.reduce_axis((0, keys), "ti")
    pv_block = stages["pv_block"] = te.compute(  # (B, h, n_rows, n_keys/keys, d_v) fp16
        (B, h, n_rows, n_keys // keys, d_v),
        lambda b, i, s, tb, c: te.sum(probs[b, i, s, tb * keys + ti].astype("float16")
                                      * v_at(b, i, tb * keys + ti, c).astype("float16"), axis=ti),
        name="pv_block", attrs={KEY_STAGE: 1, KEY_BLOCKS: blocks})
    tb = te.reduce_axis((0, n_keys // keys), "tb")
    return te.compute((B, h, n_rows, d_v), lambda b, i, s, c: te.sum(pv_block[b, i, s, tb, c].astype(ACC), axis=tb),
                      name="pv", attrs={KEY_STAGE: 1, KEY_BLOCKS: blocks})


def bf16_parts(x: PrimExpr) -> tuple[PrimExpr, PrimExpr]:
    """x (fp16 or fp32) as hi + lo, two bf16 values: hi = x truncated to bf16 (its top 16 bits: one
    AND, where rounding takes five integer operations), lo = what it left out, rounded. An fp16
    value's 11 significant bits are exactly hi's 8 and lo's 3 (+ a sign), within bf16's exponent
    range; an fp32 value is kept to about 16 bits (P's weights)."""
    wide = x.astype(ACC)
    hi = bf16_truncated(wide)
    # (each part exact in bf16 before its cast: a buffer that TVM widens to fp32 stores the value as it is)
    return hi.astype("bfloat16"), bf16_rounded(wide - hi).astype("bfloat16")


def bf16_truncated(x: PrimExpr) -> PrimExpr:
    """fp32 ``x`` (any lanes) truncated to bf16's precision (its low 16 bits cleared), kept in fp32."""
    return _on_bits(x, lambda bits, word: bits & word(0xFFFF0000))


def bf16_rounded(x: PrimExpr) -> PrimExpr:
    """fp32 ``x`` (any lanes) rounded to bf16's precision, to nearest even, kept in fp32; spelt in
    integer operations, as the rounding of a cast to bf16 is: TVM's bf16 legaliser folds
    ``fp32(bf16(x))`` into ``x``, which would make every lo part 0."""
    return _on_bits(x, lambda bits, word: (bits + word(0x7FFF) + ((bits >> word(16)) & word(1))) & word(0xFFFF0000))


def _on_bits(x: PrimExpr, f: Callable) -> PrimExpr:
    """fp32 ``x`` (any lanes) with ``f(bits, word)`` applied to its uint32 bits (``word(c)``: a
    constant of x's lanes)."""
    lanes = x.ty.dtype.lanes
    typed = lambda t: t if lanes == 1 else f"{t}x{lanes}"  # noqa: E731
    word = lambda c: tirx.const(c, "uint32") if lanes == 1 else tirx.Broadcast(tirx.const(c, "uint32"), lanes)  # noqa: E731
    return tirx.reinterpret(typed("float32"), f(tirx.reinterpret(typed("uint32"), x), word))


def _parts(stages: dict[str, te.Tensor], name: str, shape: tuple, at: Reader) -> tuple[te.Tensor, te.Tensor]:
    """The stages {name}_hi and {name}_lo of ``at`` over ``shape`` (`bf16_parts`)."""
    def part(k: int) -> Reader:
        return lambda *i: bf16_parts(at(*i))[k]

    for k, suffix in enumerate(("hi", "lo")):
        stages[f"{name}_{suffix}"] = te.compute(shape, part(k), name=f"{name}_{suffix}")
    return stages[f"{name}_hi"], stages[f"{name}_lo"]


def _parts_of_input(stages: dict[str, te.Tensor], x: te.Tensor) -> tuple[te.Tensor, te.Tensor]:
    """x's parts, {x}_hi and {x}_lo: stages made once for every projection that reads x."""
    if x.op.name + "_hi" not in stages:
        _parts(stages, x.op.name, x.shape, lambda *i: x[i])
    return stages[x.op.name + "_hi"], stages[x.op.name + "_lo"]


def _sum_of_parts(x: tuple[te.Tensor, te.Tensor], y: tuple[te.Tensor, te.Tensor], at_x: tuple, at_y: tuple):
    """x·y from their parts: hi·hi + hi·lo + lo·hi (lo·lo, 2^-16 of the product, is left out), each
    product exact in fp32."""
    (x_hi, x_lo), (y_hi, y_lo) = x, y
    hi_hi = x_hi[at_x].astype(ACC) * y_hi[at_y].astype(ACC)
    return hi_hi + x_hi[at_x].astype(ACC) * y_lo[at_y].astype(ACC) + x_lo[at_x].astype(ACC) * y_hi[at_y].astype(ACC)


def _whole(x: PrimExpr, block: int) -> PrimExpr:
    """x rounded up to whole blocks, at least one: the analyzer then knows the result is positive
    (with x unbounded below it cannot simplify the tiles' bounds, and TVM's scope checks fail)."""
    return (tirx.max(x, 1) + block - 1) // block * block


# ---- epilogue: normalise, and the requested output ----------------------------------------------
def _epilogue(spec: AttentionSpec, dim: Callable, stages: dict[str, te.Tensor],
              inputs: dict[str, te.Tensor], parts: bool = False) -> te.Tensor:
    """attn from pv and row_sum, or the spec's intermediate output; in a layer, the merged heads and
    W_O (``parts``: on merged's parts, merged_hi and merged_lo)."""
    B, h, n, n_kv = dim(spec.batch), spec.h, dim(spec.n_q), dim(spec.n_kv)  # the stages may run past n
    scores, probs, row_max, row_sum, pv = (stages[name] for name in ("scores", "probs", "row_max", "row_sum", "pv"))
    dt, d_v = spec.dtype, spec.d_v
    sinks = inputs.get("sinks")

    def normalised(x, b, i, s):
        sink = sinks[i] if sinks is not None else None
        return variant.normalise(x, variant.denominator(spec, row_sum[b, i, s], row_max[b, i, s], sink, LOG2E))

    if spec.output != "attn":
        stage = {"scaled_scores": lambda b, i, s, t: variant.scaled_score(spec, scores[b, i, s, t]),
                 "logits": stages["logits"],
                 "weights": lambda b, i, s, t: normalised(probs[b, i, s, t], b, i, s)}[spec.output]
        # Not a key stage: key-tile skipping must not apply here, the hidden entries are part of the output.
        out = te.compute((B, h, n, n_kv), lambda b, i, s, t: stage(b, i, s, t).astype(dt), name=spec.output)
        stages[spec.output] = out
        return out
    attn_at = lambda b, i, s, c: normalised(pv[b, i, s, c], b, i, s).astype(dt)  # noqa: E731
    if spec.projections:
        attn = te.compute((B, h, n, d_v), attn_at, name="attn")
        merged = te.compute((B, n, h * d_v), lambda b, s, m: attn[b, m // d_v, s, m % d_v], name="merged")
        merged_parts = _parts(stages, "merged", merged.shape, lambda *i: merged[i]) if parts else None
        out = linear(merged, inputs["w_o"], "out", merged_parts)
        stages.update(attn=attn, merged=merged, out=out)
        return out
    # The iterators keep the axis names of the contract (see the module docstring) in either layout.
    if spec.layout == "BHSD":
        out = te.compute((B, h, n, d_v), lambda b, i, s, c: attn_at(b, i, s, c), name="attn")
    else:
        out = te.compute((B, n, h, d_v), lambda b, s, i, c: attn_at(b, i, s, c), name="attn")
    stages["attn"] = out
    return out


def _attn_mask(spec: AttentionSpec, m: te.Tensor | None) -> Reader:
    """The mask tensor's reader at (b, head, s, t); None everywhere when the spec has no attn_mask."""
    if m is None:
        return lambda *index: None
    return lambda b, i, s, t: m[tuple(variant.mask_index(spec, b, i, s, t))]


def linear(x: te.Tensor, w: te.Tensor, name: str, x_parts: tuple[te.Tensor, te.Tensor] | None = None) -> te.Tensor:
    """y[b, s, m] = Σ_c x[b, s, c]·w[c, m], accumulated in fp32, stored in x's dtype. Given
    ``x_parts`` (fp16 x as two bf16 stages), the product is of x's and w's parts (w's, stages
    {w}_hi and {w}_lo of its own: `_sum_of_parts`)."""
    c = te.reduce_axis((0, w.shape[0]), "c")
    if x_parts is None:
        product = lambda b, s, m: x[b, s, c].astype(ACC) * w[c, m].astype(ACC)  # noqa: E731
    else:
        w_parts = _parts({}, w.op.name, w.shape, lambda *i: w[i])
        product = lambda b, s, m: _sum_of_parts(x_parts, w_parts, (b, s, c), (c, m))  # noqa: E731
    acc = te.compute((x.shape[0], x.shape[1], w.shape[1]), lambda b, s, m: te.sum(product(b, s, m), axis=c),
                     name=name if x.dtype == ACC else name + "_acc")
    if x.dtype == ACC:
        return acc
    return te.compute(acc.shape, lambda *i: acc(*i).astype(x.dtype), name=name)


def _split_heads(y: te.Tensor, heads: int, width: int, name: str) -> te.Tensor:
    """(B, n, heads·width) → (B, heads, n, width): a reshape and a transpose, no arithmetic."""
    return te.compute((y.shape[0], heads, y.shape[1], width),
                      lambda b, i, s, c: y[b, s, i * width + c], name=name)


def _reader(t: te.Tensor, layout: Operand) -> Reader:
    """Index a tensor stored in ``layout`` as (b, head, pos, c)."""
    return lambda b, i, s, c: t[layout.index(b, i, s, c)]
