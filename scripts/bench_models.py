"""The README's end-to-end table: Hugging Face models (random weights, `export_hf.py`) imported once
with symbolic batch and sequence, then `tvmattn bench model.onnx`'s measurement at each shape; with
``--tune N``, the model is tuned too (`tvmattn tune model.onnx --trials N`, at batch 1 × 128 tokens,
records in a scratch folder) and imported again from its records.

    python scripts/bench_models.py [--layers 2] [--families gpt2,bert,llama] [--budget 2] [--tune 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")  # before TVM's thread pool starts
sys.path.insert(0, str(Path(__file__).resolve().parent))

import export_hf  # noqa: E402
import onnx  # noqa: E402

from tvmattn.compiler.onnx.bench import CLASSES, bench_model  # noqa: E402
from tvmattn.compiler.onnx.check import random_feed  # noqa: E402
from tvmattn.compiler.onnx.importer import import_onnx  # noqa: E402
from tvmattn.compiler.tuning.model import tune_model  # noqa: E402

SHAPES = [(1, 128), (1, 1024), (4, 256)]
LONGEST = {"bert": 512}  # BERT's position table: a longer input is invalid (ONNX Runtime rejects it)
DECODE_PAST = 512


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--families", default="gpt2,bert,llama")
    p.add_argument("--budget", type=float, default=2.0, help="seconds of timed runs per implementation and shape")
    p.add_argument("--tune", type=int, metavar="TRIALS", help="also tune each model and bench it from its records")
    args = p.parse_args()
    tuned = " | tuned ms | tuned × ORT | tuning s" if args.tune else ""
    print(f"| model | shape | tvmattn ms | ONNX Runtime ms | × ORT{tuned} | import s | " + " | ".join(CLASSES) + " |")
    print("|---|---|---|---|---|" + "---|" * (3 if args.tune else 0) + "---|" + "---|" * len(CLASSES))
    for family in args.families.split(","):
        graphs = [(f"{family}", None)] + ([(f"{family} decode", DECODE_PAST)] if family != "bert" else [])
        for name, past in graphs:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "model.onnx")
                onnx.save(export_hf.export(family, args.layers, decode=past is not None), path)
                model = onnx.load(path)
                imported = import_onnx(model, "cpu")
                shapes = [None] if past else [(b, min(n, LONGEST.get(family, n))) for b, n in SHAPES]
                sizes = [{"past": past} if s is None else {"batch": s[0], "seq": s[1]} for s in shapes]
                feeds = [random_feed(imported.inputs, at) for at in sizes]
                plain = [bench_model(model, imported, feed, args.budget, name) for feed in feeds]
                if args.tune:
                    start = time.perf_counter()
                    tune_model(model, trials=args.tune, log_dir=tmp, progress=False)
                    seconds = time.perf_counter() - start
                    os.environ["TVMATTN_TUNING_LOGS"] = tmp
                    from_records = import_onnx(model, "cpu")
                    del os.environ["TVMATTN_TUNING_LOGS"]
                    tuned_runs = [bench_model(model, from_records, feed, args.budget, name) for feed in feeds]
                for i, (shape, r) in enumerate(zip(shapes, plain)):
                    where = f"1 token, {past} cached" if shape is None else f"B={shape[0]} n={shape[1]}"
                    total = sum(r.by_class.values())
                    share = " | ".join(f"{100 * r.by_class.get(c, 0) / total:.0f} %" for c in CLASSES)
                    extra = ""
                    if args.tune:
                        t = tuned_runs[i]
                        extra = f" | {t.tvmattn_ms:.2f} | {t.ort_ms / t.tvmattn_ms:.2f} | {seconds:.0f}"
                    print(f"| {name} ({args.layers} layers) | {where} | {r.tvmattn_ms:.2f} | {r.ort_ms:.2f} | "
                          f"{r.ort_ms / r.tvmattn_ms:.2f}{extra} | {imported.report.seconds:.1f} | {share} |",
                          flush=True)

if __name__ == "__main__":
    main()
