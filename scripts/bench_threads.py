"""Throughput of one imported model run from 1 and 2 threads, and the GIL while it runs.

    python scripts/bench_threads.py [--family gpt2] [--layers 2] [--rounds 5]

The model (a Hugging Face export, `export_hf.py`) is imported once; each round then runs the same
number of calls three ways, interleaved: one thread; two threads at once (each run on a VM of its
own over the shared executable, as `ImportedModel.run` does); two threads behind one lock (the
serialising design). Prints runs per second of each (median over rounds) as ratios to one thread,
at a prefill shape and a decode step, and how fast a pure-Python counter thread runs beside two
model threads against alone (a call that held the GIL would stop it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import export_hf  # noqa: E402
import onnx  # noqa: E402

from tvmattn.compiler.onnx.compare import random_feed  # noqa: E402
from tvmattn.compiler.onnx.importer import import_onnx  # noqa: E402


def throughput(run, calls: int, threads: int) -> float:
    """Runs per second of ``calls`` runs split over ``threads`` threads."""
    def work(n: int) -> None:
        for _ in range(n):
            run()

    workers = [threading.Thread(target=work, args=(calls // threads,)) for _ in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return calls / (time.perf_counter() - start)


def counter_rate(seconds: float, busy=None) -> float:
    """Steps per second of a Python loop, alone or while ``busy()`` runs on two other threads."""
    stop = threading.Event()
    workers = [threading.Thread(target=lambda: [busy() for _ in iter(stop.is_set, True)]) for _ in range(2)] \
        if busy else []
    for w in workers:
        w.start()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        steps += 1
    stop.set()
    for w in workers:
        w.join()
    return steps / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="gpt2")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    decoder = args.family != "bert"  # (an encoder has no decode step)
    for decode, at in ((False, {"batch": 1, "seq": 128}), (True, {"past": 256}))[:2 if decoder else 1]:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.onnx")
            onnx.save(export_hf.export(args.family, args.layers, decode=decode), path)
            model = import_onnx(onnx.load(path))
        feed = random_feed(model.inputs, at)
        lock = threading.Lock()

        def locked() -> None:
            with lock:
                model.run(feed)

        start = time.perf_counter()
        for _ in range(3):
            model.run(feed)
        calls = max(8, int(2.0 / ((time.perf_counter() - start) / 3)) // 2 * 2)  # ~2 s a way
        ways = {"1 thread": (lambda: model.run(feed), 1), "2 threads": (lambda: model.run(feed), 2),
                "2 threads, one lock": (locked, 2)}
        rates: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(args.rounds):
            for way, (run, threads) in ways.items():
                rates[way].append(throughput(run, calls, threads))
                time.sleep(0.05)
        one = statistics.median(rates["1 thread"])
        print(f"{args.family} ({args.layers} layers) {'decode, 256 cached' if decode else 'B=1 n=128'}: "
              + ", ".join(f"{w} {statistics.median(r) / one:.2f}×" for w, r in rates.items())
              + f" (1 thread: {one:.1f} runs/s)", flush=True)
    alone = counter_rate(2.0)
    beside = counter_rate(2.0, lambda: model.run(feed))
    print(f"a Python thread beside two threads running {'the decode step' if decoder else 'the model'}: "
          f"{beside / alone:.2f}× its speed alone")


if __name__ == "__main__":
    main()
