"""`AttentionSpec`: the one description of an attention that every part of tvmattn reads.

Shapes, in the names of the seeds (B batch, n query length, n_kv key/value length, d model width,
h query heads, h_kv key/value heads, d_k head width, d_v value head width):

    full layer  X (B, n, d) ─W_Q (d, h·d_k)──► Q ─┐
                X_kv (B, n_kv, d) ─W_K, W_V (d, h_kv·d_k | h_kv·d_v)──► K, V ─┤ core ─► (B, n, h·d_v) ─W_O─► (B, n, d)
    core        Q (B, h, n, d_k), K (B, h_kv, n_kv, d_k), V (B, h_kv, n_kv, d_v) ──► O (B, h, n, d_v)
                (layout BHSD as above; BSHD puts the sequence axis before the head axis)

Query head i reads key/value head i // (h / h_kv) (GQA; MQA is h_kv = 1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Union

from tvmattn.compiler import arguments
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.variant import MASK_AXES, Operand

Dim = Union[int, str]  # a size, or the name of a symbolic size bound at run time

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
LAYOUTS = ("BHSD", "BSHD")
CAUSAL_ALIGNS = ("top_left", "bottom_right")
MASK_KINDS = ("bool", "additive")
OUTPUTS = ("attn", "scaled_scores", "logits", "weights")
ALIBI_KINDS = ("signed", "symmetric")


class Heads:
    """The head counts of a spec with ``num_heads`` and ``num_kv_heads`` fields (`AttentionSpec`,
    `paged.PagedSpec`)."""

    @property
    def h(self) -> int:
        return self.num_heads

    @property
    def h_kv(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.h // self.h_kv


@dataclass(frozen=True)
class AttentionSpec(Heads):
    """One multi-head attention, as a value.

    Sizes may be symbolic: a name (``seq_len="n"``) makes one compiled kernel serve every length;
    the same name in two fields means the same length.

    Masking (all optional, combined with AND):
      causal        query i sees key j <= i + offset; offset is 0 for ``causal_align="top_left"``
                    (PyTorch and ONNX ``is_causal``) and L - n for ``"bottom_right"`` (FlashAttention,
                    KV-cache decode: query i sits at position past + i), where L is the sequence's
                    valid key count.
      window        sliding window W: i+offset-W < j <= i+offset when causal, |i+offset-j| < W if not.
      key_padding   the kernel takes ``kv_lens`` (B,) int32 at run time: keys j >= kv_lens[b] are
                    hidden.
      attn_mask     the kernel takes a mask tensor ``attn_mask`` (as in ONNX ``Attention`` and PyTorch
                    SDPA): ``"bool"`` (True = may attend) or ``"additive"`` (float32, added to the
                    logits; -inf hides a key). Its shape is (B, h, n, n_kv) with size 1 on every axis
                    not named in ``attn_mask_dims`` (b, h, s = query, t = key): it broadcasts.
    A query row that sees no key at all produces zeros (not NaN).

    ``softcap`` c bounds the scaled scores before the mask: c·tanh(scale·q·k / c) (Gemma, ONNX).
    ``sinks`` (attention sinks, as gpt-oss has them; ONNX Runtime's ``head_sink``): the kernel takes
    ``sinks`` (h,) float32, a logit per query head that joins every row's softmax as a key with no value:
    weights exp(x_t) / (exp(sinks[i]) + Σ_t exp(x_t)), so a row's weights may sum to less than 1. A
    sink of 0 for every head is ONNX Runtime's smooth softmax (softmax_1: 1 added to the denominator).
    ``alibi`` (ALiBi: BLOOM, MPT, Falcon; FlashAttention's ``alibi_slopes``): the kernel takes
    ``alibi_slopes`` (h,) float32, and adds to the logit of query i and key j, after the cap, the
    head's slope times their distance, never materialised: ``"signed"`` slope·(j − pos(i)) (BLOOM,
    FlashInfer; the same softmax as BLOOM's slope·j, which differs by a constant per row) or
    ``"symmetric"`` −slope·|j − pos(i)| (FlashAttention); pos(i) is where query i sits among the keys
    (see causal). On the keys a causal mask leaves the two are equal.
    ``output`` names what the (core) kernel returns: ``"attn"`` (O), or an intermediate (B, h, n, n_kv)
    stage, as ONNX ``qk_matmul_output`` exposes it: ``"scaled_scores"`` (soft-capped), ``"logits"``
    (the mask applied: -inf where hidden) or ``"weights"`` (the softmax; zero rows where nothing is
    visible).
    """

    batch: Dim = 1
    seq_len: Dim = 128
    kv_seq_len: Dim | None = None  # None: self-attention (keys and values come from the queries' X)
    d_model: int | None = None  # None: num_heads * head_dim
    num_heads: int = 8
    num_kv_heads: int | None = None  # None: num_heads (plain MHA)
    head_dim: int | None = None  # None: d_model // num_heads
    v_head_dim: int | None = None  # None: head_dim
    causal: bool = False
    causal_align: str = "top_left"
    window: int | None = None
    key_padding: bool = False
    layout: str = "BHSD"
    dtype: str = "float32"
    projections: bool = True
    scale: float | None = None  # None: 1/sqrt(head_dim)
    attn_mask: str | None = None  # None, "bool" or "additive"
    attn_mask_dims: str = MASK_AXES
    softcap: float | None = None
    output: str = "attn"
    sinks: bool = False
    alibi: str | None = None  # None, "signed" or "symmetric"

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str) and self.dtype.lower() in DTYPES:
            object.__setattr__(self, "dtype", DTYPES[self.dtype.lower()])
        if isinstance(self.layout, str):
            object.__setattr__(self, "layout", self.layout.upper())
        self.validate()

    # ---- derived sizes, in the seeds' names ------------------------------------------------
    @property
    def n_q(self) -> Dim:
        return self.seq_len

    @property
    def n_kv(self) -> Dim:
        return self.seq_len if self.kv_seq_len is None else self.kv_seq_len

    @property
    def d_k(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def d_v(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.d_k

    @property
    def d(self) -> int:
        return self.d_model if self.d_model is not None else self.num_heads * self.d_k

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.d_k)

    @property
    def is_cross(self) -> bool:
        """Full layer only: keys/values are projected from a second input ``x_kv``."""
        return self.kv_seq_len is not None

    @property
    def symbolic_dims(self) -> tuple[str, ...]:
        names = [x for x in (self.batch, self.seq_len, self.kv_seq_len) if isinstance(x, str)]
        return tuple(dict.fromkeys(names))

    # ---- the calling convention: `arguments.TABLE` ------------------------------------------------
    def input_shapes(self) -> dict[str, tuple[Dim, ...]]:
        """Kernel arguments in call order, with their shapes (symbolic sizes as names)."""
        return {a.name: a.shape(self) for a in arguments.taken(self)}

    def attn_mask_shape(self) -> tuple[Dim, ...]:
        """(B, h, n, n_kv) with 1 on the axes the mask broadcasts along."""
        full = dict(zip(MASK_AXES, (self.batch, self.h, self.n_q, self.n_kv)))
        return tuple(full[a] if a in self.attn_mask_dims else 1 for a in MASK_AXES)

    def input_dtype(self, name: str) -> str:
        """The dtype of kernel argument ``name``."""
        return arguments.BY_NAME[name].dtype(self)

    def output_shape(self) -> tuple[Dim, ...]:
        if self.output != "attn":
            return (self.batch, self.h, self.n_q, self.n_kv)
        if self.projections:
            return (self.batch, self.n_q, self.d)
        return Operand(self.layout, self.h, self.d_v).shape(self.batch, self.n_q)

    # ---- checks ----------------------------------------------------------------------------------
    def validate(self) -> "AttentionSpec":
        """Raise TvmAttnError naming the first impossible field and how to fix it."""
        for name in ("batch", "seq_len", "kv_seq_len"):
            _check_dim(name, getattr(self, name), optional=name == "kv_seq_len")
        for name in ("num_heads", "num_kv_heads", "head_dim", "v_head_dim", "d_model", "window"):
            _check_positive_int(name, getattr(self, name), optional=name != "num_heads")
        if self.dtype not in DTYPES.values():
            raise TvmAttnError(f"unknown dtype {self.dtype!r}: use one of float32, float16, bfloat16")
        if self.layout not in LAYOUTS:
            raise TvmAttnError(f"unknown layout {self.layout!r}: use BHSD (B,h,n,d_k) or BSHD (B,n,h,d_k)")
        if self.causal_align not in CAUSAL_ALIGNS:
            raise TvmAttnError(f"unknown causal_align {self.causal_align!r}: use top_left or bottom_right")
        if self.head_dim is None:
            if self.d_model is None:
                raise TvmAttnError("give d_model or head_dim: the head width d_k is d_model / num_heads")
            if self.d_model % self.num_heads != 0:
                raise TvmAttnError(
                    f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}: "
                    f"choose num_heads dividing d_model, or give head_dim explicitly")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads != 0:
            raise TvmAttnError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}: "
                f"each key/value head must serve the same number of query heads (GQA)")
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale)
                                           and self.scale > 0):
            raise TvmAttnError(f"scale={self.scale!r} must be a positive finite number (default 1/sqrt(head_dim))")
        self._validate_extras()
        return self

    def _validate_extras(self) -> None:
        """The fields ONNX models need: tensor masks, softcap, intermediate outputs."""
        if self.attn_mask is not None and self.attn_mask not in MASK_KINDS:
            raise TvmAttnError(f"unknown attn_mask {self.attn_mask!r}: use bool (True = attend) or additive "
                               f"(added to the logits)")
        if not set(self.attn_mask_dims) <= set(MASK_AXES) or len(set(self.attn_mask_dims)) != len(
                self.attn_mask_dims):
            raise TvmAttnError(f"attn_mask_dims={self.attn_mask_dims!r}: name each mask axis once, from "
                               f"b (batch), h (head), s (query), t (key)")
        if self.softcap is not None and not (isinstance(self.softcap, (int, float)) and math.isfinite(self.softcap)
                                             and self.softcap > 0):
            raise TvmAttnError(f"softcap={self.softcap!r} must be a positive finite number (or None: no cap)")
        if self.output not in OUTPUTS:
            raise TvmAttnError(f"unknown output {self.output!r}: use one of {', '.join(OUTPUTS)}")
        if not isinstance(self.sinks, bool):
            raise TvmAttnError(f"sinks={self.sinks!r} must be True (the kernel takes sinks (h,) float32) or False")
        if self.alibi is not None and self.alibi not in ALIBI_KINDS:
            raise TvmAttnError(f"unknown alibi {self.alibi!r}: use signed (slope·(j − i): BLOOM, FlashInfer) or "
                               f"symmetric (−slope·|j − i|: FlashAttention)")
        if self.output != "attn" and self.projections:
            raise TvmAttnError(f"output={self.output!r} is a core-kernel stage: add projections=False")

    # ---- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AttentionSpec":
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TvmAttnError(f"unknown AttentionSpec field(s) {sorted(unknown)}")
        return cls(**data)

    def replace(self, **changes: Any) -> "AttentionSpec":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line: the shapes and the options that are on."""
        kv = f"n_kv={self.n_kv} " if self.kv_seq_len is not None else ""
        gqa = f"h_kv={self.h_kv} " if self.h_kv != self.h else ""
        dv = f"d_v={self.d_v} " if self.d_v != self.d_k else ""
        flags = [f for f, on in (("causal" + ("" if self.causal_align == "top_left" else "(bottom-right)"),
                                  self.causal), (f"window={self.window}", self.window is not None),
                                 ("key-padding", self.key_padding),
                                 (f"{self.attn_mask}-mask({self.attn_mask_dims})", self.attn_mask is not None),
                                 (f"softcap={self.softcap:g}" if self.softcap else "", self.softcap is not None),
                                 ("sinks", self.sinks), (f"alibi({self.alibi})", self.alibi is not None),
                                 (f"returns {self.output}", self.output != "attn")) if on]
        kind = "layer X->W_Q,W_K,W_V..W_O" if self.projections else f"core Q,K,V->O {self.layout}"
        return (f"B={self.batch} n={self.n_q} {kv}d={self.d} h={self.h} {gqa}d_k={self.d_k} {dv}"
                f"{self.dtype} {kind}" + (" " + " ".join(flags) if flags else ""))


def _check_dim(name: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, str):
        if not value.isidentifier():
            raise TvmAttnError(f"{name}={value!r}: a symbolic size must be a name such as 'n'")
        return
    _check_positive_int(name, value, optional=False)


def _check_positive_int(name: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TvmAttnError(f"{name}={value!r} must be a positive integer")
