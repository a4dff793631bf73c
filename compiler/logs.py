"""TVM's C++ log lines routed to Python's `logging`.

TVM writes its warnings straight to the process's stderr (``std::cerr``: no hook to redirect them),
so a model import printed lines like ``[12:00:00] …/op.cc:275: Warning: Detected pow(x, y) where
y >= 3 …`` six times for a 2-layer GPT-2. Inside `tvm_logs_to_logging` the stderr file descriptor
goes to a temporary file; on the way out each TVM line becomes a record of the ``tvmattn.tvm``
logger: DEBUG where it describes code tvmattn generates and then rewrites (`INTERNAL`), WARNING
otherwise (the user may act on it). Anything else written there meanwhile (another thread's output)
goes back to stderr unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
from typing import Iterator

LOG = logging.getLogger("tvmattn.tvm")
_TVM_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] (?P<where>\S+:\d+): (?P<level>[A-Za-z]+): (?P<text>.*)$")
# What TVM says about code it builds for tvmattn, not about the user's model or target
INTERNAL = (
    "Detected pow(x, y) where y >= 3",  # a model's x³ (tanh-GELU): `passes.polynomial_math` multiplies it out
    "Fast mode segfaults when there are out-of-bounds indices",  # the importer checks Gather indices first
)

_lock = threading.Lock()
_depth = 0
_saved_fd: int | None = None
_capture = None


@contextlib.contextmanager
def tvm_logs_to_logging() -> Iterator[None]:
    """Route what TVM logs inside the block to `logging` (nested and concurrent blocks share one capture)."""
    _enter()
    try:
        yield
    finally:
        _leave()


def _enter() -> None:
    global _depth, _saved_fd, _capture
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        try:
            sys.stderr.flush()
            _capture = tempfile.TemporaryFile()
            _saved_fd = os.dup(2)
            os.dup2(_capture.fileno(), 2)
        except (OSError, ValueError):  # no usable fd 2 (a closed stderr): leave it as it is
            _capture, _saved_fd = None, None


def _leave() -> None:
    global _depth, _saved_fd, _capture
    with _lock:
        _depth -= 1
        if _depth > 0 or _saved_fd is None:
            return
        with contextlib.suppress(ValueError, OSError):
            sys.stderr.flush()
        os.dup2(_saved_fd, 2)
        os.close(_saved_fd)
        _capture.seek(0)
        text = _capture.read().decode("utf-8", "replace")
        _capture.close()
        _saved_fd, _capture = None, None
    _forward(text)


def _forward(text: str) -> None:
    other = []
    for line in text.splitlines():
        m = _TVM_LINE.match(line)
        if m is None:
            other.append(line)
            continue
        internal = any(m["text"].startswith(s) for s in INTERNAL)
        level = logging.DEBUG if internal else logging.ERROR if m["level"] in ("Error", "Fatal") else logging.WARNING
        LOG.log(level, "TVM %s (%s): %s", m["level"].lower(), m["where"], m["text"])
    if other:
        os.write(2, ("\n".join(other) + "\n").encode())
