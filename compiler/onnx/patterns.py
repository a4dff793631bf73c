"""Decomposed attention in an imported Relax module → tvmattn kernels, found with `tvm.relax.dpl`.

The chain exporters leave (PyTorch's TorchScript and dynamo exporters, Hugging Face models, ONNX's own
expansion of ``Attention``), every step but the two matmuls and the softmax optional:

    scores = (q·c) @ (kᵀ·c)                    the scale on q, on kᵀ, or on the scores (· or /)
    logits = c·tanh(scores / c)                soft-capping
    logits = (logits + bias).view(B, h, n, n_kv)   on (B·h, n, d) batches: a bias there, then the heads
                                               split (BLOOM's baddbmm; probs.view(B·h, n, n_kv) @ v below)
    logits = logits + bias                     a float mask or bias (HF's finfo.min masks, T5 biases)
           | where(keep, logits, fill)         a bool mask; fill -inf or ≤ -1e30
           | where(hide, fill, logits)
           | where(hide, fill, logits + bias)  the mask over the sum (MPT: its ALiBi, then masked_fill)
           [+ bias2]                           a second float term (T5: its bias, then its mask; GPT-2's
                                               eager attention: where(causal, …), then its padding mask)
    probs  = softmax(logits, axis=-1)          float casts around any of these
    probs  = where(row sees no key, 0, probs)  ONNX's fully-masked-row guard
    out    = probs @ v                         [then permute (0,2,1,3): the head merge]

Softmax weights the graph also uses elsewhere (an ``output_attentions`` output, ONNX's
``qk_matmul_output``) become a kernel that returns them.

q, k, v may arrive with their head split (a permute of a (B, n, h, d) tensor: the kernel reads it in
place, layout BSHD) and K/V with GQA's head repetition (expand_dims → broadcast_to → reshape: the
kernel indexes K/V head i // g instead). 3-D operands (B·h, n, d) are one head per batch entry, or, where
the chain splits the heads off around the softmax, (B, h) reshaped back; kᵀ may be any permutation of
K's source (torch's MultiheadAttention writes (n_kv, B·h, d) permuted by (1, 2, 0)).

A match is replaced only when the kernel provably computes the same values: scalar constant scales,
softmax over the key axis, a mask that broadcasts to the scores, a fill that hides a key as -inf does.
Anything else is left to TVM as imported, and its softmax is listed in the report with the reason
(`rewrite`'s ``reasons``: the first check that failed, per Softmax node). A decode step (one query)
whose constant mask shows it every key is bottom-right causal: the query follows the whole cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.dpl import DFPattern

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx import alibi, causal_masks, key_masks
from tvmattn.compiler.onnx.canonical import canonical
from tvmattn.compiler.onnx.causal_masks import HUGE_NEGATIVE, MODERATE_FILL
from tvmattn.compiler.onnx.chain import ROOTS, AttentionPattern, NoMatch
from tvmattn.compiler.onnx.constant_masks import hides_only, keep_rule
from tvmattn.compiler.onnx.kernels import Kernels, Mask, attend, shape_of
from tvmattn.compiler.onnx.positions import dims_of
from tvmattn.compiler.onnx.shape_ops import has_clamp, without_unused_casts
from tvmattn.compiler.onnx.sinks import sink_logits

SOURCE = "pattern: decomposed attention"
_SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")


def rewrite(mod: tvm.IRModule, kernels: Kernels, provenance: dict,
            reasons: dict[str, str] | None = None) -> tvm.IRModule:
    """Every decomposed attention of ``mod``'s main function that provably matches → a tvmattn kernel.

    The pattern that includes the head merge runs first, so a kernel writes its output in the merged
    layout where it can; then the bare chain; then softmax weights still used after those. ``reasons``
    receives, per softmax (its ONNX node), why a chain around it matched the pattern but was kept.
    """
    mod = canonical(mod, provenance)
    for root in ROOTS:
        mod = _Rewriter(mod, AttentionPattern(root), kernels, provenance,
                        reasons if reasons is not None else {}).run()
        mod = relax.transform.DeadCodeElimination(["main"])(without_unused_casts(mod))
    return mod


NOT_ATTENTION = ("no softmax(Q·Kᵀ …)·V chain around it: not an attention (a classifier's softmax), or a form "
                 "the patterns do not know")


def remaining_softmax(mod: tvm.IRModule, provenance: dict) -> list[str]:
    """Where ``mod`` still computes a softmax itself: attention that was not replaced, or a classifier."""
    return [provenance.get(b.value, b.var.name) for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b, relax.VarBinding) and isinstance(b.value, relax.Call) and b.value.op.same_as(_SOFTMAX)]


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, pattern: AttentionPattern, kernels: Kernels, provenance: dict,
                 reasons: dict[str, str]) -> None:
        super().__init__(mod)
        self.mod, self.pattern, self.kernels, self.provenance = mod, pattern, kernels, provenance
        self.reasons = reasons
        # every binding's value, match_cast's included (position arithmetic restates shapes with them; MPT's
        # symbolic scores are cast to its ALiBi's length, 1024 - max(0, 1024 - n): the chain goes through)
        self.casts = {b.var: b.value for block in mod["main"].body.blocks for b in block.bindings
                      if isinstance(b, relax.MatchCast)}
        self.values = dict(relax.analysis.get_var2val(mod["main"]).items()) | self.casts
        self.var2val = {var: self.values.get(value, value) if _restates(var, value) else value
                        for var, value in self.values.items() if var not in self.casts or _restates(var, value)}
        self.matches = self._maximal_matches()

    def bound(self, expr: relax.Expr) -> relax.Expr:
        """What ``expr`` is bound to, through variables bound to variables (and casts)."""
        while isinstance(expr, relax.Var) and expr in self.values:
            expr = self.values[expr]
        return expr

    def _maximal_matches(self) -> dict:
        """Binding value → match, leaving out matches inside a larger one (softmax inside cast(softmax))."""
        found = {}
        for block in self.mod["main"].body.blocks:
            for b in block.bindings:
                matched = self.pattern.root.extract_matched_expr(b.value, self.var2val)
                if isinstance(b, relax.VarBinding) and matched is not None:
                    found[b.value] = matched
        inner = {e for value, m in found.items() for e in m.values() if not e.same_as(value)}
        return {value: m for value, m in found.items() if value not in inner}

    def run(self) -> tvm.IRModule:
        gvar = self.mod.get_global_var("main")
        self.builder_.update_func(gvar, self.visit_expr(self.mod["main"]))
        return self.builder_.get()

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        matched = self.matches.get(binding.value)
        new = _Match(self, matched).replace() if matched is not None else None
        if new is None:
            super().visit_var_binding_(binding)
            return
        if self.builder_.current_block_is_dataflow() and not isinstance(binding.var, relax.DataflowVar):
            new = self.builder_.emit_output(new)
        self.set_var_remap(binding.var, new)


@dataclass
class _Operand:
    """A q, k or v tensor as the kernel reads it: ``src`` permuted by ``axes`` is (B, h, n, d) (or
    (N, n, d)); K/V heads repeated ``group`` times by the graph."""

    src: relax.Expr
    axes: tuple[int, ...]
    group: int = 1

    @property
    def rank(self) -> int:
        return len(self.axes)

    @property
    def bshd(self) -> bool:
        return self.axes == (0, 2, 1, 3)

    def split(self, bb: relax.BlockBuilder, batch, heads: int) -> relax.Expr:
        """A 3-D operand (B·h, n, d) as (B, h, n, d)."""
        x = self.src if self.axes == (0, 1, 2) else bb.emit(relax.op.permute_dims(self.src, self.axes))
        _, seq, width = shape_of(x, "an attention operand")
        return bb.emit(relax.op.reshape(x, [batch, heads, seq, width]))

    def bhsd(self, bb: relax.BlockBuilder) -> relax.Expr:
        x = self.src if self.axes == tuple(range(self.rank)) else bb.emit(relax.op.permute_dims(self.src, self.axes))
        if self.rank == 3:  # one head per batch entry
            n, seq, width = shape_of(x, "an attention operand")
            x = bb.emit(relax.op.reshape(x, [n, 1, seq, width]))
        return x


class _Match:
    """One match of the pattern, checked and turned into a kernel call."""

    def __init__(self, rewriter: _Rewriter, matched: dict) -> None:
        self.r, self.m, self.p = rewriter, matched, rewriter.pattern
        self.bb: relax.BlockBuilder = rewriter.builder_
        self.empty_rows: tuple | None = None  # (key mask, rule): rows to average afterwards (`_split_keys`)
        self.alibi_slopes: np.ndarray | None = None  # each head's slope, where a bias is ALiBi's (`alibi`)

    def leaf(self, pattern: DFPattern) -> relax.Expr:
        """A matched input of the chain, as the rewritten function names it. A term on the scores is taken on
        the side of a size-restating cast (`shape_ops.state_broadcast`) whose sizes are the scores': MPT's
        symbolic mask before its cast to the ALiBi's length, GPT-Neo's padding mask after its cast to
        min(1024, n) (the matcher reads through casts: MPT's scores are cast too)."""
        expr = self.m[pattern]
        sides = [expr, self.r.casts.get(expr)] + [v for v, inner in self.r.casts.items()
                                                  if expr.same_as(self.r.bound(inner))]
        aligned = [x for x in sides if x is not None and self._on_the_scores(x)]
        return self.r.visit_expr(expr if not aligned or any(expr.same_as(x) for x in aligned) else aligned[0])

    def _on_the_scores(self, term: relax.Expr) -> bool:
        """Whether ``term``'s last two sizes are 1 or provably the scores' (n, n_kv)."""
        have, want = dims_of(term), dims_of(self._logits())
        analyzer = tvm.sym.Analyzer()
        return have is not None and want is not None and len(have) >= 2 and all(
            (isinstance(h, tirx.IntImm) and h.value == 1) or analyzer.can_prove_equal(h, w)
            for h, w in zip(have[-2:], want[-2:]))

    def replace(self) -> relax.Expr | None:
        """The kernel call, or None (the reason recorded under the softmax's node) where TVM keeps it."""
        try:
            return self._replace()
        except (NoMatch, TvmAttnError) as err:  # TvmAttnError: a shape or dtype the kernel does not take
            softmax = self.r.provenance.get(self.m[self.p.softmax])
            if softmax:
                self.r.reasons[softmax] = str(err)
            return None

    def _replace(self) -> relax.Expr:
        weights = self.p.root is self.p.weights
        q, k = self._operand(self.p.q, self.p.q_perm, None), self._keys()
        v = k if weights else self._operand(self.p.v, self.p.v_perm, self.p.v_rep)  # a weights kernel reads no v
        rank = q.rank
        if k.rank != rank or v.rank != rank or rank not in (3, 4) or k.group != v.group:
            raise NoMatch(f"q, k, v of ranks {q.rank}, {k.rank}, {v.rank} (head groups {k.group}, {v.group}): "
                           f"the kernel takes 3-D or 4-D operands of one rank")
        if self.m[self.p.softmax].attrs.axis not in (-1, rank - 1):
            raise NoMatch(f"softmax over axis {self.m[self.p.softmax].attrs.axis}, not the key axis")
        scale, head_scales, feature_scales = self._scale()
        options = {"scale": scale}
        cap = self._softcap()
        if cap is not None:
            options["softcap"] = cap
        heads = self._split(weights)
        sinks = sink_logits(self.bb, self.m, self.p, shape_of(self._logits(), "the scores"), heads is not None,
                            self.r.bound, self.r.visit_expr)
        mask, structure, keep = self._mask()
        options.update(structure)
        self._check_guard(keep)
        bshd = rank == 4 and q.bshd and k.bshd and v.bshd
        if heads is not None:
            mask = self._with_batch_bias(mask, heads)
            operands = [x.split(self.bb, *heads) for x in (q, k, v)]
        else:
            operands = [x.src for x in (q, k, v)] if bshd else [x.bhsd(self.bb) for x in (q, k, v)]
            if rank == 3 and mask is not None:
                mask = Mask(self._with_head_axis(mask.value), mask.kind)
        if head_scales is not None:
            if rank != 4 or heads is not None:
                raise NoMatch("a scale a head on (B·h) batches")
            operands[0] = self._by_head(operands[0], head_scales, bshd)
        if feature_scales is not None:
            operands[0] = self._by_feature(operands[0], feature_scales)
        if str(self.m[self.p.root].ty.dtype) != str(operands[0].ty.dtype):
            raise NoMatch(f"the attention output is {self.m[self.p.root].ty.dtype}, its operands "
                           f"{operands[0].ty.dtype}")
        if self.alibi_slopes is not None:
            options.update(alibi="signed", alibi_slopes=relax.const(self.alibi_slopes))
        out, = attend(self.bb, self.r.kernels, *operands, layout="BSHD" if bshd else "BHSD", mask=mask,
                      nodes=self._nodes(), source=SOURCE, outputs=("weights" if weights else "attn",),
                      sinks=sinks, **options)
        if self.empty_rows is not None:
            keys, rule = self.empty_rows
            out = key_masks.average_empty_rows(self.bb, out, operands[2], keys, rule, "BSHD" if bshd else "BHSD",
                                               k.group)
        if heads is not None and not weights:  # (B, h, n, d_v) as P·V's (B·h, n, d_v)
            batch_heads, seq = shape_of(self.m[self.p.scores], "the scores")[:2]
            out = self.bb.emit(relax.op.reshape(out, [batch_heads, 1, seq, shape_of(out, "the output")[3]]))
        return self._merge(out, rank, bshd, weights)

    # ---- operands --------------------------------------------------------------------------------
    def _split(self, weights: bool) -> tuple[tirx.PrimExpr, int] | None:
        """(B, h) where the chain views its (B·h, n, n_kv) scores as (B, h, n, n_kv) for the mask and softmax
        (and P·V's weights back as (B·h, n, n_kv)); None where it does not."""
        if self.p.split not in self.m:
            return None
        scores = shape_of(self.m[self.p.scores], "the scores")
        split = shape_of(self.m[self.p.split], "the split scores")
        analyzer = tvm.sym.Analyzer()
        if len(scores) != 3 or len(split) != 4 or not isinstance(split[1], tirx.IntImm) or not all(
                analyzer.can_prove_equal(a, b) for a, b in zip(scores, (split[0] * split[1], split[2], split[3]))):
            raise NoMatch("the scores are reshaped otherwise than their (B·h) batches split into (B, h)")
        if not weights and (self.p.unsplit not in self.m or not all(analyzer.can_prove_equal(a, b) for a, b in zip(
                shape_of(self.m[self.p.unsplit], "the weights"), scores))):
            raise NoMatch("the weights P·V reads are not the split ones merged back into (B·h) batches")
        return split[0], int(split[1].value)

    def _with_batch_bias(self, mask: Mask | None, heads: tuple[tirx.PrimExpr, int]) -> Mask | None:
        """``mask`` with the bias added to the (B·h, n, n_kv) scores before their heads split, as (B|1, h|1,
        n|1, n_kv|1); BLOOM's ALiBi goes on the kernel's variant instead."""
        if self.p.batch_bias not in self.m or self._alibi(self.p.batch_bias, heads[1], batched=True):
            return mask
        bias = self.leaf(self.p.batch_bias)
        shape = shape_of(bias, "the batched bias")
        shape = [tirx.IntImm("int64", 1)] * (3 - len(shape)) + shape
        if len(shape) != 3:
            raise NoMatch(f"a bias of rank {len(shape)} on (B·h, n, n_kv) scores")
        one = isinstance(shape[0], tirx.IntImm) and shape[0].value == 1
        if not one and not tvm.sym.Analyzer().can_prove_equal(shape[0], heads[0] * heads[1]):
            raise NoMatch("the batched bias does not broadcast along the (B·h) batches")
        lead = [1, 1] if one else list(heads)
        bias = self.bb.emit(relax.op.astype(self.bb.emit(relax.op.reshape(bias, lead + shape[1:])), "float32"))
        if mask is None:
            return Mask(bias, "additive")
        if mask.kind == "bool":
            return Mask(self.bb.emit(relax.op.where(mask.value, bias, relax.const(-np.inf, "float32"))), "additive")
        return Mask(self.bb.emit(relax.op.add(bias, self.bb.emit(relax.op.astype(mask.value, "float32")))),
                    "additive")

    def _with_head_axis(self, mask: relax.Expr) -> relax.Expr:
        """A mask on (N, n, n_kv) scores with its head axis at 1, where `_Operand.bhsd` put the operands'
        (broadcast by rank, N would go there)."""
        shape = [tirx.IntImm("int64", 1)] * (3 - len(shape_of(mask, "the mask"))) + shape_of(mask, "the mask")
        return self.bb.emit(relax.op.reshape(mask, [shape[0], 1, *shape[1:]]))

    def _logits(self) -> relax.Expr:
        """What the mask applies to: the scores, or their (B, h, n, n_kv) view."""
        return self.m[self.p.split] if self.p.split in self.m else self.m[self.p.scores]

    def _operand(self, leaf: DFPattern, perm: DFPattern, repeat: DFPattern | None) -> _Operand:
        src = self.leaf(leaf)
        rank = len(shape_of(src, "an attention operand"))
        axes = tuple(int(a) for a in self.m[perm].attrs.axes) if perm in self.m else tuple(range(rank))
        group = self._group(self.m[repeat]) if repeat is not None and repeat in self.m else 1
        return _Operand(src, axes, group)

    def _keys(self) -> _Operand:
        """K from the scores' right operand kᵀ (…, d_k, n_kv)."""
        if self.p.kt_perm not in self.m:  # kᵀ came from elsewhere: the kernel reads its transpose
            if self.p.k_perm in self.m or self.p.k_rep in self.m:
                raise NoMatch("kᵀ is not a transpose of the keys' last two axes")
            src = self.leaf(self.p.k)
            rank = len(shape_of(src, "k"))
            return _Operand(src, tuple(range(rank - 2)) + (rank - 1, rank - 2))
        outer = tuple(int(a) for a in self.m[self.p.kt_perm].attrs.axes)
        rank = len(outer)
        if outer == tuple(range(rank - 2)) + (rank - 1, rank - 2):  # kᵀ = transpose(K heads)
            return self._operand(self.p.k, self.p.k_perm, self.p.k_rep)
        if self.p.k_perm not in self.m and self.p.k_rep not in self.m:
            # kᵀ straight from K's source in another order: (B, n_kv, h, d) by (0, 2, 3, 1), or torch's
            # MultiheadAttention's (n_kv, B·h, d) by (1, 2, 0); K is the same permutation, last two swapped
            return _Operand(self.leaf(self.p.k), outer[:-2] + (outer[-1], outer[-2]))
        raise NoMatch(f"kᵀ is a permutation {outer} of permuted or repeated keys the kernel cannot read as K")

    def _group(self, reshape: relax.Call) -> int:
        """g of a head repetition (B, h_kv, n, d) → (B, h_kv, g, n, d) → (B, h_kv·g, n, d), which makes
        query head i read K/V head i // g as the kernel does; any other expand, broadcast or reshape
        (another axis, another order of the merged heads) is no match."""
        broadcast = self.r.var2val.get(reshape.args[0], reshape.args[0])
        expand = self.r.var2val.get(broadcast.args[0], broadcast.args[0])
        if [int(a) for a in expand.attrs.axis] != [2]:
            raise NoMatch("K/V are expanded along another axis than GQA's head repetition")
        src = shape_of(expand.args[0], "a repeated K/V")
        wide = shape_of(broadcast, "a repeated K/V")
        out = shape_of(reshape, "a repeated K/V")
        if len(src) != 4 or len(wide) != 5 or len(out) != 4 or not isinstance(wide[2], tirx.IntImm):
            raise NoMatch("K/V are broadcast in a way that is not GQA's head repetition")
        b, h_kv, n, d = src
        analyzer = tvm.sym.Analyzer()
        if not all(analyzer.can_prove_equal(x, y) for x, y in zip(
                (wide[0], wide[1], wide[3], wide[4], out[0], out[1], out[2], out[3]),
                (b, h_kv, n, d, b, h_kv * wide[2], n, d))):
            raise NoMatch("K/V are reshaped in a way that is not GQA's head repetition")
        return int(wide[2].value)

    # ---- scale, softcap, mask ------------------------------------------------------------------------
    def _scale(self) -> tuple[float, np.ndarray | None, np.ndarray | None]:
        """The scale; each query head's own factor where a constant varies along the heads (Swin v2's
        learned logit scale a head); and each query feature's where a constant on q varies along d_k alone
        (Hunyuan's query norm's weight, applied after its rotation): the kernel's scale is one number, so
        those multiply q instead."""
        scale, heads, features = 1.0, None, None
        for at, s in enumerate(self.p.scales):
            for handle, power in ((s.mul, 1.0), (s.div, -1.0)):
                if handle not in self.m:
                    continue
                values = self.m[handle].value.numpy().astype(np.float64)
                if values.size == 1:
                    scale *= float(values.reshape(())) ** power
                    continue
                if at == 0 and values.size == values.shape[-1]:  # (…, d_k) on q (scales[0]: q's side)
                    features = (1.0 if features is None else features) * values.reshape(-1) ** power
                    continue
                shape = (1,) * (4 - values.ndim) + values.shape
                if values.ndim > 4 or shape[0] != 1 or shape[2:] != (1, 1):
                    raise NoMatch(f"a scale of shape {values.shape}: one number, or one a head (h, 1, 1)")
                heads = (1.0 if heads is None else heads) * values.reshape(-1) ** power
        return scale, heads, features

    def _by_feature(self, q: relax.Expr, factors: np.ndarray) -> relax.Expr:
        """q (…, d_k) with each feature multiplied by its factor."""
        width = shape_of(q, "q")[-1]
        if not (isinstance(width, tirx.IntImm) and int(width) == factors.size):
            raise NoMatch(f"{factors.size} scales a feature for queries {width} wide")
        return self.bb.emit(relax.op.multiply(q, relax.const(factors.astype(str(q.ty.dtype)))))

    def _by_head(self, q: relax.Expr, factors: np.ndarray, bshd: bool) -> relax.Expr:
        """q (B, h, n, d) or, ``bshd``, (B, n, h, d) with each head multiplied by its factor."""
        heads = shape_of(q, "q")[2 if bshd else 1]
        if factors.size != 1 and not (isinstance(heads, tirx.IntImm) and int(heads) == factors.size):
            raise NoMatch(f"{factors.size} scales a head for {heads} query heads")
        shape = (1, 1, factors.size, 1) if bshd else (1, factors.size, 1, 1)
        return self.bb.emit(relax.op.multiply(q, relax.const(factors.reshape(shape).astype(str(q.ty.dtype)))))

    def _softcap(self) -> float | None:
        if self.p.cap_in not in self.m:
            return None
        if self.p.cap_out not in self.m or _scalar(self.m[self.p.cap_in]) != _scalar(self.m[self.p.cap_out]):
            raise NoMatch("c·tanh(s / c') with c ≠ c' is not a soft cap")
        return _scalar(self.m[self.p.cap_in])

    def _mask(self) -> tuple[Mask | None, dict, np.ndarray | None]:
        """The tensor mask, if any; the spec fields a constant causal mask becomes instead; and, when
        the mask is a constant, which keys it lets each query see (None when that is decided at run
        time)."""
        heads = self._scores_shape()[-3] if len(self._scores_shape()) == 4 else None
        select = next(((c, f, n) for c, f, n in ((self.p.keep, self.p.keep_fill, False),
                                                 (self.p.hide, self.p.hide_fill, True)) if c in self.m), None)
        if self.p.bias in self.m and select is not None:  # where(mask, fill, s + bias): MPT's masked_fill
            if self.p.bias2 in self.m:
                raise NoMatch("a bias, a bool mask over the sum and another term after it")
            if heads is not None and self._alibi(self.p.bias, heads, batched=False):
                return self._select_mask(self.leaf(select[0]), _scalar(self.m[select[1]]), select[2])
            terms = [self.leaf(self.p.bias), self._selected()]  # (the fill absorbs the bias: `_selected`)
            if any(str(t.ty.dtype) != "float32" for t in terms):
                raise NoMatch("additive terms on the scores that are not float32")
            return Mask(self.bb.emit(relax.op.add(*terms)), "additive"), {}, None
        if self.p.bias2 in self.m:  # two additive terms: ALiBi (MPT's) and a mask, or the sum the kernel adds
            for alibi, other in ((self.p.bias, self.p.bias2), (self.p.bias2, self.p.bias)):
                if self.p.bias in self.m and heads is not None and self._alibi(alibi, heads, batched=False):
                    return self._additive(other)
            first = self.leaf(self.p.bias) if self.p.bias in self.m else self._selected()
            terms = [first, self.leaf(self.p.bias2)]
            if any(str(t.ty.dtype) != "float32" for t in terms):
                raise NoMatch("additive terms on the scores that are not float32")
            return Mask(self.bb.emit(relax.op.add(*terms)), "additive"), {}, None
        if self.p.bias in self.m:
            if heads is not None and self._alibi(self.p.bias, heads, batched=False):
                return None, {}, np.ones((1,), dtype=bool)
            return self._additive(self.p.bias)
        if select is not None:
            return self._select_mask(self.leaf(select[0]), _scalar(self.m[select[1]]), select[2])
        return None, {}, np.ones((1,), dtype=bool)

    def _additive(self, handle: DFPattern) -> tuple[Mask | None, dict, np.ndarray | None]:
        """`_mask` of the additive term the pattern ``handle`` matched."""
        bias = self.leaf(handle)
        if not isinstance(bias, tvm.ir.GenericConst):
            causal = causal_masks.positional(self.m[handle], self._logits(), self.r.values, negate=False, additive=True)
            if causal:
                return None, causal, None
            keep, fill = self._where_keep(self.m[handle])
            split = self._split_keys(keep, fill) if keep is not None else None
            return split or (Mask(_either(self._per_key(handle), bias), "additive"), {}, None)
        values = bias.value.numpy().astype(np.float64)
        keep = values == 0
        if np.all(keep | (values <= HUGE_NEGATIVE)) and hides_only(keep, values):
            return (*keep_rule(keep, self._scores_shape()), keep)
        return Mask(bias, "additive"), {}, values != -np.inf

    def _alibi(self, handle: DFPattern, heads: int, batched: bool) -> bool:
        """Whether the bias ``handle`` matched is ALiBi's (`alibi.slopes`; on (B·h, n, n_kv) scores where
        ``batched``): then its slopes are the kernel's."""
        found = alibi.slopes(self.m[handle], heads, batched, self.r.values)
        if found is not None:
            self.alibi_slopes = found
        return found is not None

    def _select_mask(self, cond: relax.Expr, fill: float,
                     negate: bool) -> tuple[Mask | None, dict, np.ndarray | None]:
        # a moderate fill hides keys only from rows that keep one: a constant mask's or a causal rule's
        _check_select(cond, fill, MODERATE_FILL)
        if isinstance(cond, tvm.ir.GenericConst):
            keep = cond.value.numpy() != negate
            if hides_only(keep, np.where(keep, 0.0, fill)):  # (every row keeps a key: any fill checked above)
                return (*keep_rule(keep, self._scores_shape()), keep)
            _check_select(cond, fill)
            bias = np.where(keep, 0.0, fill).astype(np.float32)
            return Mask(relax.const(bias), "additive"), {}, np.ones_like(keep)
        scores = self._logits()
        causal = (causal_masks.sliced(cond, scores, self.r.var2val, negate, fill)
                  or causal_masks.positional(cond, scores, self.r.values, negate, fill=fill))
        if causal:
            return None, causal, None
        _check_select(cond, fill)
        split = None if negate else self._split_keys(self.m[self.p.keep], fill)
        if split:
            return split
        keep = _either(self._per_key(self.p.keep if not negate else self.p.hide), cond)
        keep = self.bb.emit(relax.op.logical_not(keep)) if negate else keep
        if fill == -np.inf:
            return Mask(keep, "bool"), {}, None
        zero, hidden = relax.const(0.0, "float32"), relax.const(fill, "float32")
        return Mask(self.bb.emit(relax.op.where(keep, zero, hidden)), "additive"), {}, None

    def _selected(self) -> relax.Expr:
        """The mask of where(keep, s, fill) as the term where(keep, 0, fill) of s + where(keep, 0, fill) (of
        where(hide, fill, s) likewise), for the float term added after it: the same values, the fill absorbing
        any score. Dense, as GPT-2's causal buffer then its padding mask: a causal rule would hide the keys a
        row that sees none averages over (a left-padded query's row: its causal keys, and the later ones the
        padding mask keeps)."""
        negate = self.p.keep not in self.m
        cond = self.leaf(self.p.hide if negate else self.p.keep)
        fill = _scalar(self.m[self.p.hide_fill if negate else self.p.keep_fill])
        _check_select(cond, fill)
        zero, hidden = relax.const(0.0, "float32"), relax.const(fill, "float32")
        return self.bb.emit(relax.op.where(cond, hidden, zero) if negate else relax.op.where(cond, zero, hidden))

    def _per_key(self, leaf: DFPattern) -> relax.Expr | None:
        """The matched mask without its broadcast along the queries, where it does not vary by query."""
        return key_masks.per_key(self.bb, self.m[leaf], self.r.values, self.r.visit_expr)

    def _where_keep(self, bias: relax.Expr) -> tuple[relax.Expr | None, float]:
        """(keep, fill) of an additive mask written where(keep, 0, fill), fill hiding a key; else (None, 0)."""
        value = self.r.values.get(bias, bias)
        if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.where"):
            return None, 0.0
        cond, zero, fill = value.args
        if not all(isinstance(c, tvm.ir.GenericConst) and c.value.numpy().size == 1 for c in (zero, fill)) \
                or _scalar(zero) != 0 or _scalar(fill) > HUGE_NEGATIVE:
            return None, 0.0
        return cond, _scalar(fill)

    def _split_keys(self, keep: relax.Expr, fill: float) -> tuple[Mask, dict, None] | None:
        """A mask ``keep`` = a causal rule & per-key tensors (`key_masks`): the rule, and the keys as a bool
        mask the kernel reads per key. Under a finite fill the rows that see no key are averaged over
        every key afterwards, as the model does (`_empty_rows`); a weights kernel or a sliding window
        keeps the whole mask then."""
        *lead, n, n_kv = shape_of(self._logits(), "the scores")
        index = [tirx.Var(f"i{axis}", "int64") for axis in range(len(lead) + 2)]
        found = key_masks.split(keep, self.r.values, index, n, n_kv)
        if found is None:
            return None
        finite = fill != -np.inf
        if finite and found.rule and (self.p.root is self.p.weights or "window" in found.rule):
            return None
        mask = functools.reduce(lambda a, b: self.bb.emit(relax.op.logical_and(a, b)),
                                [self._per_key_term(term) for term in found.keys])
        if finite and not found.rule:  # the fill added as the model adds it: a row of no key averages them all
            zero, hidden = relax.const(0.0, "float32"), relax.const(fill, "float32")
            return Mask(self.bb.emit(relax.op.where(mask, zero, hidden)), "additive"), {}, None
        if finite:
            self.empty_rows = (mask, found.rule)
        return Mask(mask, "bool"), found.rule, None

    def _per_key_term(self, term: relax.Expr) -> relax.Expr:
        return _either(key_masks.per_key(self.bb, term, self.r.values, self.r.visit_expr), self.r.visit_expr(term))

    def _scores_shape(self) -> tuple[int | None, ...]:
        return tuple(int(d.value) if isinstance(d, tirx.IntImm) else None
                     for d in shape_of(self._logits(), "the scores"))

    def _check_guard(self, keep: np.ndarray | None) -> None:
        """ONNX's where(row sees no key, 0, probs) must zero exactly the rows the kernel zeroes: those
        whose mask hides every key."""
        if self.p.guard not in self.m:
            return
        if np.any(self.m[self.p.zero].value.numpy() != 0):
            raise NoMatch("the weights' guard writes a value other than 0")
        guard = self.m[self.p.guard]
        if isinstance(guard, tvm.ir.GenericConst):
            if keep is None:
                raise NoMatch("a constant weights guard on a mask known only at run time")
            no_key = ~keep.any(axis=-1, keepdims=True)
            if not np.array_equal(*np.broadcast_arrays(guard.value.numpy(), no_key)):
                raise NoMatch("the weights' guard zeroes other rows than those whose mask hides every key")
            return
        nan = self.p.guard_nan.extract_matched_expr(self.r.var2val.get(guard, guard), self.r.var2val)
        if nan is not None and nan[self.p.softmax].same_as(self.m[self.p.softmax]):
            return
        rule = self.p.guard_rule.extract_matched_expr(self.r.var2val.get(guard, guard), self.r.var2val)
        if (rule is None or self.p.bias not in self.m or not rule[self.p.guard_bias].same_as(self.m[self.p.bias])
                or not _reduces_last_axis(self.r.var2val.get(guard, guard), self.r.var2val)):
            raise NoMatch("the weights' guard is not 'the row's mask hides every key'")

    # ---- output --------------------------------------------------------------------------------------
    def _merge(self, out: relax.Expr, rank: int, bshd: bool, weights: bool) -> relax.Expr:
        """The kernel's output in the shape the replaced expression had."""
        if rank == 3:
            n, _, seq, width = shape_of(out, "the attention output")
            out = self.bb.emit(relax.op.reshape(out, [n, seq, width]))
        if weights:
            return out
        # the permutation the replaced expression applies to the (B, h, n, d_v) product: none for P·V itself
        axes = (tuple(int(a) for a in self.m[self.p.root].attrs.axes) if self.p.root is not self.p.out
                else tuple(range(rank)))
        if bshd:  # the kernel wrote (B, n, h, d_v): axis a of the product is axis BSHD[a] of ``out``
            axes = tuple((0, 2, 1, 3)[a] for a in axes)
        if axes == tuple(range(len(axes))):
            return out
        return self.bb.emit(relax.op.permute_dims(out, axes))

    def _nodes(self) -> tuple[str, ...]:
        parts = (self.p.scores, self.p.softmax, self.p.root)
        names = [self.r.provenance.get(self.m[p]) for p in parts if p in self.m]
        return tuple(dict.fromkeys(n for n in names if n)) or ("(unnamed)",)


def _restates(var: relax.Var, value: relax.Expr) -> bool:
    """Whether ``var`` is ``value`` cast to sizes with a min or max where it had none (`shape_ops.
    state_broadcast`'s min(1024, n) for n): the matcher reads through such a cast."""
    have, want = dims_of(value), dims_of(var)
    return have is not None and want is not None and any(has_clamp(d) for d in want) \
        and not any(has_clamp(d) for d in have)


def _either(expr: relax.Expr | None, otherwise: relax.Expr) -> relax.Expr:
    return otherwise if expr is None else expr


def _check_select(cond: relax.Expr, fill: float, limit: float = HUGE_NEGATIVE) -> None:
    """A where() mask the kernel can apply: a bool condition, a fill that hides a key (at most ``limit``)."""
    if str(cond.ty.dtype) != "bool":
        raise NoMatch(f"where() on a {cond.ty.dtype} condition")
    if fill > limit:  # a moderate fill gives a fully masked row uniform weights, not what a mask does
        raise NoMatch(f"the mask's fill {fill:g} does not hide a key (it must be -inf or ≤ -1e30; "
                      f"≤ {MODERATE_FILL:g} where every row keeps a key)")


def _scalar(const: tvm.ir.GenericConst) -> float:
    values = const.value.numpy()
    if values.size != 1:
        raise NoMatch(f"a scale or cap of {values.size} values, not one number")
    return float(values.reshape(()))


def _reduces_last_axis(equal: relax.Call, var2val: dict) -> bool:
    reduce = var2val.get(equal.args[0], equal.args[0])
    axes = reduce.attrs.axis
    return axes is not None and [int(a) for a in axes] in ([-1], [len(shape_of(reduce.args[0], "a bias")) - 1])
