"""The one error type users see: a message that says what is wrong and how to fix it."""

from __future__ import annotations

import re


class TvmAttnError(ValueError):
    """Bad input to tvmattn (a spec, a target, a model, a tuning log).

    The CLI prints the message as one line and exits with status 2; library callers catch it like
    any ValueError.
    """


# What TVM puts around the sentence that matters: its check macros, printed IR, object reprs.
_CHECK = re.compile(r"^.*?Check failed: \(.*?\) is false:\s*")
_REPR = re.compile(r"\b(?:ir|relax|tirx|s_tir)\.\w+\(span=.*")
# A Relax op's inference error: "In ir.Op(…name="relax.multiply"…support_level=10), the first input shape …"
_OP_SENTENCE = re.compile(r'In ir\.Op\(.*?name="relax\.([\w.]+)".*?support_level=\d+\),\s*(.+)')
_UNLOWERED = re.compile(r"CodeGenVM cannot emit this Relax operator.*?Offending call:\s*R\.(\w+)", re.S)
_NOISE = ("#", "File ", "Traceback", "Stack trace", "During handling", "The above exception", "^")


def first_line(err: BaseException) -> str:
    """An exception's first line (a checker's or parser's own sentence), or its type's name."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# Internal messages whose meaning for the model is known.
_MEANINGS = (("object has no attribute 'value'", "a size it needs as a number is symbolic in the model: give the "
              "model's inputs static shapes"),
             ("'PrimType' object has no attribute", "an input of it is a size the model computes from its dynamic "
              "sizes (shape arithmetic), which TVM's converter takes only as a tensor"),
             ("Dynamic pads are not supported", "its pads are computed from the model's dynamic sizes, and TVM's "
              "Pad takes them as numbers: give the model's inputs static shapes (import_onnx(..., shapes={input: "
              "sizes}), --shape)"),
             ("integer modulo by zero", "a size or a head count is 0"),
             ("division by zero", "a size or a head count is 0"))


def tvm_reason(err: BaseException) -> str:
    """A TVM exception as one readable line: what it means where that is known, else the last line that
    is not a traceback, printed IR or an object's repr, with TVM's ``Check failed: (…) is false:``
    prefix removed."""
    meaning = next((m for text, m in _MEANINGS if text in str(err)), None)
    if meaning is not None:
        return meaning
    left = _UNLOWERED.search(str(err))
    if left is not None:  # Relax could not infer the op's output shape, so nothing legalised it
        return (f"TVM could not infer the shape of a {left.group(1)} from the model's symbolic sizes: "
                f"import it with static shapes (import_onnx(..., shapes={{input: sizes}}), --shape)")
    inference = _OP_SENTENCE.search(str(err))
    if inference is not None:  # the op's repr would leave nothing of the line
        return f"{inference.group(1)}: " + re.sub(r"T\.int64\((-?\d+)\)", r"\1", inference.group(2)).strip()[:300]
    lines = [line.strip() for line in str(err).splitlines()]
    lines = [line for line in lines if line and not line.startswith(_NOISE) and not line.startswith(("R.", "T."))]
    for line in reversed(lines):
        text = _REPR.sub("", _CHECK.sub("", line)).strip(" :")
        text = re.sub(r"^(?:TVMError|InternalError|ValueError|TypeError|AssertionError|RuntimeError):\s*", "", text)
        if len(text) > 3:
            return text[:300]
    return type(err).__name__
