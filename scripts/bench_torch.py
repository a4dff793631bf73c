"""What the NumPy and PyTorch calling paths cost over the kernel itself, and the drop-in function
against torch's own SDPA, measured in one process (medians, interleaved per shape).

    python scripts/bench_torch.py [--budget 1.0]

Rows per (B, h, n, d, causal):
  numpy     kernel(q, k, v, out=out) vs kernel.run on resident TVM tensors (the issue's ≤ 5 %, ≤ 20 µs),
  aligned   the same on 64-byte aligned arrays (those cross without a copy; NumPy's own are 16-aligned)
  torch     tvmattn.torch.scaled_dot_product_attention vs its cached kernel's run on the same tensors
            (the dispatch), vs `tvmattn bench`'s own kernel (batch static too), vs F.scaled_dot_product_attention
"""

from __future__ import annotations

import argparse

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tvmattn  # noqa: E402
import tvmattn.torch as tt  # noqa: E402
from tvmattn.compiler import bench  # first: it tells the thread pools not to spin, before they start
from tvmattn.compiler.kernel import aligned_empty, host_tensor  # noqa: E402
from tvmattn.compiler.target import cpu_cores  # noqa: E402
from tvmattn.compiler.verify import random_inputs  # noqa: E402
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


def numpy_row(label: str, spec: tvmattn.AttentionSpec, budget: float) -> None:
    """Arrays from NumPy's allocator (16-byte aligned: copied once per call), and 64-byte aligned ones."""
    kernel = tvmattn.compile(spec)
    plain = list(random_inputs(spec).values())
    aligned = [aligned_empty(a.shape, a.dtype) for a in plain]
    for a, b in zip(aligned, plain):
        a[...] = b
    out = kernel(*aligned)
    resident = [host_tensor(a) for a in (*aligned, out)]
    run = bench.measure(lambda: kernel.run(*resident), budget)
    for name, arrays in (("numpy", plain), ("aligned", aligned)):
        call = bench.measure(lambda arrays=arrays: kernel(*arrays, out=out), budget)
        print(f"{label:<24}{name:<8}{call * 1e3:9.3f}{run * 1e3:11.3f}{call / run - 1:8.1%}"
              f"{(call - run) * 1e6:8.1f}")


def torch_row(label: str, b: int, h: int, n: int, d: int, causal: bool, budget: float) -> None:
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    static = tvmattn.compile(tvmattn.AttentionSpec(batch=b, seq_len=n, num_heads=h, head_dim=d, causal=causal,
                                                   projections=False))
    with torch.inference_mode():
        p = plan(q, k, v, None, causal, None, False)
        key = p.key
        kernel = tt.KERNELS.get(key)
        out, _ = empty_output(p, q)
        inputs = kernel_inputs(p, key, q, k, v, None)
        tt.scaled_dot_product_attention(q, k, v, is_causal=causal)  # compiled, warm
        results = {}
        for name, fn in (("call", lambda: tt.scaled_dot_product_attention(q, k, v, is_causal=causal)),
                         ("kernel", lambda: kernel.run(*inputs, out)),
                         ("static", lambda: static.run(*inputs, out)),
                         ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))):
            results[name] = bench.measure(fn, budget)
    call, run = results["call"], results["kernel"]
    print(f"{label:<24}{'torch':<8}{call * 1e3:9.3f}{run * 1e3:11.3f}{call / run - 1:8.1%}{(call - run) * 1e6:8.1f}"
          f"{results['static'] * 1e3:11.3f}{results['sdpa'] * 1e3:9.3f}{results['sdpa'] / call:10.2f}×")


if __name__ == "__main__":
    main()
