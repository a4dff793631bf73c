"""Run an imported model and ONNX Runtime on the same seeded random inputs and compare their outputs.

ONNX Runtime is the reference here (a test extra, imported only when a check runs). The error is
normalised by the output's scale, as in `verify`, with the tolerance of the output's dtype.
"""

from __future__ import annotations

import numpy as np
import onnx

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.kernel import numpy_dtype
from tvmattn.compiler.onnx.importer import GraphInput, ImportedModel
from tvmattn.compiler.verify import TOLERANCE, Check, errors

DEFAULT_SIZE = 4  # the value of a named dimension when none is given


def random_feed(inputs: list[GraphInput], sizes: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: floats ~ N(0, 1); bool all True and integers all 1 (masks that keep every key)."""
    rng = np.random.default_rng(seed)
    feed = {}
    for spec in inputs:
        if any(d is None for d in spec.shape):
            raise TvmAttnError(f"input {spec.name!r} has an unnamed dynamic dimension: name it in the model")
        shape = tuple(d if isinstance(d, int) else sizes.get(d, DEFAULT_SIZE) for d in spec.shape)
        dtype = numpy_dtype(spec.dtype)
        if dtype.kind == "f" or spec.dtype == "bfloat16":
            feed[spec.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feed[spec.name] = np.ones(shape, dtype=dtype)
    return feed


def model_feed(imported: ImportedModel, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feed`` in the dtypes the ONNX model itself takes, as ONNX Runtime and OpenVINO run it: a KV cache the
    import stores in 16 bits (``cache_dtype``) as float32 (`ImportedModel.declared` converts it back)."""
    pasts = {past for past, _ in imported.report.cache}
    return {name: arr.astype(np.float32) if name in pasts else arr for name, arr in feed.items()}


def compare_with_ort(model: onnx.ModelProto, imported: ImportedModel, feed: dict[str, np.ndarray],
                     sizes: dict[str, int]) -> list[Check]:
    """One check per graph output: ``imported`` against ONNX Runtime on ``feed``."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise TvmAttnError("--check needs ONNX Runtime: pip install onnxruntime") from None
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        expected = session.run(None, feed)
    except Exception as err:  # ORT's own errors: the reference cannot run this model
        raise TvmAttnError(f"ONNX Runtime cannot run this model: {str(err).strip().splitlines()[0]}") from None
    checks = []
    for name, ref, out in zip(imported.output_names, expected, imported.run(imported.declared(feed))):
        dtype = str(np.asarray(ref).dtype)
        # integer and bool outputs: exact; float ones at the import's precision where it has one (dtype=bf16)
        tolerance = TOLERANCE.get(imported.report.dtype or dtype, 0.0) if dtype in TOLERANCE else 0.0
        checks.append(Check(f"{name} {dtype}", sizes, *errors(out, ref), tolerance))
    return checks
