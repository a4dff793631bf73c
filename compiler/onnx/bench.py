"""`tvmattn bench model.onnx`: the imported model against ONNX Runtime on the same inputs, in one
process, and where tvmattn's time goes by operator class.

Fairness as in the kernel bench (`tvmattn.compiler.bench`): both use every core, warm up first, run
in interleaved rounds (the median of each is reported), and idle worker threads do not spin. The
classes come from what computes each function: a tvmattn attention kernel, or the schedule rule that
took it (`schedules.ops`): matmul (matmul, gemv), norm (reduction), elementwise (injective), other
(fallback, and the VM's own work: allocation, shapes).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
import tvm
from tvm import relax

from tvmattn.compiler.bench import interleaved
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.onnx.importer import ImportedModel
from tvmattn.compiler.target import cpu_cores

ROUNDS = 20  # turns of a few runs each: the two alternate closely
CLASSES = ("attention", "matmul", "norm", "elementwise", "other")
RULE_CLASS = {"matmul": "matmul", "gemv": "matmul", "dlight-gemv": "matmul", "reduction": "norm",
              "injective": "elementwise"}


@dataclass
class ModelBench:
    model: str
    shapes: str  # the inputs' shapes, e.g. "input_ids 1×128"
    tvmattn_ms: float
    ort_ms: float | None
    ort_note: str = ""
    by_class: dict[str, float] = field(default_factory=dict)  # ms of one run per class (instrumented run)

    def table(self) -> str:
        lines = [f"{self.model} at {self.shapes}: {cpu_cores()} threads"]
        ratio = f"  → tvmattn {self.ort_ms / self.tvmattn_ms:.2f}× ONNX Runtime" if self.ort_ms else ""
        lines.append(f"  tvmattn       {self.tvmattn_ms:9.2f} ms{ratio}")
        lines.append(f"  onnxruntime   {self.ort_ms:9.2f} ms  ({self.ort_note})" if self.ort_ms else
                     f"  onnxruntime   not run: {self.ort_note}")
        total = sum(self.by_class.values()) or 1.0
        lines.append("  tvmattn by operator class (one instrumented run):")
        lines += [f"    {name:<12} {ms:8.2f} ms  {100 * ms / total:5.1f} %" for name, ms in self.by_class.items()]
        return "\n".join(lines)


def bench_model(model: onnx.ModelProto, imported: ImportedModel, feed: dict[str, np.ndarray],
                budget_s: float = 2.0, name: str = "model") -> ModelBench:
    """Time ``imported`` and ONNX Runtime on ``feed`` in interleaved rounds for about ``budget_s`` each."""
    shapes = ", ".join(f"{k} {'×'.join(map(str, v.shape))}" for k, v in feed.items())
    runs = {"tvmattn": lambda: imported.run(feed)}
    ort_note = ""
    try:
        session, ort_note = _ort_session(model)
        runs["onnxruntime"] = lambda: session.run(None, feed)
    except TvmAttnError as err:
        ort_note = str(err)
    times = interleaved(runs, budget_s, rounds=ROUNDS)
    ort_ms = statistics.median(times["onnxruntime"]) * 1e3 if "onnxruntime" in times else None
    return ModelBench(name, shapes, statistics.median(times["tvmattn"]) * 1e3, ort_ms, ort_note,
                      by_class(imported, feed))


def _ort_session(model: onnx.ModelProto):
    try:
        import onnxruntime as ort
    except ImportError:
        raise TvmAttnError("ONNX Runtime is not installed (pip install onnxruntime)") from None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = cpu_cores()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as err:  # ORT's own errors: it cannot run this model
        raise TvmAttnError(f"ONNX Runtime cannot load this model: {str(err).strip().splitlines()[0]}") from None
    return session, f"onnxruntime {ort.__version__}, default graph optimisations"


def by_class(imported: ImportedModel, feed: dict[str, np.ndarray]) -> dict[str, float]:
    """Milliseconds per operator class in one run, timed around every call the VM makes."""
    if imported.target.kind.name != "llvm":
        return {}
    vm = relax.VirtualMachine(imported.executable, tvm.cpu())
    args = [tvm.runtime.tensor(a) for a in imported._arguments(feed)]
    spent: dict[str, float] = defaultdict(float)
    started: list[float] = []

    def instrument(_func, symbol, before, _ret, *_args):
        if before:
            started.append(time.perf_counter())
        else:
            spent[_class_of(symbol, imported.report.rule_of)] += time.perf_counter() - started.pop()
        return 0  # carry on

    vm["main"](*args)  # warm
    vm.set_instrument(instrument)
    vm["main"](*args)
    return {c: spent[c] * 1e3 for c in CLASSES if c in spent}


def _class_of(symbol: str, rule_of: dict[str, str]) -> str:
    if symbol.startswith("tvmattn_attention"):
        return "attention"
    return RULE_CLASS.get(rule_of.get(symbol, ""), "other")
