"""One GEMM shape on tvmattn's matmul rule against what else this machine has for it, in one process,
interleaved: NumPy's sgemm (OpenBLAS), PyTorch's matmul (oneDNN/MKL, if installed), a register-tiled
C kernel written by hand (gcc, GCC vector types, OpenMP; a few tile shapes, with and without
streaming stores) and a kernel that only writes the output (the store bound). It answers whether a
GEMM below the FMA peak is below what the machine gives that shape, as the README's convolution
paragraph asks of Wav2Vec2's first convolution (a reduction of 10).

    python scripts/gemm_bound.py [--rows 12798] [--k 10] [--n 512] [--rounds 15]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import te, tirx  # noqa: E402

from tvmattn.compiler import build  # noqa: E402
from tvmattn.compiler.annotations import CONSTANT_PARAMS  # noqa: E402
from tvmattn.compiler.bench import interleaved  # noqa: E402
from tvmattn.compiler.kernel import host_tensor  # noqa: E402
from tvmattn.compiler.passes import polynomial_math  # noqa: E402
from tvmattn.compiler.peak import peak_gflops  # noqa: E402
from tvmattn.compiler.target import cpu_cores, resolve_target  # noqa: E402
from tvmattn.schedules.ops import RULES  # noqa: E402
from tvmattn.schedules.ops.matmul import pack  # noqa: E402

C_SOURCE = r"""
#include <immintrin.h>
typedef float v16 __attribute__((vector_size(64), aligned(4)));
static inline void stream(float *p, v16 v) {  /* a streaming store: around the caches */
#ifdef __AVX512F__
  _mm512_stream_ps(p, (__m512)v);
#else
  union { v16 v; __m256 h[2]; } u = {v}; _mm256_stream_ps(p, u.h[0]); _mm256_stream_ps(p + 8, u.h[1]);
#endif
}
#define TILE(R, V, NT) \
void tile_##R##x##V##_##NT(const float *x, const float *w, float *y, long m, long k, long n) { \
  _Pragma("omp parallel for schedule(static)") \
  for (long r0 = 0; r0 < m; r0 += R) \
    for (long c0 = 0; c0 + 16 * V <= n; c0 += 16 * V) { \
      v16 acc[R][V] = {0}; \
      for (long c = 0; c < k; c++) \
        for (int i = 0; i < R; i++) { \
          float a = x[(r0 + i < m ? r0 + i : m - 1) * k + c]; \
          for (int j = 0; j < V; j++) acc[i][j] += a * *(const v16 *)(w + c * n + c0 + 16 * j); \
        } \
      for (int i = 0; i < R && r0 + i < m; i++) \
        for (int j = 0; j < V; j++) { \
          if (NT) stream(y + (r0 + i) * n + c0 + 16 * j, acc[i][j]); \
          else *(v16 *)(y + (r0 + i) * n + c0 + 16 * j) = acc[i][j]; \
        } \
    } \
}
TILE(4, 4, 0) TILE(8, 2, 0) TILE(6, 4, 0) TILE(1, 16, 0) TILE(8, 2, 1)
void store_only(const float *x, const float *w, float *y, long m, long k, long n) {
  _Pragma("omp parallel for schedule(static)")
  for (long r = 0; r < m; r++) for (long c = 0; c < n; c += 16) *(v16 *)(y + r * n + c) = (v16){0} + 1.0f;
}
"""
C_KERNELS = ("tile_4x4_0", "tile_8x2_0", "tile_6x4_0", "tile_1x16_0", "tile_8x2_1", "store_only")


def tvm_gemm(rows: int, k: int, n: int, x: np.ndarray, w: np.ndarray):
    """The matmul rule's kernel with the rows symbolic (as an import has them), default knobs."""
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    s = tirx.Var("s", "int64")
    xs = te.placeholder((s, i64(k)), "float32", name="x")
    ws = te.placeholder((i64(k), i64(n)), "float32", name="w")
    c = te.reduce_axis((i64(0), i64(k)), name="c")
    y = te.compute((s, i64(n)), lambda i, j: te.sum(xs[i, c] * ws[c, j], axis=c), name="matmul")
    func = te.create_prim_func([xs, ws, y]).with_attr(CONSTANT_PARAMS, [1])
    rule = dict(RULES)["matmul"]
    target = resolve_target("cpu")
    mod = tvm.transform.Sequential([*rule.passes, polynomial_math()])(rule.apply(func, target, False).mod)
    fn = tvm.compile(mod, target, tir_pipeline=build.CPU_PIPELINE)["main"]
    shape = [int(d) for d in mod["main"].params[1].ty.shape]
    args = [host_tensor(x), host_tensor(np.ascontiguousarray(pack(w, shape) if shape != [k, n] else w)),
            host_tensor(np.zeros((rows, n), "float32"))]
    fn(*args)
    np.testing.assert_allclose(args[2].numpy(), x @ w, rtol=1e-4, atol=1e-4)
    return lambda: fn(*args)


def c_kernels(x: np.ndarray, w: np.ndarray, y: np.ndarray) -> dict:
    if shutil.which("gcc") is None:
        print("no gcc: the hand-written kernels are left out")
        return {}
    if w.shape[1] % 16 or y.ctypes.data % 64:
        print("the hand-written kernels take whole 64-byte rows (n a multiple of 16): left out")
        return {}
    d = tempfile.mkdtemp()
    src, lib = os.path.join(d, "k.c"), os.path.join(d, "k.so")
    with open(src, "w") as f:
        f.write(C_SOURCE)
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", src, "-o", lib], check=True)
    so = ctypes.CDLL(lib)
    ptr = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    m, k, n = x.shape[0], x.shape[1], w.shape[1]
    out = {}
    for name in C_KERNELS:
        fn = getattr(so, name)
        out[f"C {name}"] = lambda fn=fn: fn(ptr(x), ptr(w), ptr(y), *map(ctypes.c_long, (m, k, n)))
    out["C tile_8x2_0"]()
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-4)
    return out


def _aligned(shape: tuple[int, int]) -> np.ndarray:
    """Zeros at a 64-byte boundary: a streaming store of a whole vector needs one."""
    raw = np.zeros(shape[0] * shape[1] + 16, "float32")
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip:skip + shape[0] * shape[1]].reshape(shape)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2 * 6399, help="Wav2Vec2's first conv: 2 × 6399 frames")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(cpu_cores()))
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # idle OpenMP threads must not spin against TVM's
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.rows, a.k)).astype("float32")
    w = rng.standard_normal((a.k, a.n)).astype("float32")
    y = _aligned((a.rows, a.n))
    peak, how = peak_gflops("float32")
    kernels = {"tvmattn matmul rule": tvm_gemm(a.rows, a.k, a.n, x, w), "NumPy sgemm": lambda: np.matmul(x, w, out=y)}
    try:
        import torch

        tx, tw, ty = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(y)
        kernels["torch matmul"] = lambda: torch.matmul(tx, tw, out=ty)
    except ImportError:
        pass
    kernels.update(c_kernels(x, w, y))
    # a pause before each turn: the previous library's idle workers stop spinning on the two cores
    times = interleaved(kernels, budget_s=a.rounds * 0.05, rounds=a.rounds, pause_s=0.05)
    flops = 2.0 * a.rows * a.k * a.n
    print(f"{a.rows} x {a.k} x {a.n}: peak {peak:.0f} GFLOP/s ({how}); output {4 * a.rows * a.n / 1e6:.1f} MB; "
          f"{a.rounds} interleaved rounds, median (best) call")
    for name, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        share = lambda t: 100 * flops / t / 1e9 / peak  # noqa: E731
        rate = "" if name == "C store_only" else (
            f"{flops / med / 1e9:6.1f} GFLOP/s {share(med):5.1f} % ({share(best):5.1f} %)")
        print(f"  {name:22s} {med * 1e3:7.3f} ms {rate}  {4 * a.rows * a.n / med / 1e9:6.1f} GB/s written")


if __name__ == "__main__":
    main()
