"""tvmattn: multi-head attention kernels generated with Apache TVM, checked against a NumPy oracle."""

import os as _os

# TVM's CPU runtime starts with one thread unless told otherwise, and reads this only once.
_os.environ.setdefault("TVM_NUM_THREADS", str(len(_os.sched_getaffinity(0)) if hasattr(_os, "sched_getaffinity")
                                              else (_os.cpu_count() or 1)))

from .compiler.errors import TvmAttnError  # noqa: E402
from .compiler.spec import AttentionSpec  # noqa: E402

__all__ = ["AttentionSpec", "TvmAttnError"]
