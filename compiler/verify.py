"""Run a compiled kernel on seeded random data and compare it with the float64 oracle.

The error is normalised by the output's scale: ``max|out - ref| / max|ref|``. It must not exceed the
dtype's tolerance (fp32 sums, but for fp16 P·V on a CPU's fp16 FMAs, summed in fp16 over blocks of
32 keys: `te_attention._core`; fp16/bf16 pay for their rounded inputs, stored projections and output):
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tvmattn.compiler import arguments
from tvmattn.compiler.kernel import CompiledAttention
from tvmattn.compiler.oracle import paged_reference, reference
from tvmattn.compiler.paged import PagedSpec
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
    """Arguments for ``spec`` by name (call order), drawn as `arguments.TABLE` says: scaled like a
    trained layer, O(1) scores."""
    return arguments.draw(spec, sizes, seed)


def check(kernel: CompiledAttention, sizes: dict[str, int] | None = None, seed: int = 0,
          inputs: dict[str, np.ndarray] | None = None) -> Check:
    """Run ``kernel`` once at ``sizes`` (values of its symbolic lengths) and compare with the oracle (a
    paged kernel: the paged oracle); ``inputs`` replace the drawn arguments of those names."""
    spec = kernel.spec
    arrays, named = arguments.split(spec, {**random_inputs(spec, sizes, seed), **(inputs or {})})
    out = kernel(*arrays, **named).astype(np.float64)
    ref = (paged_reference if isinstance(spec, PagedSpec) else reference)(spec, *arrays, **named)
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
