"""What the NumPy and PyTorch calling paths cost over the kernel itself, and the drop-in function
against torch's own SDPA, measured in one process (a call and the bare kernel in alternating rounds,
best round of each: the difference is a few µs beside run-to-run noise of tens).

    python scripts/bench_torch.py [--budget 1.0]

Rows per (B, h, n, d, causal):
  numpy     kernel(q, k, v, out=out) on NumPy's own arrays vs kernel.run on resident TVM tensors
            (the issue's ≤ 5 %, ≤ 20 µs)
  torch     tvmattn.torch.scaled_dot_product_attention vs its cached kernel's run on the same tensors
            (the dispatch), vs `tvmattn bench`'s own kernel (batch static too), vs F.scaled_dot_product_attention
"""

from __future__ import annotations

import argparse
import time

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tvmattn  # noqa: E402
import tvmattn.torch as tt  # noqa: E402
from tvmattn.compiler import bench  # noqa: F401  TVM's pool: no spin (torch's OpenMP keeps its default)
from tvmattn.compiler.kernel import host_tensor  # noqa: E402
from tvmattn.compiler.target import cpu_cores  # noqa: E402
from tvmattn.compiler.verify import random_inputs  # noqa: E402
from tvmattn.torch.cache import cpu_thread_pool  # noqa: E402
from tvmattn.torch.plan import empty_output, kernel_inputs, plan  # noqa: E402

SHAPES = [(1, 8, 128, 64), (1, 8, 512, 64), (4, 12, 512, 64), (1, 16, 2048, 64)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of repeats per measurement")
    args = parser.parse_args()
    torch.set_num_threads(cpu_cores())
    print(f"threads: TVM {cpu_cores()}, torch {torch.get_num_threads()}")
    print(f"{'shape':<24}{'path':<8}{'call ms':>9}{'kernel ms':>11}{'over':>8}{'µs':>8}"
          f"{'static ms':>11}{'sdpa ms':>9}{'sdpa/ours':>11}")
    for b, h, n, d in SHAPES:
        for causal in (False, True):
            label = f"({b},{h},{n},{d}){' causal' if causal else ''}"
            numpy_row(label, tvmattn.AttentionSpec(batch=b, seq_len=n, num_heads=h, head_dim=d, causal=causal,
                                                   projections=False), args.budget)
            torch_row(label, b, h, n, d, causal, args.budget)


def paired(call, run, budget: float) -> tuple[float, float]:
    """Seconds per call of ``call`` and of ``run``: the best of alternating rounds of a few calls each."""
    call(), run()
    per_round = max(1, int(0.01 / max(_once(run), 1e-7)))  # ~10 ms rounds
    best = {call: float("inf"), run: float("inf")}
    start = time.perf_counter()
    while time.perf_counter() - start < budget:
        for fn in (call, run):
            t0 = time.perf_counter()
            for _ in range(per_round):
                fn()
            best[fn] = min(best[fn], (time.perf_counter() - t0) / per_round)
    return best[call], best[run]


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def numpy_row(label: str, spec: tvmattn.AttentionSpec, budget: float) -> None:
    """Arrays from NumPy's allocator (16-byte aligned), which cross without a copy."""
    kernel = tvmattn.compile(spec)
    arrays = list(random_inputs(spec).values())
    out = kernel(*arrays)
    resident = [host_tensor(a) for a in (*arrays, out)]
    call, run = paired(lambda: kernel(*arrays, out=out), lambda: kernel.run(*resident), budget)
    print(f"{label:<24}{'numpy':<8}{call * 1e3:9.3f}{run * 1e3:11.3f}{call / run - 1:8.1%}"
          f"{(call - run) * 1e6:8.1f}")


def torch_row(label: str, b: int, h: int, n: int, d: int, causal: bool, budget: float) -> None:
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    # `tvmattn bench`'s kernel (static shapes), on the same threads as the torch path's
    static = tvmattn.compile(tvmattn.AttentionSpec(batch=b, seq_len=n, num_heads=h, head_dim=d, causal=causal,
                                                   projections=False), thread_pool=cpu_thread_pool())
    with torch.inference_mode():
        p = plan(q, k, v, None, causal, None, False)
        key = p.key
        kernel = tt.KERNELS.get(key)
        out, _ = empty_output(p, q)
        inputs = kernel_inputs(p, q, k, v, None)
        tt.scaled_dot_product_attention(q, k, v, is_causal=causal)  # compiled, warm
        call, run = paired(lambda: tt.scaled_dot_product_attention(q, k, v, is_causal=causal),
                           lambda: kernel.run(*inputs, out), budget)
        static_run, _ = paired(lambda: static.run(*inputs, out), lambda: kernel.run(*inputs, out), budget)
        sdpa, _ = paired(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                         lambda: kernel.run(*inputs, out), budget)
    print(f"{label:<24}{'torch':<8}{call * 1e3:9.3f}{run * 1e3:11.3f}{call / run - 1:8.1%}{(call - run) * 1e6:8.1f}"
          f"{static_run * 1e3:11.3f}{sdpa * 1e3:9.3f}{sdpa / call:10.2f}×")


if __name__ == "__main__":
    main()
