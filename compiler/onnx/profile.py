"""Where an imported model's time goes, function by function: `profile(model, feed)`, printed by
`tvmattn bench model.onnx --profile` (what ONNX Runtime's profiler and OpenVINO's
``benchmark_app -pc`` show their users).

Every call the Relax VM makes is timed (`VirtualMachine.set_instrument`): the compiled functions,
each with the schedule rule that took it (``attention`` for tvmattn's kernels) and its rate, and the
VM's own builtins (allocation, shape checks) under ``vm``. A function's FLOPs are counted from its
TIR: two per multiply-add of each reduction block whose body multiplies (a GEMM, a convolution; the
attention kernels: `explain.useful_flops`); its bytes are those of its arguments, each read or
written once (a lower bound of its traffic: GB/s for the memory-bound functions).
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
    overhead_ms: float = 0.0
    by_rule: dict[str, float] = field(default_factory=dict)

    def table(self, top: int = 25) -> str:
        total = sum(f.ms for f in self.functions) or 1.0
        lines = [f"a run: {self.run_ms:.3f} ms; its calls add up to {total:.3f} ms (each less the time its "
                 f"timing adds, {1e3 * self.overhead_ms:.1f} µs; the rest is the VM's own)"
                 + (f"; peak {self.peak_gflops:.0f} GFLOP/s" if self.peak_gflops else ""),
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
    """Time every call of ``imported`` (a CPU `ImportedModel`) on ``feed``: the median of ``runs``
    instrumented runs per function, and of as many plain runs for the whole."""
    vm = relax.VirtualMachine(imported.executable, tvm.cpu())
    args = [host_tensor(a) for a in imported._arguments(feed)]
    work = imported.report.work
    calls: dict[str, list[list[float]]] = defaultdict(list)  # function → per run, each call's seconds
    sizes: dict[str, list[tuple[float, float]]] = defaultdict(list)
    started: list[float] = []
    run_calls: dict[str, list[float]] = defaultdict(list)
    run_sizes: dict[str, list[tuple[float, float]]] = defaultdict(list)

    def instrument(_func, symbol, before, _ret, *call_args):
        if before:
            started.append(time.perf_counter())
            return 0
        run_calls[symbol].append(time.perf_counter() - started.pop())
        if len(run_calls[symbol]) > len(run_sizes[symbol]):
            run_sizes[symbol].append(_work_of(symbol, call_args, work))
        return 0

    vm["main"](*args)  # warm
    plain = []
    for _ in range(runs):
        start = time.perf_counter()
        vm["main"](*args)
        plain.append(time.perf_counter() - start)
    vm.set_instrument(instrument)
    for _ in range(runs):
        run_calls.clear()
        run_sizes.clear()
        vm["main"](*args)
        for symbol, times in run_calls.items():
            calls[symbol].append(times)
            sizes[symbol] = run_sizes[symbol]
    # what timing a call adds to it (Python entered around it): the fastest call's time, a builtin
    # that returns at once
    overhead = min(min(t) for per_run in calls.values() for t in per_run if t)
    out = []
    for symbol, per_run in calls.items():
        ms = statistics.median(sum(max(0.0, x - overhead) for x in t) for t in per_run) * 1e3
        flops = sum(f for f, _ in sizes[symbol])
        nbytes = sum(b for _, b in sizes[symbol])
        out.append(FunctionTime(symbol, _rule_of(symbol, imported.report.rule_of), len(per_run[0]), ms, flops, nbytes))
    out.sort(key=lambda f: -f.ms)
    by_rule: dict[str, float] = defaultdict(float)
    for f in out:
        by_rule[f.rule] += f.ms
    return Profile(out, statistics.median(plain) * 1e3, peak_gflops, overhead * 1e3,
                   dict(sorted(by_rule.items(), key=lambda kv: -kv[1])))


def _rule_of(symbol: str, rule_of: Mapping[str, str]) -> str:
    if symbol.startswith("tvmattn_attention"):
        return "attention"
    return rule_of.get(symbol, VM)


def _work_of(symbol: str, call_args: tuple, work: Mapping) -> tuple[float, float]:
    tensors = [a for a in call_args if isinstance(a, tvm.runtime.Tensor)]
    nbytes = float(sum(np.prod(t.shape, dtype=np.float64) * t.dtype.itemsize for t in tensors))
    w = work.get(symbol)
    return (w.flops([tuple(t.shape) for t in tensors]) if w else 0.0), nbytes
