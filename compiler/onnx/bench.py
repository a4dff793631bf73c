"""`tvmattn bench model.onnx`: the imported model against ONNX Runtime and OpenVINO (fp32) on the same
inputs, in one process, and where tvmattn's time goes by operator class.

Fairness as in the kernel bench (`tvmattn.compiler.bench`): every implementation uses every core, warms
up first, and runs in interleaved rounds (the median of each is reported); ONNX Runtime's idle workers
do not spin, TVM's yield for ~160 µs and then sleep (tvmattn's default), and OpenVINO's TBB workers,
which have no such switch, get a short pause before each turn to go idle. OpenVINO compiles the model
reshaped to the inputs' shapes (static: how it runs a shape fastest) at the precision of tvmattn's matmuls
(fp32 unless the import asked for 16 bits; it would pick bf16 on a CPU that has it); where tvmattn's
import kept sizes symbolic, OpenVINO also runs as compiled from the model's own dynamic dimensions, the
same-mode peer (both serve every length). A peer that is not installed or cannot load or run the model is
reported as such, not an error. The classes come from what computes each function: a tvmattn attention
kernel, or the schedule rule that took it (`schedules.ops`): matmul (matmul, gemv), norm (reduction),
elementwise (injective), other (fallback, and the VM's own work: allocation, shapes).
"""

from __future__ import annotations

import functools
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx

from tvmattn.compiler.bench import interleaved
from tvmattn.compiler.errors import first_line
from tvmattn.compiler.onnx.importer import ImportedModel
from tvmattn.compiler.onnx.profile import profile
from tvmattn.compiler.target import cpu_cores

ROUNDS = 20  # turns of a few runs each: the implementations alternate closely
PAUSE_S = 0.01  # before each turn: OpenVINO's TBB workers spin a few ms after a run
CLASSES = ("attention", "matmul", "norm", "elementwise", "other")
RULE_CLASS = {"matmul": "matmul", "experts": "matmul", "matmul-bf16": "matmul", "gemv": "matmul", "gemv-bf16": "matmul",
              "dlight-gemv": "matmul", "matmul-columns": "matmul", "reduction": "norm", "reduce": "norm",
              "injective": "elementwise"}
OV_PRECISION = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # tvmattn's matmuls → OpenVINO's hint
PEER_NAMES = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO", "openvino dynamic": "OpenVINO (dynamic)"}


@dataclass
class ModelBench:
    model: str
    shapes: str  # the inputs' shapes, e.g. "input_ids 1×128"
    tvmattn_ms: float
    ort_ms: float | None
    ort_note: str = ""  # the peer's version and settings, or why it did not run
    by_class: dict[str, float] = field(default_factory=dict)  # ms of one run per class (its profile)
    ov_ms: float | None = None
    ov_note: str = ""
    baseline_ms: float | None = None  # the model imported in fp32, where ``tvmattn`` ran it in 16 bits
    ov_dynamic_ms: float | None = None  # OpenVINO compiled with the model's dynamic sizes (a symbolic import's peer)
    ov_dynamic_note: str = ""

    def ratio(self, peer_ms: float | None) -> float | None:
        """The peer's time over tvmattn's (above 1: tvmattn is faster)."""
        return peer_ms / self.tvmattn_ms if peer_ms else None

    def table(self) -> str:
        lines = [f"{self.model} at {self.shapes}: {cpu_cores()} threads"]
        peers = [("onnxruntime", self.ort_ms, self.ort_note), ("openvino", self.ov_ms, self.ov_note)]
        if self.ov_dynamic_note:
            peers.append(("openvino dynamic", self.ov_dynamic_ms, self.ov_dynamic_note))
        ratios = ", ".join(f"{self.ratio(ms):.2f}× {PEER_NAMES[name]}" for name, ms, _ in peers if ms)
        lines.append(f"  {'tvmattn':<17} {self.tvmattn_ms:9.2f} ms" + (f"  → tvmattn {ratios}" if ratios else ""))
        if self.baseline_ms:
            speedup = self.baseline_ms / self.tvmattn_ms
            lines.append(f"  {'tvmattn fp32':<17} {self.baseline_ms:9.2f} ms  ({speedup:.2f}× in 16 bits)")
        lines += [f"  {name:<17} {ms:9.2f} ms  ({note})" if ms else f"  {name:<17} not run: {note}"
                  for name, ms, note in peers]
        total = sum(self.by_class.values()) or 1.0
        lines.append("  tvmattn by operator class (its profile):")
        lines += [f"    {name:<12} {ms:8.2f} ms  {100 * ms / total:5.1f} %" for name, ms in self.by_class.items()]
        return "\n".join(lines)


def bench_model(model: onnx.ModelProto, imported: ImportedModel, feed: dict[str, np.ndarray],
                budget_s: float = 2.0, name: str = "model", baseline: ImportedModel | None = None) -> ModelBench:
    """Time ``imported``, ONNX Runtime and OpenVINO (at the precision of ``imported``'s matmuls) on
    ``feed`` in interleaved rounds for about ``budget_s`` each; and ``baseline`` (the same model
    imported in fp32) where given. OpenVINO compiles at ``feed``'s shapes, and, where ``imported`` kept a
    size symbolic, from the model's dynamic ones too."""
    shapes = ", ".join(f"{k} {'×'.join(map(str, v.shape))}" for k, v in feed.items())
    ours = imported.declared(feed)  # (a 16-bit KV cache: its arrays converted once, outside the timing)
    runs = {"tvmattn": lambda: imported.run(ours)}
    if baseline is not None:
        runs["tvmattn fp32"] = lambda: baseline.run(feed)
    notes = {}
    precision = OV_PRECISION.get(imported.report.dtype or "float32", "f32")  # OpenVINO's for the same matmuls
    peers = [("onnxruntime", _ort_run), ("openvino", functools.partial(openvino_run, precision=precision))]
    if any(not isinstance(d, int) for i in imported.inputs for d in i.shape):
        peers.append(("openvino dynamic", functools.partial(openvino_run, precision=precision, static=False)))
    for peer, make in peers:
        run, notes[peer] = _try_peer(make, model, feed)
        if run is not None:
            runs[peer] = run
    times = interleaved(runs, budget_s, rounds=ROUNDS, pause_s=PAUSE_S)
    ms = {peer: statistics.median(t) * 1e3 for peer, t in times.items()}
    return ModelBench(name, shapes, ms["tvmattn"], ms.get("onnxruntime"), notes["onnxruntime"],
                      by_class(imported, ours), ms.get("openvino"), notes["openvino"], ms.get("tvmattn fp32"),
                      ms.get("openvino dynamic"), notes.get("openvino dynamic", ""))


def _try_peer(make: Callable, model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> tuple[Callable | None, str]:
    """(a callable running the peer once, its description), or (None, why it cannot run): tried once
    here, so that a peer failing on this model never stops the bench."""
    try:
        run, note = make(model, feed)
        run()
    except ImportError as err:
        return None, f"not installed ({err.name or err})"
    except Exception as err:  # the peer's own errors: it cannot load or run this model
        return None, f"fails on this model: {first_line(err)}"
    return run, note


def _ort_run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> tuple[Callable, str]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = cpu_cores()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return (lambda: session.run(None, feed)), f"onnxruntime {ort.__version__}, default graph optimisations"


def openvino_run(model: onnx.ModelProto, feed: dict[str, np.ndarray], precision: str = "f32",
                 static: bool = True) -> tuple[Callable, str]:
    """OpenVINO on ``model`` at ``precision``, compiled at ``feed``'s shapes (``static``) or from the
    model's own dimensions, dynamic where it leaves them so."""
    import openvino as ov

    core = ov.Core()
    ov_model = core.read_model(model.SerializeToString())
    if static:
        ov_model.reshape({name: list(a.shape) for name, a in feed.items()})
    compiled = core.compile_model(ov_model, "CPU", {"INFERENCE_NUM_THREADS": cpu_cores(), "PERFORMANCE_HINT": "LATENCY",
                                                    "INFERENCE_PRECISION_HINT": precision})
    request = compiled.create_infer_request()
    hint = compiled.get_property("INFERENCE_PRECISION_HINT")  # what the CPU plugin took (f32 without bf16)
    actual = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)
    shapes = "compiled at these shapes" if static else "compiled with the model's dynamic sizes"
    note = f"openvino {ov.__version__.split('-')[0]}, {actual} inference precision, {shapes}"
    return (lambda: request.infer(feed, share_inputs=True)), note


def by_class(imported: ImportedModel, feed: dict[str, np.ndarray]) -> dict[str, float]:
    """Milliseconds per operator class of one run, from the model's profile (`compiler.onnx.profile`)."""
    if imported.target.kind.name != "llvm":
        return {}
    spent: dict[str, float] = defaultdict(float)
    for f in profile(imported, feed, runs=3).functions:
        spent[_class_of(f.name, imported.report.rule_of)] += f.ms
    return {c: spent[c] for c in CLASSES if c in spent}


def _class_of(symbol: str, rule_of: dict[str, str]) -> str:
    if symbol.startswith("tvmattn_attention"):
        return "attention"
    return RULE_CLASS.get(rule_of.get(symbol, ""), "other")
