"""The dpl pattern of decomposed attention (`AttentionPattern`): the chain `patterns` rewrites, with a
handle on every part the rewriter reads. See `patterns` for the chain's forms."""

from __future__ import annotations

from dataclasses import dataclass

from tvm.relax.dpl import DFPattern, is_const, is_op, is_tuple, is_tuple_get_item, wildcard


def _op(name: str, *args: DFPattern) -> DFPattern:
    return is_op(f"relax.{name}")(*args)


def _cast(x: DFPattern) -> DFPattern:
    """``x``, or ``x`` cast once or twice (softmax(…, dtype=float32).to(q.dtype) exports as two)."""
    return _op("astype", _op("astype", x)) | _op("astype", x) | x


def _repeat(x: DFPattern) -> DFPattern:
    """GQA's head repetition (B, h_kv, n, d) → (B, h_kv·g, n, d), as exporters spell it."""
    return _op("reshape", _op("broadcast_to", _op("expand_dims", x), wildcard()), wildcard())


@dataclass
class _Scale:
    """``x``, or x times / divided by a constant; the constants are the handles the rewriter reads."""

    mul: DFPattern
    div: DFPattern

    @staticmethod
    def around(x: DFPattern) -> tuple[DFPattern, "_Scale"]:
        mul, div = is_const(), is_const()
        pattern = _op("multiply", x, mul) | _op("multiply", mul, x) | _op("divide", x, div) | x
        return pattern, _Scale(mul, div)


class NoMatch(Exception):
    """The chain matched the pattern but is not provably what the kernel computes."""


ROOTS = ("merged", "out", "weights")  # the chain ending in the head merge, in probs @ v, in the probs


class AttentionPattern:
    """The dpl pattern of decomposed attention, keeping a handle on every part the rewriter reads."""

    def __init__(self, root: str) -> None:
        self.q, self.k, self.v = wildcard(), wildcard(), wildcard()
        self.q_perm = _op("permute_dims", self.q)
        self.k_perm, self.v_perm = _op("permute_dims", self.k), _op("permute_dims", self.v)
        self.k_rep, self.v_rep = _repeat(self.k_perm | self.k), _repeat(self.v_perm | self.v)
        self.kt_perm = _op("permute_dims", self.k_rep | self.k_perm | self.k)
        q_side, q_scale = _Scale.around(self.q_perm | self.q)
        k_side, k_scale = _Scale.around(self.kt_perm | self.k)
        self.scores = _op("matmul", q_side, k_side)
        scaled, s_scale = _Scale.around(_cast(self.scores))
        self.scales = (q_scale, k_scale, s_scale)
        self.cap_in, self.cap_out = is_const(), is_const()
        tanh = _op("tanh", _op("divide", scaled, self.cap_in))
        logits = _cast(_op("multiply", tanh, self.cap_out) | _op("multiply", self.cap_out, tanh) | scaled)
        self.batch_bias = wildcard()  # added on (B·h, n, n_kv) before the heads split
        self.split = _op("reshape", _op("add", logits, self.batch_bias) | _op("add", self.batch_bias, logits)
                         | logits, wildcard())
        logits = self.split | logits
        self.bias, self.keep, self.hide = wildcard(), wildcard(), wildcard()
        self.keep_fill, self.hide_fill = is_const(), is_const()
        self.bias2 = wildcard()  # a second additive term (T5: its relative position bias, then the mask)
        biased = _op("add", logits, self.bias) | _op("add", self.bias, logits)
        # a bool mask, then a float one as bias2 (GPT-2's eager attention: its causal buffer, then the padding)
        # (or the bias added first and the bool mask over the sum: MPT's ALiBi, then its masked_fill)
        chosen = biased | logits
        selected = _op("where", self.keep, chosen, self.keep_fill) | _op("where", self.hide, self.hide_fill, chosen)
        masked = (_op("add", biased, self.bias2) | _op("add", self.bias2, biased) | biased
                  | _op("add", selected, self.bias2) | _op("add", self.bias2, selected) | selected | logits)
        # each head's sink logit joined as one more key column, dropped after the softmax (GPT-OSS)
        self.sink = wildcard()
        self.joined = _op("concat", is_tuple([masked, self.sink]))
        joined = self.joined | masked
        # softmax(x - max x): the row max the kernel takes itself (GPT-OSS's overflow guard)
        self.row_max = _op("max", joined)
        self.stable = _op("subtract", joined, self.row_max)
        self.softmax = _op("nn.softmax", _cast(self.stable | joined))
        probs = _cast(self.softmax)
        self.sunk = _op("strided_slice", probs, *(wildcard() for _ in range(4)))  # the sink's column dropped
        probs = self.sunk | probs
        probs = is_tuple_get_item(_op("nn.dropout", probs), 0) | probs
        self.guard, self.zero = wildcard(), is_const()
        self.weights = _op("where", self.guard, self.zero, probs) | probs
        self.unsplit = _op("reshape", self.weights, wildcard())  # (B, h, n, n_kv) back to (B·h, n, n_kv)
        self.out = _op("matmul", self.unsplit | self.weights, self.v_rep | self.v_perm | self.v)
        self.root = {"merged": _op("permute_dims", self.out), "out": self.out, "weights": self.weights}[root]
        # ONNX's guard: a row whose bias is -inf everywhere gets zeros
        self.guard_bias = wildcard()
        self.guard_rule = _op("equal", _op("max", self.guard_bias), is_const())
        # torch's exporter's: where(isnan(probs), 0, probs), NaN exactly in the rows that see no key
        self.guard_nan = _op("isnan", _cast(self.softmax))
