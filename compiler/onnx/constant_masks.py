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


def keep_rule(keep: np.ndarray, scores: tuple[int | None, ...]) -> tuple[Mask | None, dict]:
    """A constant bool mask: nothing if it hides nothing, the spec's causal rule (with a sliding window)
    if it is one. One query that sees every key of a mask spanning the keys is a decode step's causal
    mask (bottom-right: the query sits after the whole cache), the same values either way."""
    n, n_kv = scores[-2], scores[-1]
    if keep.all():
        if n == 1 and n_kv is not None and n_kv > 1 and keep.shape[-1] == n_kv:
            return None, {"causal": True, "causal_align": "bottom_right"}
        return None, {}
    if keep.shape[-2:] == (n, n_kv) and n is not None and n_kv is not None:
        rows = keep.reshape(-1, n, n_kv)
        if (rows == rows[0]).all():
            i, j = np.arange(n)[:, None], np.arange(n_kv)[None, :]
            width = int(rows[0].sum(axis=1).max())  # a sliding window's keys, where it is one
            for align, offset in (("top_left", 0), ("bottom_right", n_kv - n)):
                if np.array_equal(rows[0], j <= i + offset):
                    return None, {"causal": True, "causal_align": align}
                if np.array_equal(rows[0], (j <= i + offset) & (j > i + offset - width)):
                    return None, {"causal": True, "causal_align": align, "window": width}
    return Mask(relax.const(keep), "bool"), {}
