#!/usr/bin/env python
"""The GPU check: on a machine with an NVIDIA GPU, compile tvmattn's CUDA kernels, check each against
the float64 NumPy oracle, and time them against PyTorch's scaled_dot_product_attention (flash backend)
in the same process. Prints a table of TFLOP/s and ratios; sized to finish in under 5 minutes on an
H100/H200 (the first fp16 compile loads TVM's tensor intrinsics, ~10 s).

    python scripts/gpu_check.py                  # correctness of the presets and variants, then speed
    python scripts/gpu_check.py --tune 64        # first tune gpt2-small and the fp16 shapes (writes
                                                 # tuning_logs/cuda-sm_XX/, ~1 s a trial), then check
    python scripts/gpu_check.py --dry-run        # on the CPU: LLVM kernels, tiny shapes (the tests run it)

Correctness: every preset and variant runs on seeded random data against the oracle at the
verify tolerances; each timed shape is also compared with PyTorch's output (max |Δ| / max |ref|).
Memory: the timed kernels allocate no global scratch (split-K decode: O(h·n·splits·d_v) partials);
`tests/test_cuda.py` proves that no buffer grows with n·n_kv. Exit status 1 when anything fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import tvm

import tvmattn
from tvmattn import AttentionSpec
from tvmattn.compiler.explain import useful_flops
from tvmattn.compiler.verify import TOLERANCE, check, errors
from tvmattn.models.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def core(b: int, h: int, n: int, d: int, causal: bool, dtype: str = "float16", **fields) -> AttentionSpec:
    return AttentionSpec(batch=b, seq_len=n, num_heads=h, head_dim=d, causal=causal, dtype=dtype,
                         projections=False, **fields)


def variants(dry: bool) -> dict[str, AttentionSpec]:
    """What the oracle checks: the presets (fp32 layers, decode) and the fp16/bf16 kernel kinds."""
    if dry:
        return {"tiny-causal": core(1, 2, 40, 16, True, "float32"),
                "tiny-gqa-window": core(2, 4, 33, 8, True, "float32", num_kv_heads=2, window=7)}
    out = dict(PRESETS)
    out.update({
        "fp16-causal-d64": core(2, 12, 1024, 64, True),
        "bf16-d128-bshd": core(1, 8, 1024, 128, False, "bfloat16", layout="BSHD"),
        "fp16-gqa-window": core(1, 32, 1024, 128, True, num_kv_heads=8, window=256),
        "fp16-cross-padded": core(2, 8, 256, 64, False, kv_seq_len=700, key_padding=True),
        "fp16-symbolic": core(1, 8, "n", 64, True),
    })
    return out


def speed_shapes(dry: bool) -> list[AttentionSpec]:
    """FlashAttention's benchmark shapes: fp16, d_k 64 and 128, n 1k–8k, 16k tokens a batch."""
    if dry:
        return [core(1, 2, 64, 16, c, "float32") for c in (False, True)]
    return [core(16384 // n, 2048 // d, n, d, c) for d in (64, 128) for n in (1024, 2048, 4096, 8192)
            for c in (False, True)]


def timed(fn, sync, reps: int = 20) -> float:
    """Mean seconds of ``fn`` over ``reps`` back-to-back launches (after two warm-up calls)."""
    for _ in range(2):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def torch_sdpa(spec: AttentionSpec, q: np.ndarray, k: np.ndarray, v: np.ndarray, device: str):
    import torch
    import torch.nn.functional as F

    tq, tk, tv = (torch.from_numpy(x).to(device) for x in (q, k, v))
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=spec.causal)
        return run, torch.cuda.synchronize
    return (lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=spec.causal)), (lambda: None)


def paged_variants(dry: bool) -> dict[str, tvmattn.PagedSpec]:
    """The paged-cache decode kernels (the flash template reading K/V through a block table): both
    layouts, GQA, fp16/bf16/fp32, pages shuffled through the pool, ragged lengths (`PAGED_SIZES`)."""
    cases = [("float32", "NHD", 1), ("float32", "HND", 2)] if dry else [
        ("float16", "NHD", 1), ("bfloat16", "HND", 1), ("float32", "NHD", 4), ("float16", "HND", 2)]
    heads, kv_heads, d = (4, 2, 16) if dry else (32, 8, 128)
    return {f"paged-{layout}-{dtype}-n{q_len}": tvmattn.PagedSpec(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=d, page_size=16, kv_layout=layout, q_len=q_len,
        dtype=dtype, causal=True) for dtype, layout, q_len in cases}


def check_variants(target: str, arch: str | None, dry: bool) -> list[str]:
    failures = []
    paged_sizes = {"b": 3, "num_pages": 12, "max_pages": 4} if dry else {"b": 4, "num_pages": 600, "max_pages": 140}
    print(f"{'oracle check':<22} {'schedule':<58} {'compile':>8}  result")
    for name, spec in {**variants(dry), **paged_variants(dry)}.items():
        sizes = paged_sizes if isinstance(spec, tvmattn.PagedSpec) else {d: 700 for d in spec.symbolic_dims} or None
        try:
            kernel = tvmattn.compile(spec, target, arch=arch)
            result = check(kernel, sizes)
        except Exception as err:  # one broken case must not hide the others' results
            print(f"{name:<22} FAIL: {type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}")
            failures.append(name)
            continue
        print(f"{name:<22} {kernel.schedule[:58]:<58} {kernel.compile_seconds:7.1f}s  {result.line()}")
        if not result.ok:
            failures.append(name)
    return failures


def time_shapes(target: str, arch: str | None, dry: bool) -> tuple[list[dict], list[str]]:
    device = "cpu" if dry else "cuda"
    dev = tvm.cpu(0) if dry else tvm.cuda(0)
    rows, failures = [], []
    print(f"\n{'B,h,n,d_k':<16} {'causal':<7} {'tvmattn':>9} {'torch':>9} {'ratio':>6} {'max err':>8}  schedule")
    for spec in speed_shapes(dry):
        try:
            row = time_one(spec, target, arch, device, dev)
        except Exception as err:
            print(f"{spec.describe()}: FAIL: {type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}")
            failures.append(spec.describe())
            continue
        rows.append(row)
        ok = row["max_rel_error"] <= TOLERANCE[spec.dtype]
        print(f"{','.join(map(str, row['shape'])):<16} {str(spec.causal):<7} {row['tvmattn_tflops']:9.3f} "
              f"{row['torch_tflops']:9.3f} {row['ratio']:5.2f}× {row['max_rel_error']:8.1e}  "
              f"{'PASS' if ok else 'FAIL'} {row['schedule'][:60]}")
        if not ok:
            failures.append(f"{row['shape']} causal={spec.causal}")
    return rows, failures


def time_one(spec: AttentionSpec, target: str, arch: str | None, device: str, dev) -> dict:
    """One timed shape: tvmattn and torch SDPA on the same inputs, and how far their outputs differ."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(spec.dtype) for s in list(spec.input_shapes().values())[:3])
    kernel = tvmattn.compile(spec, target, arch=arch)
    args = [tvm.runtime.tensor(x, dev) for x in (q, k, v)]
    out = tvm.runtime.empty(spec.output_shape(), spec.dtype, dev)
    ours = timed(lambda: kernel.run(*args, out), dev.sync)
    run_torch, sync = torch_sdpa(spec, q, k, v, device)
    theirs = timed(run_torch, sync)
    ref = run_torch().float().cpu().numpy()
    _, err = errors(out.numpy(), ref)
    work = useful_flops(spec)
    return {"shape": [spec.batch, spec.h, spec.n_q, spec.d_k], "causal": spec.causal, "dtype": spec.dtype,
            "tvmattn_tflops": work / ours / 1e12, "torch_tflops": work / theirs / 1e12,
            "ratio": theirs / ours, "max_rel_error": err, "schedule": kernel.schedule}


def tune_first(arch: str, trials: int) -> None:
    from tvmattn.compiler.tuning.tuner import tune

    for spec in [PRESETS["gpt2-small"], *speed_shapes(dry=False)]:
        try:
            report = tune(spec, "cuda", arch=arch, trials=trials, log_dir=ROOT / "tuning_logs")
        except Exception as err:  # the checks below still run, on the default schedule
            print(f"tuning {spec.describe()} failed: {str(err).strip().splitlines()[-1][:200]}", flush=True)
            continue
        best = report.points[0].best
        print(f"tuned {spec.describe()}: best {best.latency_us if best else float('nan'):.1f} µs "
              f"({report.seconds:.0f} s)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU with tiny shapes")
    parser.add_argument("--tune", type=int, default=0, metavar="TRIALS", help="tune first, TRIALS per workload")
    parser.add_argument("--json", help="write the timing table to this JSON file")
    args = parser.parse_args()
    if args.dry_run:
        target, arch = "cpu", None
    else:
        if not tvm.cuda(0).exist:
            print("gpu_check: no CUDA device here; --dry-run checks the script on the CPU", file=sys.stderr)
            return 2
        target, arch = "cuda", "sm_" + tvm.cuda(0).compute_version.replace(".", "")
        print(f"device: {tvm.cuda(0).device_name} ({arch}), TVM {tvm.__version__}")
        if args.tune:
            tune_first(arch, args.tune)
    start = time.perf_counter()
    failures = check_variants(target, arch, args.dry_run)
    rows, slow = time_shapes(target, arch, args.dry_run)
    failures += slow
    ratios = [r["ratio"] for r in rows]
    print(f"\ntvmattn / torch SDPA throughput: geometric mean {np.exp(np.mean(np.log(ratios))):.2f}×, "
          f"min {min(ratios):.2f}×, max {max(ratios):.2f}× (TFLOP/s counts causal work as half); "
          f"{time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if failures:
        print("FAILED: " + ", ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
