"""Tensor intrinsics registered once per process, on first use.

TVMScript parses an intrinsic's description and implementation when they are built: about a second
per instruction set, which ``import tvmattn`` (and every CLI call, every worker) paid for records it
never used. A record names its intrinsics (`deferred`); a schedule registers one as it tensorizes
(`registered`, from `schedules.primitives.tensorize`). The lock makes the first use safe from threads
that compile at once: a name registered twice is an error in TVM.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

from tvm import tirx
from tvm.s_tir import TensorIntrin

Make = Callable[[], "tuple[tirx.PrimFunc, tirx.PrimFunc]"]  # () -> (description, implementation)

_LOCK = threading.Lock()  # a child's own (`_after_fork_in_child`): another thread may hold it as the parent forks
_DEFERRED: dict[str, Make] = {}


def deferred(name: str, make: Make) -> str:
    """``name``, to be registered from ``make`` when a schedule first uses it (`registered`)."""
    _DEFERRED.setdefault(name, make)
    return name


def registered(name: str, make: Make | None = None) -> str:
    """``name``, registered now if it is not yet: from ``make``, or from what `deferred` recorded (a
    name of neither, TVM's own, is left to TVM)."""
    with _LOCK:
        make = make or _DEFERRED.get(name)
        if make is not None and TensorIntrin.get(name, allow_missing=True) is None:
            TensorIntrin.register(name, *make())
    return name


def _after_fork_in_child() -> None:
    """Not held across the fork as `concurrency`'s locks are: taken inside them, it would deadlock
    against a fork that holds it and waits for theirs."""
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
