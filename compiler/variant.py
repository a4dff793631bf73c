"""The attention variant: which keys a query sees and what its logit is, written once.

As in FlashInfer, a variant is a few named hooks that every formulation reads: the tensor expression
(`te_attention`), the online-softmax template (`flash`), the block-skipping pass (`passes`), the ONNX
exporter and the benchmark's peers. The oracle (`oracle.py`) is the one part that keeps its own copy:
it is the independent statement these hooks are checked against.

    visible(s, t)   where query s may attend to key t, from the spec's position rules:
                    pos(s) = s + offset, offset = 0 (top_left) or L - n (bottom_right), L valid keys
                    causal   t <= pos(s)
                    window   pos(s) - W < t          (and, when not causal, t < pos(s) + W)
                    padding  t < L
    key_range       the same rules solved for t over a block of queries (tile skipping)
    mask_allows     what an attn_mask entry says: True = attend (bool), a -inf bias hides (additive)
    logit           cap(scale·score) + alibi + bias, cap(x) = softcap·tanh(x / softcap) when a softcap
                    is set, alibi = slope·(t − pos(s)) or −slope·|t − pos(s)| (the head's ALiBi slope),
                    bias an additive attn_mask's entry
    mask_index      where the attn_mask holds the entry of (b, head, s, t) (it broadcasts)
    denominator     the row sum, plus the sink's term where the spec has sinks (a key with no value)
    normalise       x / denominator, and 0 for a row that sees no key (sum 0; a NaN sum stays NaN)
    Operand         where a (b, head, s, c) element lives in each layout

The position rules are written with Python operators only, so the same lines build TIR (PrimExprs),
NumPy arrays or ONNX nodes (any values with +, -, <, <= and a conjunction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tvm import tirx
from tvm.ir.expr import Expr as PrimExpr

if TYPE_CHECKING:
    from tvmattn.compiler.spec import AttentionSpec

ACC = "float32"  # accumulation dtype of every formulation, whatever the input dtype
MASK_AXES = "bhst"  # batch, head, query, key: the axes of the scores an attn_mask may vary along


def size_expr(x: int | PrimExpr) -> PrimExpr:
    """A size as the rules read it: a static int as an int32 constant, a symbolic one as it is."""
    return tirx.const(x, "int32") if isinstance(x, int) else x


# ---- position rules ------------------------------------------------------------------------------
def has_position_rules(spec: AttentionSpec) -> bool:
    """Whether the spec hides keys by position (causal, window, padding)."""
    return spec.causal or spec.window is not None or spec.key_padding


def skips_keys(spec: AttentionSpec) -> bool:
    """Whether a kernel of ``spec`` may skip hidden key tiles: position rules hide them, and the
    kernel returns the attention (a kernel returning scores or weights writes hidden entries too)."""
    return has_position_rules(spec) and spec.output == "attn"


def plain_causal(spec: AttentionSpec) -> bool:
    """Causal as PyTorch's and ONNX's ``is_causal`` flag says it: top-left, and no other position rule."""
    top_left = spec.causal_align == "top_left" or (isinstance(spec.n_q, int) and spec.n_q == spec.n_kv)
    return spec.causal and top_left and not has_position_rules(spec.replace(causal=False))


def _position(spec: AttentionSpec, s: Any, kv_len: Any, n_q: Any) -> Any:
    """Where query s sits among the keys."""
    return s + (kv_len - n_q) if spec.causal_align == "bottom_right" else s


def visible(spec: AttentionSpec, s: Any, t: Any, kv_len: Any, n_q: Any,
            conj: Callable[[Sequence[Any]], Any]) -> Any | None:
    """The conjunction (``conj``) of the position rules for query s and key t; None: no rule."""
    pos = _position(spec, s, kv_len, n_q)
    rules = []
    if spec.causal:
        rules.append(t <= pos)
    if spec.window is not None:
        rules.append(pos - spec.window < t)
        if not spec.causal:
            rules.append(t < pos + spec.window)
    if spec.key_padding:
        rules.append(t < kv_len)
    return conj(rules) if rules else None


def key_range(spec: AttentionSpec, s_lo: PrimExpr, s_hi: PrimExpr, kv_len: PrimExpr,
              n_q: PrimExpr) -> tuple[PrimExpr | None, PrimExpr | None]:
    """Keys [t_lo, t_hi) that any query in [s_lo, s_hi] sees (`visible` solved for t); None where
    the rules set no bound."""
    lo = hi = None
    if spec.causal:
        hi = _position(spec, s_hi, kv_len, n_q) + 1
    if spec.window is not None:
        lo = _position(spec, s_lo, kv_len, n_q) - spec.window + 1
        if not spec.causal:
            hi = _position(spec, s_hi, kv_len, n_q) + spec.window
    if spec.key_padding:
        hi = kv_len if hi is None else tirx.min(hi, kv_len)
    return lo, hi


# ---- the TIR hooks: visibility with the attn_mask, the logit --------------------------------------
def tir_all(conds: Sequence[PrimExpr]) -> PrimExpr:
    return tirx.all(*conds) if len(conds) > 1 else conds[0]


NEG_INF_BITS = -(1 << 23)  # float32 -inf, 0xFF800000, as int32


def mask_allows(spec: AttentionSpec, mask_value: PrimExpr | None) -> PrimExpr | None:
    """What the attn_mask entry ``mask_value`` says of its key (None: the spec has no attn_mask)."""
    if spec.attn_mask == "bool":
        return mask_value
    if spec.attn_mask == "additive":  # a -inf bias hides the key as a False would; a NaN bias shows
        # -inf's bits: not `!= -inf` (TVM compares floats ordered: NaN != x is false, and it simplifies
        # not(x == -inf) to that), nor `> -inf or isnan` (isnan has no vector form: the row maxima's
        # loop over a mask tile ran scalar, 1.7× the unmasked kernel's time)
        bits = tirx.reinterpret("int32", mask_value.astype(ACC))
        return bits != tirx.const(NEG_INF_BITS, "int32")
    return None


def sees(spec: AttentionSpec, s: PrimExpr, t: PrimExpr, kv_len: PrimExpr, n_q: PrimExpr,
         mask_value: PrimExpr | None = None, *extra: PrimExpr) -> PrimExpr:
    """True where query s may attend to key t: the position rules, the attn_mask, and ``extra``
    conditions of the formulation (a key past the end of a tile, say)."""
    conds = [*extra]
    for cond in (visible(spec, s, t, kv_len, n_q, tir_all), mask_allows(spec, mask_value)):
        if cond is not None:
            conds.append(cond)
    return tir_all(conds) if conds else tirx.const(True, "bool")


def _times(x: PrimExpr, c: float) -> PrimExpr:
    """x·c rounded once, as fma(x, c, 0): the compiler may not fuse it with the subtraction of the row
    maximum that follows in one stage and not in another (the maximum is of the rounded product):
    at |logit| ≳ 1e9 the two would differ by more than exp's range and a row's weights would vanish."""
    return tirx.call_intrin(ACC, "tirx.fma", x, tirx.const(c, ACC), tirx.const(0, ACC))


def scaled_score(spec: AttentionSpec, score: PrimExpr, factor: float = 1.0) -> PrimExpr:
    """factor·cap(scale·score): ONNX's ``scaled_scores``. ``factor`` folds a constant into the
    same multiply (log2(e) for the exp2 of an online softmax)."""
    if spec.softcap is None:
        return _times(score, spec.softmax_scale * factor)
    capped = tirx.tanh(score * tirx.const(spec.softmax_scale / spec.softcap, ACC))
    return _times(capped, spec.softcap * factor)


def alibi(spec: AttentionSpec, slope: PrimExpr | None, s: PrimExpr, t: PrimExpr, kv_len: PrimExpr,
          n_q: PrimExpr) -> PrimExpr | None:
    """ALiBi's term of the logit of query s and key t (None: the spec has none): the head's ``slope``
    times t − pos(s) ("signed") or −|t − pos(s)| ("symmetric"). The distance from the query, not
    BLOOM's t alone (the same softmax): small near the diagonal, so fp32 keeps it exact."""
    if spec.alibi is None:
        return None
    distance = (t - _position(spec, s, kv_len, n_q)).astype(ACC)
    return slope * (tirx.abs(distance) * tirx.const(-1, ACC) if spec.alibi == "symmetric" else distance)


def logit(spec: AttentionSpec, score: PrimExpr, s: PrimExpr, t: PrimExpr, kv_len: PrimExpr, n_q: PrimExpr,
          mask_value: PrimExpr | None = None, slope: PrimExpr | None = None, factor: float = 1.0) -> PrimExpr:
    """factor·(cap(scale·score) + alibi + bias) of query s and key t (kv_len valid keys, n_q queries):
    ALiBi's term with the head's ``slope`` (`alibi`), the bias an additive attn_mask's entry."""
    x = scaled_score(spec, score, factor)
    bias = alibi(spec, slope, s, t, kv_len, n_q)
    if spec.attn_mask == "additive":
        bias = mask_value if bias is None else bias + mask_value
    if bias is None:
        return x
    if factor == 1.0:
        return x + bias
    x = x + _times(bias, factor)
    if spec.attn_mask != "additive":
        return x
    # A finite logit stays finite: the finfo.min fill exporters write, times log2(e), would overflow
    # to -inf, and a row it hides entirely would see no key instead of every key alike (as in natural
    # units, ONNX Runtime and torch). A Select, not max: NaN must pass.
    lowest = tirx.const(-3.4028234663852886e38, ACC)  # fp32's lowest finite value
    return tirx.Select(x < lowest, lowest, x)


def denominator(spec: AttentionSpec, row_sum: PrimExpr, row_max: PrimExpr, sink: PrimExpr | None,
                factor: float) -> PrimExpr:
    """The softmax's denominator: the row's Σ_t exp2(x_t − m) (x in base 2, ``factor`` = log2 e, m the
    row's running maximum ``row_max``) and, with sinks, the sink's exp2(factor·sink − m). Added after the
    row's reduction rather than as a key of it, so no schedule changes: where the sink exceeds every
    logit by more than exp2's range the term is inf and the row 0, which it is to fp32's precision
    (each weight is below 2^-128); a row that sees no key (m = −inf or the lowest float) gets inf: 0."""
    if not spec.sinks:
        return row_sum
    return row_sum + tirx.exp2(_times(sink, factor) - row_max)


def normalise(x: PrimExpr, total: PrimExpr) -> PrimExpr:
    """x / total, 0 where the row saw no key (total 0). A NaN total (NaN inputs) gives NaN: the test
    is ``total == 0``, not ``total > 0``, so that it shows."""
    zero = tirx.const(0, ACC)
    return tirx.Select(total == zero, zero, x / total)


def mask_index(spec: AttentionSpec, b: PrimExpr, head: PrimExpr, s: PrimExpr, t: PrimExpr) -> list[PrimExpr]:
    """Where attn_mask holds the entry of (b, head, s, t): index 0 on the axes it broadcasts along."""
    zero = tirx.const(0, "int32")
    return [ix if axis in spec.attn_mask_dims else zero for axis, ix in zip(MASK_AXES, (b, head, s, t))]


# ---- layouts --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Operand:
    """How a (B, heads, n, width) operand is stored: ``BHSD``, ``BSHD``, or ``packed`` heads side by
    side as (B, n, heads·width) (what the full layer's projections write)."""

    layout: str
    heads: int
    width: int

    def shape(self, B: Any, n: Any) -> tuple:
        if self.layout == "packed":
            return (B, n, self.heads * self.width)
        return self.index(B, self.heads, n, self.width)

    def index(self, b: Any, head: Any, s: Any, c: Any) -> tuple:
        if self.layout == "BHSD":
            return (b, head, s, c)
        if self.layout == "BSHD":
            return (b, s, head, c)
        return (b, s, head * self.width + c)
