"""Where an imported model's time goes, function by function: `profile(model, feed)`, printed by
`tvmattn bench model.onnx --profile` (what ONNX Runtime's profiler and OpenVINO's
``benchmark_app -pc`` show their users).

Every call a run makes is recorded (`VirtualMachine.set_instrument`) with a copy of its arguments;
each compiled function is then timed on its own on them, back to back (each with the schedule rule that
took it, ``attention`` for tvmattn's kernels, and its rate), and what they leave of the uninstrumented
run is the VM's own (dispatch, allocation, shape checks) and the cache misses a hot loop does not see,
under ``vm``. A function's FLOPs are counted from its TIR: two per multiply-add of each reduction block
whose body multiplies (a GEMM, a convolution; the attention kernels: `explain.useful_flops`); its bytes
are those of its arguments, each read or written once (a lower bound of its traffic: GB/s for the
memory-bound functions).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import tvm
from tvm import relax

from tvmattn.compiler.kernel import host_tensor

VM = "vm"  # the rule name of the VM's own work


@dataclass
class FunctionTime:
    name: str
    rule: str  # the schedule rule that took it, "attention" (a tvmattn kernel) or "vm"
    calls: int  # per run
    ms: float  # per run, all its calls
    flops: float = 0.0  # per run (multiply-adds × 2 of its products; 0 where it multiplies nothing)
    bytes: float = 0.0  # per run: its arguments' sizes

    @property
    def gflops(self) -> float:
        return self.flops / self.ms / 1e6 if self.ms else 0.0

    @property
    def gbytes_s(self) -> float:
        return self.bytes / self.ms / 1e6 if self.ms else 0.0


@dataclass
class Profile:
    functions: list[FunctionTime]  # slowest first
    run_ms: float  # a whole run, uninstrumented (median)
    peak_gflops: float | None = None
    by_rule: dict[str, float] = field(default_factory=dict)

    def table(self, top: int = 25) -> str:
        total = sum(f.ms for f in self.functions) or 1.0
        lines = [f"a run: {self.run_ms:.3f} ms; each function timed on its own, called back to back on the "
                 f"arguments it had in the run; 'vm' is what they leave of the run (dispatch, allocation, "
                 f"cache misses)" + (f"; peak {self.peak_gflops:.0f} GFLOP/s" if self.peak_gflops else ""),
                 f"  {'function':<44} {'rule':<12} {'calls':>5} {'ms':>9} {'share':>6} {'GFLOP/s':>8} "
                 f"{'%peak':>6} {'GB/s':>7}"]
        for f in self.functions[:top]:
            rate = f"{f.gflops:8.1f}" if f.flops else " " * 8
            peak = f"{100 * f.gflops / self.peak_gflops:5.0f}%" if f.flops and self.peak_gflops else " " * 6
            lines.append(f"  {f.name[:44]:<44} {f.rule:<12} {f.calls:>5} {f.ms:9.3f} {100 * f.ms / total:5.1f}% "
                         f"{rate} {peak} {f.gbytes_s:7.1f}")
        if len(self.functions) > top:
            rest = self.functions[top:]
            lines.append(f"  … {len(rest)} more functions: {sum(f.ms for f in rest):.3f} ms")
        lines.append("  by rule: " + ", ".join(f"{r} {ms:.3f} ms" for r, ms in self.by_rule.items()))
        return "\n".join(lines)


def profile(imported, feed: Mapping[str, np.ndarray], runs: int = 5, peak_gflops: float | None = None) -> Profile:
    """Time every call of ``imported`` (a CPU `ImportedModel`) on ``feed``: each compiled function
    called again and again on a copy of the arguments it had in a run (the median of ``runs`` rounds),
    and the whole run, uninstrumented (the median of as many runs); what the functions leave of the run
    is the VM's own (dispatch, allocation, shape checks) and the caches' misses."""
    vm = relax.VirtualMachine(imported.executable, tvm.cpu())
    args = [host_tensor(a) for a in imported._arguments(feed)]
    calls: list[tuple[str, list]] = []  # (function, a copy of its arguments) in run order

    def instrument(_func, symbol, before, _ret, *call_args):
        if before:  # a copy: the VM reuses its storage, and an index argument must stay in range
            calls.append((symbol, [tvm.runtime.tensor(a.numpy()) if isinstance(a, tvm.runtime.Tensor) else a
                                   for a in call_args]))
        return 0

    vm["main"](*args)  # warm
    plain = []
    for _ in range(runs):
        start = time.perf_counter()
        vm["main"](*args)
        plain.append(time.perf_counter() - start)
    run_ms = statistics.median(plain) * 1e3
    vm.set_instrument(instrument)
    vm["main"](*args)
    # Timed apart from the run: a Python callback around each call in the run put TVM's idle workers to
    # sleep before every kernel, and the wake-up (tens of µs) made a 40 µs GEMM read as 100 µs.
    lib = imported.executable.mod
    work = imported.report.work
    timed: dict[str, list[float]] = defaultdict(list)  # function → seconds of each call
    sizes: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for symbol, call_args in calls:
        fn = lib.get_function(symbol, True) if _rule_of(symbol, imported.report.rule_of) != VM else None
        if fn is None:
            continue
        timed[symbol].append(_seconds(fn, call_args, runs))
        sizes[symbol].append(_work_of(symbol, call_args, work))
    out = [FunctionTime(symbol, _rule_of(symbol, imported.report.rule_of), len(ts), sum(ts) * 1e3,
                        sum(f for f, _ in sizes[symbol]), sum(b for _, b in sizes[symbol]))
           for symbol, ts in timed.items()]
    own = run_ms - sum(f.ms for f in out)
    out.append(FunctionTime(VM, VM, len(calls) - sum(f.calls for f in out), max(0.0, own)))
    out.sort(key=lambda f: -f.ms)
    by_rule: dict[str, float] = defaultdict(float)
    for f in out:
        by_rule[f.rule] += f.ms
    return Profile(out, run_ms, peak_gflops, dict(sorted(by_rule.items(), key=lambda kv: -kv[1])))


def _seconds(fn, call_args: list, rounds: int) -> float:
    """One call's time: back to back (workers awake, its arguments in cache), as many calls a round as
    fill ~0.2 ms, the median of ``rounds``."""
    start = time.perf_counter()
    fn(*call_args)
    once = time.perf_counter() - start
    reps = max(1, min(100, int(2e-4 / max(once, 1e-7))))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn(*call_args)
        samples.append((time.perf_counter() - start) / reps)
    return statistics.median(samples)


def _rule_of(symbol: str, rule_of: Mapping[str, str]) -> str:
    if symbol.startswith(("tvmattn_attention", "tvmattn_paged")):
        return "attention"
    return rule_of.get(symbol, VM)


def _work_of(symbol: str, call_args: tuple, work: Mapping) -> tuple[float, float]:
    tensors = [a for a in call_args if isinstance(a, tvm.runtime.Tensor)]
    nbytes = float(sum(np.prod(t.shape, dtype=np.float64) * t.dtype.itemsize for t in tensors))
    w = work.get(symbol)
    return (w.flops([tuple(t.shape) for t in tensors]) if w else 0.0), nbytes
