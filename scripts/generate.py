"""Greedy decoding of an imported GPT-2 with its KV cache, checked against ONNX Runtime.

A small GPT-2 (random weights from a config) is exported twice as a generation loop runs it: the
prefill (prompt → logits, present keys/values) and the "with past" decode step (one token and the
cache → logits, the cache one longer). Both are imported with tvmattn (every attention on a tvmattn
kernel, the decode step on the one-query kernel) and run step by step next to ONNX Runtime on the same
exported graphs; the tokens must be equal (else exit 1).

    python scripts/generate.py                          # TorchScript export, 8-token prompt, 6 new tokens
    python scripts/generate.py --exporter dynamo --tokens 10

Each graph is imported once with its lengths symbolic (the prompt's, the cache's): one compiled decode
step serves every cache length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort

import tvmattn
from tvmattn.compiler import bench  # noqa: F401  first: it tells the thread pools not to spin
from tvmattn.models import hf_decoders as hd


def ort_session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


class Runner:
    """One runtime's prefill and decode step: ``prefill(ids)`` and ``step(token, cache)`` return
    (logits, cache)."""

    def __init__(self, name: str, prefill, decode, cache_names: list[str]) -> None:
        self.name, self._prefill, self._decode, self.cache_names = name, prefill, decode, cache_names
        self.seconds: list[float] = []  # each decode step's run time (best of 3, warm)

    def prefill(self, ids: np.ndarray):
        logits, *cache = self._prefill({"input_ids": ids})
        return logits, cache

    def step(self, token: np.ndarray, cache: list[np.ndarray]):
        feed = {"input_ids": token, **dict(zip(self.cache_names, cache))}
        logits, *cache = self._decode(feed)  # the first run of a model also makes its VM: not timed
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            self._decode(feed)
            runs.append(time.perf_counter() - start)
        self.seconds.append(min(runs))
        return logits, cache


def tvmattn_runner(prefill_model, decode_model, cache_names: list[str]):
    pre, dec = tvmattn.import_onnx(prefill_model), tvmattn.import_onnx(decode_model)
    report = dec.report
    assert report.softmaxes and all(f.kernel for f in report.softmaxes), str(report)
    spec = report.replacements[0].spec
    assert spec.seq_len == 1 and spec.causal_align == "bottom_right", spec.describe()
    return Runner("tvmattn", pre.run, dec.run, cache_names), pre, dec


def greedy(runner: Runner, ids: np.ndarray, tokens: int) -> tuple[list[int], list[np.ndarray]]:
    logits, cache = runner.prefill(ids)
    out, all_logits = [], [logits[:, -1]]
    for _ in range(tokens):
        token = all_logits[-1].argmax(-1).reshape(1, 1).astype(np.int64)
        out.append(int(token[0, 0]))
        logits, cache = runner.step(token, cache)
        all_logits.append(logits[:, -1])
    return out, all_logits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript")
    parser.add_argument("--prompt", type=int, default=8, help="prompt length")
    parser.add_argument("--tokens", type=int, default=6, help="new tokens")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)

    model = hd.decoder("gpt2", layers=args.layers, hidden=args.hidden, heads=max(1, args.hidden // 16))
    prefill_model = hd.export(model, args.exporter, past=False)
    decode_model = hd.export(model, args.exporter, past=True)
    cache_names = hd.names(model, True)[0][1:]
    ids = np.random.default_rng(0).integers(0, hd.VOCAB, (1, args.prompt)).astype(np.int64)

    pre_ort, dec_ort = ort_session(prefill_model), ort_session(decode_model)
    reference = Runner("onnxruntime", lambda f: pre_ort.run(None, f), lambda f: dec_ort.run(None, f), cache_names)
    ours, pre, dec = tvmattn_runner(prefill_model, decode_model, cache_names)

    want, want_logits = greedy(reference, ids, args.tokens)
    got, got_logits = greedy(ours, ids, args.tokens)
    error = max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) for a, b in zip(got_logits, want_logits))
    print(pre.report)
    print(f"GPT-2 ({args.layers} layers, d={args.hidden}), {args.exporter} export, prompt {args.prompt}, "
          f"{args.tokens} greedy tokens")
    print(f"  onnxruntime: {want}")
    print(f"  tvmattn:     {got}  ({'equal' if got == want else 'DIFFERENT'}; logits max relative error "
          f"{error:.2g})")
    ms = [statistics.median(r.seconds) * 1e3 for r in (ours, reference)]
    print(f"  time per token (decode step, warm, median over steps): tvmattn {ms[0]:.3f} ms, "
          f"onnxruntime {ms[1]:.3f} ms; import and compile: prefill {pre.report.seconds:.2f} s, "
          f"decode step {dec.report.seconds:.2f} s")
    return 0 if got == want and error <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
