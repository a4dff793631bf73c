"""How the zoo's models are built and exported (`models/zoo.py` is the catalogue): a Hugging Face model
from a config with seeded random weights, wrapped to take its inputs positionally and return plain
tensors, then written by one of three exporters as their users run them:

- ``torchscript``: ``torch.onnx.export(..., dynamo=False)``, opset 17, ``dynamic_axes`` named;
- ``dynamo``: ``torch.onnx.export(..., dynamo=True)`` at its default opset, ``Dim``\\s named;
- ``ort-<source>``: ONNX Runtime's transformer optimizer (``optimize_model``) over the ``<source>``
  export: its fused com.microsoft ops (Attention, SkipLayerNormalization, FastGelu, …).

The exported inputs' dynamic sizes are named ``batch`` and ``seq`` (``past`` for a decode step's cache,
``dseq`` for an encoder-decoder's decoder tokens), which is what `zoo.ZooModel.feed` fills in.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import warnings
from typing import Any, Callable

import onnx

LAYERS = 2
VOCAB = 4096  # real vocabularies (30k–250k) would make the LM head most of a 2-layer model's time
MAX_POSITIONS = 1024
DECODE_EXPORT_PAST = 16  # the cache length the decode step is traced at (symbolic in the export)



def wrap(model: Any, names: tuple[str, ...], output: str, call: dict[str, Any]) -> Any:
    """``model`` taking ``names`` positionally and returning its ``output`` attribute alone (the logits
    or last hidden state): exporting the model itself adds stray inputs and cache outputs."""
    import torch

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args):
            return getattr(self.model(**dict(zip(names, args)), **call), output)

    return Wrapper().eval()


def hf(auto: str, config: str, make_config: Callable[..., dict[str, Any]], width: int, heads: int,
       part: str | None = None) -> Any:
    """``transformers.<auto>.from_config(<config>(**make_config(width, heads)))`` with eager attention
    (the decomposed MatMul/Softmax chain exporters write), seeded, in eval mode; ``part``: a submodule
    (Whisper's encoder)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config)(**make_config(width, heads))
    cfg._attn_implementation = "eager"
    model = getattr(transformers, auto).from_config(cfg).eval()
    return (getattr(model, part)() if part else model).eval()


def torchscript(module: Any, args: tuple, names: list[str], axes: dict[str, dict[int, str]]) -> onnx.ModelProto:
    import torch

    buffer = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buffer, dynamo=False, input_names=names, output_names=_outputs(module, args),
                          dynamic_axes=axes, opset_version=17)
    return onnx.load_model_from_string(buffer.getvalue())


def dynamo(module: Any, args: tuple, names: list[str], axes: dict[str, dict[int, str]]) -> onnx.ModelProto:
    """The dynamo export with the same named dynamic sizes (a ``Dim`` per name, shared across inputs)."""
    import torch

    dims: dict[str, Any] = {}
    for per_input in axes.values():
        for name in per_input.values():
            dims.setdefault(name, torch.export.Dim(name, min=2, max=MAX_POSITIONS * 4))
    # one entry for forward's *args: a tuple of each input's {axis: Dim}
    shapes = tuple({axis: dims[name] for axis, name in axes.get(n, {}).items()} or None for n in names)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, input_names=names,
                                    output_names=_outputs(module, args), dynamic_shapes=(shapes,), verbose=False)
    return program.model_proto


def _outputs(module: Any, args: tuple) -> list[str]:
    import torch

    with torch.no_grad():
        out = module(*args)
    return ["out"] if isinstance(out, torch.Tensor) else [f"out_{i}" for i in range(len(out))]


def ort_optimized(source: onnx.ModelProto, model_type: str, width: int, heads: int) -> onnx.ModelProto:
    """ONNX Runtime's transformer optimizer over ``source`` (opt_level 0: its fusions only, as its
    `optimize_model` users run it before handing the model to another runtime)."""
    from onnxruntime.transformers import optimizer

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = os.path.join(tmp, "model.onnx")
        onnx.save(source, path)
        logging.disable(logging.WARNING)  # its fusion statistics go to the root logger
        try:
            optimized = optimizer.optimize_model(path, model_type=model_type, num_heads=heads, hidden_size=width,
                                                 opt_level=0)
        finally:
            logging.disable(logging.NOTSET)
        optimized.save_model_to_file(path)  # saving adds the com.microsoft opset import
        return onnx.load(path)
