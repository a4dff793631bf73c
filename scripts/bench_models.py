"""The README's end-to-end table: every model of the zoo (`models/zoo.py`: 41 exports of 37
transformer families by three exporters, random weights, 2 layers) imported once with symbolic shapes
(with ``--static``, once per shape with its sizes bound, as OpenVINO compiles it), checked against ONNX
Runtime, and timed against ONNX Runtime and OpenVINO (at the matmuls' precision, compiled at each shape;
for a symbolic import also compiled from the model's dynamic sizes) at each shape (`tvmattn bench
model.onnx`'s measurement: one process, interleaved rounds, every core).

    python scripts/bench_models.py [--models gpt2,encoder,…] [--budget 2] [--shapes all|first|2x128,…]
                                   [--json out.json] [--tune 16] [--dtype bf16] [--static]

One markdown row per model and shape, then geometric means of the speed-ups (peer time ÷ tvmattn's,
above 1: tvmattn is faster), overall and per kind. A model that fails to export, import or run gets a
row saying so and the run goes on. ``--tune N`` also tunes each model's GEMMs (`tvmattn tune
model.onnx --trials N` at its first shape, records in a scratch folder) and benches it from them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from tvmattn.compiler.errors import first_line  # noqa: E402
from tvmattn.compiler.onnx.bench import CLASSES, OV_PRECISION, bench_model, openvino_run  # noqa: E402
from tvmattn.compiler.onnx.compare import compare_with_ort  # noqa: E402
from tvmattn.compiler.onnx.importer import ImportedModel, import_onnx  # noqa: E402
from tvmattn.compiler.target import cpu_cores  # noqa: E402
from tvmattn.compiler.tuning.model import tune_model  # noqa: E402
from tvmattn.compiler.verify import errors  # noqa: E402
from tvmattn.models import zoo  # noqa: E402

FLAG = {None: 1e-3, "bf16": 5e-2, "bfloat16": 5e-2, "fp16": 1e-2, "float16": 1e-2}  # error flagged above, per dtype
FIXED_SIZE = (zoo.VISION, zoo.AUDIO)  # kinds whose n is the model's own (image side, audio length)
HEADER = ["model", "family", "exporter", "shape", "tvmattn ms", "ORT ms", "× ORT", "OpenVINO ms", "× OV",
          "OV dynamic ms", "× OV dynamic", "error", "import s", "softmax on kernels", *CLASSES]


@dataclass
class Row:
    model: str
    family: str
    exporter: str
    kind: str
    width: int
    shape: str
    batch: int
    n: int
    tvmattn_ms: float | None = None
    ort_ms: float | None = None
    ov_ms: float | None = None
    ov_dynamic_ms: float | None = None  # OpenVINO from the model's dynamic sizes: a symbolic import's peer
    error: float | None = None  # max over the outputs of the error relative to ONNX Runtime's scale
    import_s: float | None = None
    export_s: float | None = None  # None: read from the cache
    on_kernels: str = ""  # "softmaxes on tvmattn kernels / softmaxes"
    by_class: dict[str, float] = field(default_factory=dict)
    ort_note: str = ""
    ov_note: str = ""
    ov_dynamic_note: str = ""
    failure: str = ""  # what failed (export, import, run), with the error's first line
    tuned_ms: float | None = None
    fp32_ms: float | None = None  # the fp32 import, where the row runs in 16 bits (``--dtype``)
    dtype: str | None = None
    greedy: float | None = None  # a decoder in 16 bits: the share of positions whose argmax token is fp32's
    ov_greedy: float | None = None  # the same share for OpenVINO at that inference precision
    ov_error: float | None = None  # OpenVINO's error at that precision relative to our fp32 output's scale

    def speedup(self, peer_ms: float | None, ours: float | None = None) -> float | None:
        ours = ours or self.tvmattn_ms
        return peer_ms / ours if peer_ms and ours else None

    def markdown(self, tuned: bool) -> str:
        cells = [self.model, self.family, self.exporter, self.shape]
        if self.failure:
            return "| " + " | ".join(cells + [f"**{self.failure}**"] + [""] * (len(HEADER) - 5 + 2 * tuned)) + " |"
        error = "—" if self.error is None else f"{self.error:.1e}" + (" ⚠" if self.error > FLAG[self.dtype] else "")
        total = sum(self.by_class.values()) or 1.0
        cells += [_num(self.tvmattn_ms), _num(self.ort_ms), _num(self.speedup(self.ort_ms)), _num(self.ov_ms),
                  _num(self.speedup(self.ov_ms)), _num(self.ov_dynamic_ms), _num(self.speedup(self.ov_dynamic_ms)),
                  error, _num(self.import_s, 1), self.on_kernels]
        cells += [f"{100 * self.by_class.get(c, 0) / total:.0f} %" for c in CLASSES]
        if self.fp32_ms is not None:
            cells += [_num(self.fp32_ms), _num(self.speedup(self.fp32_ms))]
            cells += ["—" if g is None else f"{100 * g:.1f} %" for g in (self.greedy, self.ov_greedy)]
            cells += ["—" if self.ov_error is None else f"{self.ov_error:.1e}"]
        if tuned:
            cells += [_num(self.tuned_ms), _num(self.speedup(self.ort_ms, self.tuned_ms))]
        return "| " + " | ".join(cells) + " |"


def _num(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def shapes_of(m: zoo.ZooModel, choice: str) -> tuple[tuple[int, int], ...]:
    """``all`` the model's shapes, its ``first`` (smallest), or given (batch, n) pairs ("2x128,1x512"),
    which apply to models whose n is free (tokens, cached keys); images and audio keep their own."""
    if choice == "all":
        return m.shapes
    if choice == "first":
        return m.shapes[:1]
    if m.kind in FIXED_SIZE:
        return m.shapes
    return tuple(tuple(int(x) for x in s.split("x")) for s in choice.split(","))


def bench_one(m: zoo.ZooModel, shapes: tuple[tuple[int, int], ...], budget: float, tune: int | None,
              dtype: str | None = None, static: bool = False) -> list[Row]:
    """The model's rows at ``shapes``: imported once with symbolic shapes, or with ``static`` once per
    shape with its inputs' sizes bound (``import_onnx(shapes=…)``), as OpenVINO compiles it."""
    rows = [Row(m.name, m.family, m.exporter, m.kind, m.width, m.describe(s), *s, dtype=dtype) for s in shapes]

    def fail(stage: str, err: Exception, which: list[Row] = rows) -> list[Row]:
        for r in which:
            r.failure = f"{stage} fails: {first_line(err)[:160]}"
        return rows

    start, cached = time.perf_counter(), m.path.exists()
    try:
        proto = m.export()
    except Exception as err:  # the exporter's own failure
        return fail("export", err)
    export_s = None if cached else time.perf_counter() - start

    def imports(feed: dict | None) -> tuple[ImportedModel, ImportedModel | None]:
        sizes = None if feed is None else {name: value.shape for name, value in feed.items()}
        # a decode step's KV cache in the same 16 bits: what the step streams (`onnx.cache16`)
        ours = import_onnx(proto, "cpu", dtype=dtype, cache_dtype=dtype if m.kind == zoo.DECODE else None,
                           shapes=sizes)
        return ours, import_onnx(proto, "cpu", shapes=sizes) if dtype else None

    if not static:
        try:
            imported, baseline = imports(None)
        except Exception as err:
            return fail("import", err)
    for r in rows:
        feed = m.feed((r.batch, r.n))
        if static:
            try:
                imported, baseline = imports(feed)
            except Exception as err:
                fail("import", err, [r])
                continue
        report = imported.report
        r.export_s, r.import_s = export_s, report.seconds
        r.on_kernels = f"{report.softmaxes_on_kernels}/{len(report.softmaxes)}"
        try:
            imported.run(imported.declared(feed))
        except Exception as err:
            fail("run", err, [r])
            continue
        try:
            checks = compare_with_ort(proto, imported, feed, {"batch": r.batch, "n": r.n})
            r.error = max(c.max_rel for c in checks)
        except Exception:  # ONNX Runtime cannot run it: its note in the timing says why
            pass
        if baseline is not None and m.kind in (zoo.PREFILL, zoo.DECODE):
            reference = baseline.run(feed)[0]
            r.greedy = float((imported.run(imported.declared(feed))[0].argmax(-1) == reference.argmax(-1)).mean())
            r.ov_greedy, r.ov_error = _openvino_greedy(proto, feed, imported.report.dtype, reference)
        b = bench_model(proto, imported, feed, budget, m.name, baseline)
        r.tvmattn_ms, r.ort_ms, r.ov_ms, r.by_class = b.tvmattn_ms, b.ort_ms, b.ov_ms, b.by_class
        r.fp32_ms = b.baseline_ms
        r.ort_note, r.ov_note = b.ort_note, b.ov_note
        r.ov_dynamic_ms, r.ov_dynamic_note = b.ov_dynamic_ms, b.ov_dynamic_note
    if tune:
        _tuned(m, proto, rows, budget, tune)
    return rows


def _openvino_greedy(proto, feed: dict, dtype: str, reference: np.ndarray) -> tuple[float | None, float | None]:
    """OpenVINO at ``dtype`` inference precision against ``reference`` (our fp32 import's logits): the
    share of its argmax tokens equal to the reference's, and its error (NaN where it output NaN) —
    what the precision itself costs, for comparison with ours."""
    try:
        run, _ = openvino_run(proto, feed, OV_PRECISION[dtype])
        logits = np.asarray(run()[0], dtype=np.float32)
    except Exception:  # OpenVINO absent or failing on this model: its timing's note says which
        return None, None
    return float((logits.argmax(-1) == reference.argmax(-1)).mean()), errors(logits, reference)[1]


def _tuned(m: zoo.ZooModel, proto, rows: list[Row], budget: float, trials: int) -> None:
    """Each row's tvmattn time after tuning the model's GEMMs at its first shape."""
    with tempfile.TemporaryDirectory() as logs:
        first = rows[0]
        tune_model(proto, trials=trials, log_dir=logs, progress=False,
                   at={"batch": first.batch, "seq": first.n, "dseq": first.n, "past": first.n})
        os.environ["TVMATTN_TUNING_LOGS"] = logs
        try:
            from_records: ImportedModel = import_onnx(proto, "cpu")
        finally:
            del os.environ["TVMATTN_TUNING_LOGS"]
        for r in rows:
            if not r.failure:
                r.tuned_ms = bench_model(proto, from_records, m.feed((r.batch, r.n)), budget, m.name).tvmattn_ms


def geomeans(rows: list[Row]) -> dict[str, dict[str, float | int | None]]:
    """Kind (and "all") → rows and the geometric means of × ORT and × OV over the rows that have each."""
    out = {}
    for kind in ("all", *zoo.KINDS):
        chosen = [r for r in rows if kind in ("all", r.kind) and not r.failure]
        if chosen:
            out[kind] = {"rows": len(chosen), "x_ort": _geomean([r.speedup(r.ort_ms) for r in chosen]),
                         "x_ov": _geomean([r.speedup(r.ov_ms) for r in chosen]),
                         "x_ov_dynamic": _geomean([r.speedup(r.ov_dynamic_ms) for r in chosen]),
                         "x_fp32": _geomean([r.speedup(r.fp32_ms) for r in chosen])}
    return out


def _geomean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", help="comma-separated zoo names, families or kinds (default: all)")
    p.add_argument("--budget", type=float, default=2.0, help="seconds of timed runs per implementation and shape")
    p.add_argument("--shapes", default="all", help="all, first, or (batch)x(n) pairs: 2x128,1x512")
    p.add_argument("--json", help="write every row's numbers to this JSON file")
    p.add_argument("--tune", type=int, metavar="TRIALS", help="also tune each model and bench it from its records")
    p.add_argument("--dtype", help="bf16 | fp16: import each model with its matmuls in that precision (OpenVINO "
                   "at the same precision; tvmattn's fp32 import in the same rounds)")
    p.add_argument("--static", action="store_true", help="import each model once per shape with its inputs' sizes "
                   "bound, as OpenVINO compiles it (default: once, symbolic shapes serving every shape)")
    args = p.parse_args()
    models = zoo.select(args.models)
    extra = ((["tvmattn fp32 ms", "× fp32", "greedy = fp32", "OV greedy = fp32", "OV error vs fp32"] if args.dtype
              else [])
             + (["tuned ms", "tuned × ORT"] if args.tune else []))
    print("| " + " | ".join(HEADER + extra) + " |")
    print("|" + "---|" * (len(HEADER) + len(extra)), flush=True)
    rows: list[Row] = []
    for m in models:
        for r in bench_one(m, shapes_of(m, args.shapes), args.budget, args.tune, args.dtype, args.static):
            print(r.markdown(bool(args.tune)), flush=True)
            rows.append(r)
    means = geomeans(rows)
    print("\n| kinds | rows | × ORT (geomean) | × OV (geomean) | × OV dynamic (geomean) | × our fp32 (geomean) |\n"
          "|---|---|---|---|---|---|")
    for kind, g in means.items():
        print(f"| {kind} | {g['rows']} | {_num(g['x_ort'])} | {_num(g['x_ov'])} | {_num(g['x_ov_dynamic'])} "
              f"| {_num(g['x_fp32'])} |")
    print()
    peers = [(r, name, ms, note) for r in rows if not r.failure
             for name, ms, note in (("ONNX Runtime", r.ort_ms, r.ort_note), ("OpenVINO", r.ov_ms, r.ov_note),
                                    ("OpenVINO (dynamic)", r.ov_dynamic_ms, r.ov_dynamic_note)) if note]
    for note in sorted({note for _, _, ms, note in peers if ms}):  # each peer's version and settings
        print(f"- {note}")
    for r, name, _, note in (p for p in peers if not p[2]):  # a peer that did not run a row, and why
        print(f"- {r.model} at {r.shape}: {name} {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": cpu_cores(), "rows": [asdict(r) for r in rows], "geomeans": means}, f, indent=1)


if __name__ == "__main__":
    main()
