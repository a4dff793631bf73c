"""Run a compiled kernel on seeded random data and compare it with the float64 oracle.

The error is normalised by the output's scale: ``max|out - ref| / max|ref|``. It must not exceed the
dtype's tolerance (fp32 accumulation throughout; fp16/bf16 pay for their rounded inputs, stored
projections and output):
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tvmattn.compiler.kernel import CompiledAttention, numpy_dtype
from tvmattn.compiler.oracle import reference
from tvmattn.compiler.spec import AttentionSpec

TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
DEFAULT_SYMBOLIC_SIZES = (1, 37, 128)  # the lengths a symbolic size is checked at when none are given


@dataclass
class Check:
    what: str  # what was compared: the dtype, or an output's name and dtype
    sizes: dict[str, int]
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.max_abs)) and self.max_rel <= self.tolerance

    def line(self) -> str:
        at = (" at " + " ".join(f"{k}={v}" for k, v in self.sizes.items())) if self.sizes else ""
        return (f"{'PASS' if self.ok else 'FAIL'}{at}: max abs error {self.max_abs:.3g}, "
                f"max rel error {self.max_rel:.3g} (tolerance {self.tolerance:g}, {self.what})")


def random_inputs(spec: AttentionSpec, sizes: dict[str, int] | None = None,
                  seed: int = 0) -> dict[str, np.ndarray]:
    """Arguments for ``spec`` by name (call order), scaled like a trained layer: O(1) scores."""
    rng = np.random.default_rng(seed)
    sizes = sizes or {}
    out: dict[str, np.ndarray] = {}
    for name, shape in spec.input_shapes().items():
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in shape)
        if name == "kv_lens":
            n_kv = sizes[spec.n_kv] if isinstance(spec.n_kv, str) else spec.n_kv
            out[name] = rng.integers(1, n_kv + 1, size=shape).astype(np.int32)
            continue
        if name == "attn_mask":  # about one key in five hidden; a bias of O(1) on the others
            hidden = rng.random(shape) < 0.2
            out[name] = ~hidden if spec.attn_mask == "bool" else np.where(
                hidden, -np.inf, rng.standard_normal(shape)).astype(np.float32)
            continue
        if name == "sinks":  # logits of O(1), as the scores are
            out[name] = rng.standard_normal(shape).astype(np.float32)
            continue
        std = 1.0 / np.sqrt(shape[0]) if name.startswith("w_") else 1.0  # W ~ N(0, 1/fan_in)
        out[name] = (rng.standard_normal(shape) * std).astype(numpy_dtype(spec.dtype))
    return out


def check(kernel: CompiledAttention, sizes: dict[str, int] | None = None, seed: int = 0,
          inputs: dict[str, np.ndarray] | None = None) -> Check:
    """Run ``kernel`` once at ``sizes`` (values of its symbolic lengths) and compare with the oracle;
    ``inputs`` replace the drawn arguments of those names."""
    spec = kernel.spec
    args = {**random_inputs(spec, sizes, seed), **(inputs or {})}
    kv_lens = args.pop("kv_lens", None)
    attn_mask = args.pop("attn_mask", None)
    sinks = args.pop("sinks", None)
    x_kv = args.pop("x_kv", None) if spec.projections and spec.is_cross else None
    out = kernel(*args.values(), x_kv=x_kv, kv_lens=kv_lens, attn_mask=attn_mask, sinks=sinks).astype(np.float64)
    arrays = list(args.values())
    if x_kv is not None:
        arrays.insert(1, x_kv)
    ref = reference(spec, *arrays, kv_lens=kv_lens, attn_mask=attn_mask, sinks=sinks)
    return Check(spec.dtype, dict(sizes or {}), *errors(out, ref), TOLERANCE[spec.dtype])


def errors(out: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """max|out - ref|, and that over max|ref| (its finite entries; equal infinities are no error)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    with np.errstate(invalid="ignore"):  # -inf logits where a key is hidden: equal, not NaN
        diff = np.where(out == ref, 0.0, np.abs(out - ref))
    max_abs = float(np.max(diff)) if out.size else 0.0
    finite = ref[np.isfinite(ref)]
    scale = float(np.max(np.abs(finite))) if finite.size else 1.0
    return max_abs, max_abs / max(scale, 1e-30)


def sizes_to_check(spec: AttentionSpec, given: dict[str, int] | None = None) -> list[dict[str, int]]:
    """Each symbolic size at the given value, else at each of DEFAULT_SYMBOLIC_SIZES."""
    names = spec.symbolic_dims
    if not names:
        return [{}]
    if given:
        return [{name: given[name] for name in names}]
    return [{name: size for name in names} for size in DEFAULT_SYMBOLIC_SIZES]
