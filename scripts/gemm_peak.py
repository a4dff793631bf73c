"""Every GEMM-class function of the zoo's models (`models/zoo.py`) at the rate it runs inside its model,
as a share of this CPU's measured FMA peak (`compiler/peak.py`): the matmul and conv rules' functions
with at least 128 rows (batch × sequence), timed by the model's profile (`ImportedModel.profile`).

    python scripts/gemm_peak.py [--models bert,vit-ort] [--shape 2x128] [--dtype bf16]

Prints one line per model (its GEMM time, the time-weighted %peak, the slowest function's), then the
distribution over every function: the issue's target is ≥ 80 % from 128 rows up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tvmattn  # noqa: E402
from tvmattn.compiler.onnx.profile import profile  # noqa: E402
from tvmattn.compiler.peak import peak_gflops  # noqa: E402
from tvmattn.models import zoo  # noqa: E402

GEMM_RULES = ("matmul", "matmul-bf16")
LEAST_GFLOP = 1e-3  # functions under a MFLOP (a head's 1-row projection) say nothing of the GEMM's rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", help="comma-separated zoo names (default: every model but decode steps)")
    p.add_argument("--shape", default="2x128", help="(batch)x(n): batch 2, 128 tokens gives 256 rows")
    p.add_argument("--dtype", help="bf16: the import's matmuls in bf16, against the bf16 dot-product peak")
    args = p.parse_args()
    batch, n = (int(x) for x in args.shape.split("x"))
    names = args.models.split(",") if args.models else [m.name for m in zoo.MODELS if m.kind != zoo.DECODE]
    peak, how = peak_gflops("bfloat16" if args.dtype else "float32")
    print(f"peak {peak:.0f} GFLOP/s ({how}); shape {batch}x{n}")
    shares = []
    for name in names:
        m = zoo.get(name)
        imported = tvmattn.import_onnx(m.export(), dtype=args.dtype)
        feed = imported.declared(m.feed((batch, n) if m.kind not in (zoo.VISION, zoo.AUDIO) else m.shapes[0]))
        prof = profile(imported, feed, peak_gflops=peak)
        gemms = [f for f in prof.functions if f.rule in GEMM_RULES and f.flops / 1e9 >= LEAST_GFLOP]
        if not gemms:
            continue
        ms = sum(f.ms for f in gemms)
        weighted = sum(f.gflops * f.ms for f in gemms) / ms / peak
        worst = min(gemms, key=lambda f: f.gflops)
        shares += [(f.gflops / peak, f.ms, name, f.name) for f in gemms]
        print(f"{name:18s} GEMMs {ms:7.2f} ms of {prof.run_ms:7.2f}  at {100 * weighted:5.1f} % of peak; "
              f"slowest {worst.name} {100 * worst.gflops / peak:5.1f} %")
    values = sorted(s for s, *_ in shares)
    total = sum(ms for _, ms, *_ in shares)
    print(f"{len(values)} functions: median {100 * statistics.median(values):.1f} %, min {100 * values[0]:.1f} %; "
          f"{100 * sum(ms for s, ms, *_ in shares if s >= 0.8) / total:.0f} % of GEMM time at >= 80 % of peak")
    for s, ms, name, func in sorted(shares)[:8]:
        print(f"  below: {name} {func} {100 * s:.1f} % ({ms:.3f} ms)")


if __name__ == "__main__":
    main()
