"""tvmattn's kernels in fp32, bf16 and fp16 against each other, in one process: the kernel bench's
suite (and the decode shape of the 16-bit targets) in interleaved rounds, so that the ratios to fp32
read the same machine state. Each kernel is timed as `tvmattn bench` times tvmattn (resident tensors,
no NumPy conversion per call).

    python scripts/bench_dtypes.py [--budget 1.0] [--layers] [--tuned]

``--layers`` adds full layers (projections included) of a GPT-2-sized model; ``--tuned`` times each
kernel with its best tuning record where one exists (the default schedule otherwise, and by default).
"""

from __future__ import annotations

import argparse
import statistics

from tvmattn.compiler import bench  # first: idle TVM workers do not spin
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.verify import random_inputs

DTYPES = ("float32", "bfloat16", "float16")
DECODE = AttentionSpec(batch=1, seq_len=1, kv_seq_len=4096, num_heads=32, head_dim=128, projections=False)
LAYERS = [AttentionSpec(batch=b, seq_len=n, num_heads=12, d_model=768, causal=True) for b, n in
          ((1, 1), (1, 128), (4, 256), (1, 1024))]


def runner(spec: AttentionSpec, tuned: bool):
    """The kernel of ``spec`` (its tuning record's if ``tuned``, else the default schedule's) on seeded
    inputs (the fp32 values rounded to the dtype), timed as `tvmattn bench` times it: on tensors
    already resident, the kernel alone."""
    run, _ = bench.tvmattn_impl(spec, random_inputs(spec, seed=0), tuned=tuned)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timed runs per kernel")
    parser.add_argument("--layers", action="store_true", help="full layers too")
    parser.add_argument("--tuned", action="store_true", help="each kernel's best tuning record where one exists")
    args = parser.parse_args()
    specs = bench.suite("default") + [DECODE] + (LAYERS if args.layers else [])
    print(f"{'spec':58s} " + " ".join(f"{d:>9s}" for d in DTYPES) + "   bf16×   fp16×  (fp32 ms / ms)")
    for spec in specs:
        runs = {d: runner(spec.replace(dtype=d), args.tuned) for d in DTYPES}
        ms = {d: statistics.median(t) * 1e3 for d, t in bench.interleaved(runs, args.budget, rounds=9).items()}
        ratios = "  ".join(f"{ms['float32'] / ms[d]:6.2f}" for d in DTYPES[1:])
        label = spec.describe().replace("float32 ", "")
        print(f"{label:58s} " + " ".join(f"{ms[d]:9.3f}" for d in DTYPES) + f"  {ratios}", flush=True)


if __name__ == "__main__":
    main()
