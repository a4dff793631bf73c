"""Helpers for the ONNX tests: ONNX Runtime as the reference, and the report as the proof of replacement."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

import tvmattn
from tvmattn.compiler.verify import errors


def ort_run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})


def kernels_used(imported: tvmattn.ImportedModel) -> int:
    """Attentions the model runs as tvmattn kernels (not counting kernels that only return weights)."""
    return sum(getattr(r.spec, "output", "attn") == "attn" for r in imported.report.replacements)


def assert_matches_ort(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], attentions: int,
                       tolerance: float = 1e-4, softmaxes: int | None = None) -> tvmattn.ImportedModel:
    """Import ``model``; every one of its ``attentions`` must be a tvmattn kernel, none left to TVM,
    and every output must match ONNX Runtime's (error relative to the output's scale). ``softmaxes``:
    how many Softmax nodes the report must list, every one on a kernel."""
    imported = tvmattn.import_onnx(model)
    assert kernels_used(imported) == attentions, str(imported.report)
    assert not imported.report.left_to_tvm, str(imported.report)
    if softmaxes is not None:
        fates = imported.report.softmaxes
        assert len(fates) == softmaxes and all(f.kernel for f in fates), str(imported.report)
    for feed in feeds:
        for got, want in zip(imported.run(feed), ort_run(model, feed)):
            _, error = errors(got, want)
            assert error <= tolerance, f"error {error:.3g} at {[(k, v.shape) for k, v in feed.items()]}"
    return imported


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)
