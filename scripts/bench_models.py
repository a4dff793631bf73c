"""The README's end-to-end table: Hugging Face models (random weights, `export_hf.py`) imported once
with symbolic batch and sequence, then `tvmattn bench model.onnx`'s measurement at each shape.

    python scripts/bench_models.py [--layers 2] [--families gpt2,bert,llama] [--budget 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")  # before TVM's thread pool starts
sys.path.insert(0, str(Path(__file__).resolve().parent))

import export_hf  # noqa: E402
import onnx  # noqa: E402

from tvmattn.compiler.onnx.bench import CLASSES, bench_model  # noqa: E402
from tvmattn.compiler.onnx.check import random_feed  # noqa: E402
from tvmattn.compiler.onnx.importer import import_onnx  # noqa: E402

SHAPES = [(1, 128), (1, 1024), (4, 256)]
LONGEST = {"bert": 512}  # BERT's position table: a longer input is invalid (ONNX Runtime rejects it)
DECODE_PAST = 512


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--families", default="gpt2,bert,llama")
    p.add_argument("--budget", type=float, default=2.0, help="seconds of timed runs per implementation and shape")
    args = p.parse_args()
    print("| model | shape | tvmattn ms | ONNX Runtime ms | × ORT | import s | "
          + " | ".join(CLASSES) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(CLASSES))
    for family in args.families.split(","):
        graphs = [(f"{family}", None)] + ([(f"{family} decode", DECODE_PAST)] if family != "bert" else [])
        for name, past in graphs:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "model.onnx")
                onnx.save(export_hf.export(family, args.layers, past), path)
                model = onnx.load(path)
                imported = import_onnx(model, "cpu")
                shapes = [None] if past else [(b, min(n, LONGEST.get(family, n))) for b, n in SHAPES]
                for shape in shapes:
                    sizes = {} if shape is None else {"batch": shape[0], "seq": shape[1]}
                    r = bench_model(model, imported, random_feed(imported.inputs, sizes), args.budget, name)
                    where = f"1 token, {past} cached" if shape is None else f"B={shape[0]} n={shape[1]}"
                    share = " | ".join(f"{100 * r.by_class.get(c, 0) / sum(r.by_class.values()):.0f} %"
                                       for c in CLASSES)
                    print(f"| {name} ({args.layers} layers) | {where} | {r.tvmattn_ms:.2f} | {r.ort_ms:.2f} | "
                          f"{r.ort_ms / r.tvmattn_ms:.2f} | {imported.report.seconds:.1f} | {share} |", flush=True)


if __name__ == "__main__":
    main()
