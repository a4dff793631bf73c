"""The kernel's arguments: one row each, the one table every caller reads.

A kernel of a spec takes, in this order, each row whose ``takes`` holds for the spec (then writes its
output):

    x        (B, n, d)           the spec's dtype   layer              the queries' input
    x_kv     (B, n_kv, d)        the spec's dtype   cross layer        the keys' and values' input
    w_q, w_k, w_v, w_o           the spec's dtype   layer              W_Q (d, h·d_k), W_K, W_V (d, h_kv·d),
                                                                       W_O (h·d_v, d)
    q, k, v  the spec's layout   the spec's dtype   core               queries, keys, values
    kv_lens  (B,)                int32              key_padding        each sequence's valid key count
    attn_mask  attn_mask_shape() bool | float32     attn_mask          True = attend, or added to the logits
    sinks    (h,)                float32            sinks              each head's sink logit
    alibi_slopes (h,)            float32            alibi              each head's ALiBi slope

Kernel calls, the oracle (`oracle.reference`), `verify.random_inputs` (how a test draws each), the
tuner's measurement (``measure_fill``: how a benchmark fills an argument a random fill would make
invalid), the benchmark's peers (``peers``: whether their SDPA ops can take it), the ONNX funnel
(`onnx.kernels.attend`), the full layer's core call (`layer`) and the online-softmax template read
this table. The data rows but ``x_kv`` are positional in kernel and oracle calls; the others are
keywords. A new runtime argument is one row here plus its uses in the IR (`variant`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import ml_dtypes
import numpy as np

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.variant import Operand

if TYPE_CHECKING:  # (spec.py imports this module: the table reads specs, it does not build them)
    from tvmattn.compiler.spec import AttentionSpec, Dim

Draw = Callable[["AttentionSpec", np.random.Generator, tuple, Mapping[str, int]], np.ndarray]


@dataclass(frozen=True)
class Argument:
    """One kernel argument: when a spec's kernel takes it, its shape and dtype, how a test draws it."""

    name: str
    takes: Callable[["AttentionSpec"], bool]
    shape: Callable[["AttentionSpec"], "tuple[Dim, ...]"]
    draw: Draw
    dtype: Callable[["AttentionSpec"], str] = lambda spec: spec.dtype
    keyword: bool = True  # a keyword of kernel and oracle calls (else positional, in table order)
    data: bool = False  # the attention's own tensors (x, weights, q, k, v), not what masks or biases it
    what: str = ""  # what it holds, for messages
    asked_by: str = ""  # the spec field(s) that make a kernel take it, for messages
    # a value for every element where the tuner measures (else random bytes): the size of that name
    measure_fill: Callable[["AttentionSpec"], "Dim"] | None = None
    peers: bool = True  # the benchmark's peers (SDPA ops) can take it
    check: Callable[["AttentionSpec", np.ndarray, Mapping[str, int]], None] | None = None  # a call's values

    def missing(self, spec: "AttentionSpec") -> str:
        shape = _pretty(self.shape(spec))
        return f"this spec ({self.asked_by}) needs {self.name}: pass {self.name}={shape}, {self.what}"

    def unexpected(self) -> str:
        return f"{self.name} is only for a spec with {self.asked_by}: build with it, or leave {self.name} out"


def _normal(spec: "AttentionSpec", rng: np.random.Generator, shape: tuple, sizes) -> np.ndarray:
    """O(1) entries (queries, keys, inputs: O(1) scores)."""
    return rng.standard_normal(shape).astype(numpy_dtype(spec.dtype))


def _weights(spec: "AttentionSpec", rng: np.random.Generator, shape: tuple, sizes) -> np.ndarray:
    """W ~ N(0, 1/fan_in), as a trained layer's."""
    return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(numpy_dtype(spec.dtype))


def _lengths(spec: "AttentionSpec", rng: np.random.Generator, shape: tuple, sizes) -> np.ndarray:
    return rng.integers(1, size_of(spec.n_kv, sizes) + 1, size=shape).astype(np.int32)


def _mask(spec: "AttentionSpec", rng: np.random.Generator, shape: tuple, sizes) -> np.ndarray:
    """About one key in five hidden; a bias of O(1) on the others."""
    hidden = rng.random(shape) < 0.2
    if spec.attn_mask == "bool":
        return ~hidden
    return np.where(hidden, -np.inf, rng.standard_normal(shape)).astype(np.float32)


def _logits(spec: "AttentionSpec", rng: np.random.Generator, shape: tuple, sizes) -> np.ndarray:
    """Logits of O(1), as the scores are."""
    return rng.standard_normal(shape).astype(np.float32)


def _slopes(spec: "AttentionSpec", rng: np.random.Generator, shape: tuple, sizes) -> np.ndarray:
    """ALiBi's geometric slopes 2^(-8k/h) (BLOOM's for a power-of-two h), each scaled by a random factor
    in [0.5, 2): from a gentle to a steep distance penalty."""
    k = np.arange(1, shape[0] + 1)
    return (2.0 ** (-8.0 * k / shape[0]) * rng.uniform(0.5, 2.0, shape)).astype(np.float32)


def _valid_lengths(spec: "AttentionSpec", lens: np.ndarray, sizes: Mapping[str, int]) -> None:
    n_kv = size_of(spec.n_kv, sizes)
    if lens.min(initial=0) < 0 or lens.max(initial=0) > n_kv:
        raise TvmAttnError(f"kv_lens must lie in [0, {n_kv}], got {lens.tolist()}")


def _core_operand(name: str) -> Callable[["AttentionSpec"], tuple]:
    def shape(spec: "AttentionSpec") -> tuple:
        heads, seq, width = {"q": (spec.h, spec.n_q, spec.d_k), "k": (spec.h_kv, spec.n_kv, spec.d_k),
                             "v": (spec.h_kv, spec.n_kv, spec.d_v)}[name]
        return Operand(spec.layout, heads, width).shape(spec.batch, seq)
    return shape


def _layer(spec: "AttentionSpec") -> bool:
    return spec.projections


def _core(spec: "AttentionSpec") -> bool:
    return not spec.projections


TABLE: tuple[Argument, ...] = (
    Argument("x", _layer, lambda s: (s.batch, s.n_q, s.d), _normal, keyword=False, data=True),
    Argument("x_kv", lambda s: s.projections and s.is_cross, lambda s: (s.batch, s.n_kv, s.d), _normal,
             what="the keys' and values' input", asked_by="kv_seq_len and projections", data=True),
    Argument("w_q", _layer, lambda s: (s.d, s.h * s.d_k), _weights, keyword=False, data=True),
    Argument("w_k", _layer, lambda s: (s.d, s.h_kv * s.d_k), _weights, keyword=False, data=True),
    Argument("w_v", _layer, lambda s: (s.d, s.h_kv * s.d_v), _weights, keyword=False, data=True),
    Argument("w_o", _layer, lambda s: (s.h * s.d_v, s.d), _weights, keyword=False, data=True),
    Argument("q", _core, _core_operand("q"), _normal, keyword=False, data=True),
    Argument("k", _core, _core_operand("k"), _normal, keyword=False, data=True),
    Argument("v", _core, _core_operand("v"), _normal, keyword=False, data=True),
    Argument("kv_lens", lambda s: s.key_padding, lambda s: (s.batch,), _lengths, lambda s: "int32",
             what="each sequence's valid key count", asked_by="key_padding", measure_fill=lambda s: s.n_kv,
             check=_valid_lengths),
    Argument("attn_mask", lambda s: s.attn_mask is not None, lambda s: s.attn_mask_shape(), _mask,
             lambda s: "bool" if s.attn_mask == "bool" else "float32",
             what="True where a query may attend (bool), or added to the logits (additive)", asked_by="attn_mask"),
    Argument("sinks", lambda s: s.sinks, lambda s: (s.h,), _logits, lambda s: "float32",
             what="each query head's sink logit", asked_by="sinks", peers=False),
    Argument("alibi_slopes", lambda s: s.alibi is not None, lambda s: (s.h,), _slopes, lambda s: "float32",
             what="each query head's ALiBi slope", asked_by="alibi", peers=False),
)
BY_NAME = {a.name: a for a in TABLE}


def table_of(spec: "AttentionSpec") -> tuple[Argument, ...]:
    """The table of ``spec``'s kind of kernel: a spec class may bring its own (``ARGUMENTS``: the paged
    cache's, `paged.TABLE`), rows of the same kind read the same way."""
    return getattr(type(spec), "ARGUMENTS", TABLE)


def taken(spec: "AttentionSpec") -> list[Argument]:
    """The arguments of ``spec``'s kernel, in call order."""
    return [a for a in table_of(spec) if a.takes(spec)]


def extras(spec: "AttentionSpec") -> list[Argument]:
    """The arguments of ``spec``'s kernel past its data (kv_lens, attn_mask, …), in call order."""
    return [a for a in taken(spec) if not a.data]


def split(spec: "AttentionSpec", args: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """``args`` by name → (the positional ones in call order, the keywords): a kernel's or the oracle's call."""
    rows = taken(spec)
    return ([args[a.name] for a in rows if not a.keyword],
            {a.name: args[a.name] for a in rows if a.keyword and a.name in args})


def arrange(spec: "AttentionSpec", positional: tuple, named: Mapping[str, Any]) -> dict[str, Any]:
    """A call's arguments (``positional`` arrays, ``named`` keywords) by name in call order; a
    TvmAttnError naming the first that is missing, extra or unknown."""
    rows = taken(spec)
    order = [a.name for a in rows if not a.keyword]
    if len(positional) != len(order):
        raise TvmAttnError(f"the kernel takes {len(order)} arrays ({', '.join(order)}), got {len(positional)}")
    given = dict(zip(order, positional))
    table = {a.name: a for a in table_of(spec)}
    for name, value in named.items():
        row = table.get(name)
        if row is None or not row.keyword:
            known = ", ".join(a.name for a in table.values() if a.keyword)
            raise TvmAttnError(f"unknown keyword argument {name!r}: the kernels' keywords are {known}")
        if value is not None:
            if not row.takes(spec):
                raise TvmAttnError(row.unexpected())
            given[name] = value
    for row in rows:
        if row.name not in given:
            raise TvmAttnError(row.missing(spec))
    return {a.name: given[a.name] for a in rows}


def draw(spec: "AttentionSpec", sizes: Mapping[str, int] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Every argument of ``spec``'s kernel as a test draws it (seeded), at ``sizes`` (its symbolic sizes)."""
    rng = np.random.default_rng(seed)
    sizes = sizes or {}
    return {a.name: a.draw(spec, rng, tuple(size_of(d, sizes) for d in a.shape(spec)), sizes) for a in taken(spec)}


def size_of(d: "Dim", sizes: Mapping[str, int]) -> int:
    return sizes[d] if isinstance(d, str) else d


def numpy_dtype(dtype: str) -> np.dtype:
    """NumPy's dtype for a kernel dtype name (bfloat16 is ``ml_dtypes.bfloat16``)."""
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def _pretty(shape: tuple) -> str:
    return "(" + ", ".join(str(w) for w in shape) + ")"
