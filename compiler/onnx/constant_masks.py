"""A constant mask on the scores as what the kernel does instead: nothing, the spec's causal rule, or a bool
mask (`patterns` reads a folded mask, a constant bias or where() condition, with these)."""

from __future__ import annotations

import numpy as np
from tvm import relax

from tvmattn.compiler.onnx.kernels import Mask


def hides_only(keep: np.ndarray, bias: np.ndarray) -> bool:
    """Whether a constant bias acts as the bool mask ``keep``: -inf where hidden, or a fill that
    absorbs every score (≤ -1e30) in rows that keep a key (exp(fill - max) is then exactly 0)."""
    return bool(np.all(bias[~keep] == -np.inf) or keep.any(axis=-1).all())


def band(keep: np.ndarray) -> tuple[int, int | None] | None:
    """(u, l) where a bool ``keep`` (…, n, n_kv), the same for every leading index, is True exactly
    where l ≤ j − i ≤ u (query i, key j): a causal mask at offset u, with a sliding window where l is
    not None (None: nothing below the diagonal hidden). None for any other mask, or one hiding all."""
    if keep.ndim < 2 or not keep.any():
        return None
    planes = keep.reshape(-1, *keep.shape[-2:])
    if not (planes == planes[0]).all():
        return None
    n, n_kv = planes[0].shape
    offsets = np.arange(n_kv)[None, :] - np.arange(n)[:, None]  # j − i
    upper, lower = int(offsets[planes[0]].max()), int(offsets[planes[0]].min())
    if not np.array_equal(planes[0], (offsets <= upper) & (offsets >= lower)):
        return None
    return upper, None if lower == offsets.min() else lower


def keep_rule(keep: np.ndarray, scores: tuple[int | None, ...]) -> tuple[Mask | None, dict]:
    """A constant bool mask: nothing if it hides nothing, the spec's causal rule (with a sliding window)
    if it is one. One query that sees every key of a mask spanning the keys is a decode step's causal
    mask (bottom-right: the query sits after the whole cache), the same values either way."""
    n, n_kv = scores[-2], scores[-1]
    if keep.all():
        if n == 1 and n_kv is not None and n_kv > 1 and keep.shape[-1] == n_kv:
            return None, {"causal": True, "causal_align": "bottom_right"}
        return None, {}
    found = band(keep) if keep.shape[-2:] == (n, n_kv) else None
    if found is not None:
        upper, lower = found
        for align, offset in (("top_left", 0), ("bottom_right", n_kv - n)):
            if upper == offset:  # j ≤ i + offset, and j ≥ i + l: j > i + offset − W, W = offset − l + 1
                rule = {"causal": True, "causal_align": align}
                return None, rule if lower is None else rule | {"window": upper - lower + 1}
    return Mask(relax.const(keep), "bool"), {}
