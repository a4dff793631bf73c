"""tvmattn: multi-head attention kernels generated with Apache TVM, checked against a NumPy oracle.

    spec = tvmattn.AttentionSpec(batch=1, seq_len=1024, d_model=768, num_heads=12, causal=True)
    kernel = tvmattn.compile(spec, "cpu")       # or "cuda"
    out = kernel(x, w_q, w_k, w_v, w_o)         # NumPy in, NumPy out

    model = tvmattn.import_onnx("model.onnx")   # an ONNX model, its attention on tvmattn kernels
    outs = model.run({"x": x}); print(model.report)
"""

import os as _os

# Absolute imports: pytest imports this file on its own when the checkout's folder name is not a
# Python identifier (a CI clone such as ``repo-1``), and relative imports fail there.

# TVM's CPU runtime starts with one thread unless told otherwise, and reads this once, at first use.
_os.environ.setdefault("TVM_NUM_THREADS", str(len(_os.sched_getaffinity(0)) if hasattr(_os, "sched_getaffinity")
                                              else (_os.cpu_count() or 1)))

# TVM pins worker i of each calling thread's pool to core i: pools of concurrent callers (threads
# serving one model) would stack on the same cores, and a pinned worker cannot leave a core that other
# work (torch's, ONNX Runtime's, another process's) is busy on.
_os.environ.setdefault("TVM_BIND_THREADS", "0")
# TVM's workers yield this many times after a parallel region before they sleep (~160 µs here: a
# `sched_yield` takes 0.16 µs), longer than the gaps between one run's kernels and than `run`'s own
# Python between two runs, so those find them awake; a yielding worker gives its core to any other
# thread that wants it. TVM's default, 300000, spins for tens of milliseconds; 20 (3 µs) left them
# asleep at most kernels' starts, and a wake-up takes tens of µs.
_os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "1000")

from tvmattn.compiler.build import compile_attention as compile  # noqa: E402,A004 (the public name)
from tvmattn.compiler.errors import TvmAttnError  # noqa: E402
from tvmattn.compiler.kernel import CompiledAttention  # noqa: E402
from tvmattn.compiler.onnx.importer import ImportedModel, import_onnx  # noqa: E402
from tvmattn.compiler.oracle import paged_reference, reference  # noqa: E402
from tvmattn.compiler.paged import CompiledPaged, PagedSpec  # noqa: E402
from tvmattn.compiler.spec import AttentionSpec  # noqa: E402

__all__ = ["AttentionSpec", "CompiledAttention", "CompiledPaged", "ImportedModel", "PagedSpec", "TvmAttnError",
           "compile", "import_onnx", "paged_reference", "reference"]
