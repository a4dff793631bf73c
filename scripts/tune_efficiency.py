"""Tuning efficiency of `tvmattn tune`: a benchmark, not a test.

    python scripts/tune_efficiency.py                                  # gpt2-small, 256 trials
    python scripts/tune_efficiency.py --preset bert-base --trials 64 --json out.json
    python scripts/tune_efficiency.py --seq 128 --trials 16                # a quick check of the script

Tunes into a fresh temporary log directory (never the shipped or the user's logs) and prints:
- best latency against trials and wall time (the issue's targets: 64 trials within 10 minutes, and
  within 10% of the best that 256 trials find),
- where the time of a trial goes: building, measuring, the search's own scheduling, the cost
  model, and the fixed overhead per trial (everything but running the kernel; target <= 3 s).
Run it on a quiet machine: the load average is printed so a noisy run is recognisable.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from functools import wraps

from tvmattn.compiler.explain import useful_flops
from tvmattn.compiler.tuning import measure, search, tuner
from tvmattn.compiler.tuning.records import Record
from tvmattn.models.presets import PRESETS, preset

# The parts of a trial, timed by wrapping the objects that do them.
PARTS = {
    "build (compile + link, build workers)": (measure.PooledBuilder._cls, "build"),
    "measure (runner, incl. kernel runs)": (measure.LocalRunner._cls, "run"),
    "search: schedule candidates": (search.KnobSearch._cls, "_pool"),
    "search: space reduction + warm start": (search.KnobSearch._cls, "pre_tuning"),
    "cost model: rank": (tuner._CostModel._cls, "predict"),
    "cost model: train": (tuner._CostModel._cls, "update"),
}


def timed(seconds: dict[str, float]) -> None:
    for part, (cls, name) in PARTS.items():
        original = getattr(cls, name)

        @wraps(original)
        def wrapper(*args, __original=original, __part=part, **kwargs):
            start = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                seconds[__part] += time.perf_counter() - start

        setattr(cls, name, wrapper)


def kernel_seconds(records: list[Record]) -> float:
    """Time the runner spends running kernels: a warm-up, then each repeat lasts at least
    min_repeat_ms (more runs are added to reach it)."""
    cfg = measure.EVALUATOR
    total = 0.0
    for r in records:
        if r.ok:
            lat = r.latency_us * 1e-6
            total += lat + cfg.repeat * max(cfg.min_repeat_ms * 1e-3, lat * cfg.number)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-small", choices=list(PRESETS))
    parser.add_argument("--seq", type=int, help="override the preset's sequence length (a quick run)")
    parser.add_argument("--trials", type=int, default=256)
    parser.add_argument("--checkpoints", default="8,16,32,64,128,256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the curve and the breakdown here")
    args = parser.parse_args()

    spec = preset(args.preset)
    if args.seq:
        spec = spec.replace(seq_len=args.seq)
    flops = useful_flops(spec)
    seconds: dict[str, float] = defaultdict(float)
    timed(seconds)
    curve: list[dict] = []
    seen: list[Record] = []
    load_before = os.getloadavg()
    start = time.monotonic()

    def on_round(records: list[Record]) -> None:
        seen.extend(records)
        ok = [r.latency_us for r in seen if r.ok]
        curve.append({"trials": len({r.knob_key for r in seen}),  # (the confirmations at the end: none)
                      "wall_s": round(time.monotonic() - start, 1),
                      "best_us": min(ok) if ok else None})

    with tempfile.TemporaryDirectory(prefix="tvmattn-efficiency-") as logs:
        report = tuner.tune(spec, "cpu", trials=args.trials, log_dir=logs, seed=args.seed, on_round=on_round)
    wall = time.monotonic() - start
    load_after = os.getloadavg()

    print(f"{args.preset}: {spec.describe()}")
    print(f"{len({r.knob_key for r in seen})} trials (+ {report.confirmations} confirming) in {wall:.0f} s; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"(on {os.cpu_count()} CPUs: above ~0.5 per CPU the numbers are noisy)")
    default = report.points[0].default
    if default:
        print(f"default schedule: {default.latency_us:,.1f} µs ({flops / default.latency_us / 1e3:.1f} GFLOP/s)")
    print(f"\n{'trials':>6} {'wall':>8} {'best µs':>10} {'GFLOP/s':>8}")
    marks = sorted(int(c) for c in args.checkpoints.split(","))
    at_mark = {}
    for point in curve:
        if point["best_us"] is None:
            continue
        for mark in marks:
            if mark not in at_mark and point["trials"] >= mark:
                at_mark[mark] = point
        print(f"{point['trials']:>6} {point['wall_s']:>7.0f}s {point['best_us']:>10,.1f} "
              f"{flops / point['best_us'] / 1e3:>8.1f}")
    final = curve[-1]["best_us"] if curve else None
    if 64 in at_mark and final:
        print(f"\nafter 64 trials: {at_mark[64]['wall_s']:.0f} s, best {at_mark[64]['best_us']:,.1f} µs = "
              f"{at_mark[64]['best_us'] / final:.3f}× the best of all {len(seen)} trials")

    evaluation = kernel_seconds(seen)
    print(f"\nper trial ({len(seen)} trials): wall {wall / len(seen):.2f} s")
    for part in PARTS:
        print(f"  {part:<40} {seconds[part] / len(seen):6.2f} s")
    print(f"  {'(running the kernel itself)':<40} {evaluation / len(seen):6.2f} s")
    print(f"fixed overhead per trial (wall minus kernel runs): {(wall - evaluation) / len(seen):.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "trials": len(seen), "wall_s": wall, "curve": curve,
                       "per_trial_s": {p: seconds[p] / len(seen) for p in PARTS},
                       "fixed_overhead_per_trial_s": (wall - evaluation) / len(seen),
                       "load_average": [load_before, load_after]}, f, indent=1)


if __name__ == "__main__":
    main()
