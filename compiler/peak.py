"""This machine's arithmetic peak for a precision, measured: what `tvmattn bench`'s %peak divides by.

A BLAS GEMM is no ceiling on every CPU: on Zen 5, whose FMAs are a full 512 bits wide, NumPy's
sgemm and torch's fp32 matmul reach 235–265 GFLOP/s on 2 cores where our fp32 attention runs at 470
(180% "of peak"). So the peak is also measured by a loop TVM builds here, a task per core, of
independent chains (`ACCUMULATORS`) of the instruction the kernels' inner loops use, on full vectors
in registers:

    fp32, fp16   acc = fma(acc, one, STEP)                   2 FLOPs a lane   (fp16: fp32's, as QKᵀ's sums are)
    bf16         acc = vdpbf16ps(acc, half pairs, half pairs)  4 FLOPs a lane   (AVX512-BF16; else fp32's FMAs)

with half = 2⁻¹⁰ (a product is STEP). The peak is the fastest of that loop and the GEMMs
(`peak_gflops`). Each chain ends at exactly STEPS · DEPTH · STEP (bf16: twice that, two products a
lane; every partial sum a multiple of STEP of at most 2, exact in fp32): every instruction ran
(`PeakLoop.out`).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T

from tvmattn.compiler.bench import measure
from tvmattn.compiler.target import cpu_cores, isa_of, resolve_target, vector_lanes

# Chains in flight: at least latency × pipes (vdpbf16ps on Zen 5: 12 chains ran at 0.84× the rate of 24), in the
# registers with the 2 operands (AVX-512: 32; AVX2: 16, and FMAs of latency 4 on 2 pipes need 8).
ACCUMULATORS = {16: 24, 8: 12}
STEPS = 1 << 17  # loop iterations per call: about 2 ms, so the thread pool's start (~20 µs) is under 1 %
DEPTH = 8  # instructions a chain runs per iteration (TVM writes the accumulator back each iteration,
#            and a store per FMA would bound the loop at the store rate)
STEP = 2.0**-20  # what an FMA adds to its chain, and each product of a bf16 dot
BF16_HALF_STEP = 0x3A80  # bf16 bits of 2⁻¹⁰: the product of two is STEP
GEMM_N = 1024  # the square GEMM also measured: large enough for a BLAS to reach its rate


@dataclass
class PeakLoop:
    """The peak loop built for a target: call ``run``; ``out`` then holds every chain's value."""
    module: tvm.runtime.Module
    args: list  # a, b, out: (cores, chains, lanes)
    flops: int  # one call's
    instruction: str  # in words

    def run(self) -> None:
        self.module["main"](*self.args)

    @property
    def out(self) -> np.ndarray:
        return self.args[-1].numpy()


def peak_loop(target: tvm.target.Target, dtype: str, tasks: int) -> PeakLoop:
    """The peak loop of ``dtype`` for ``target``, ``tasks`` in parallel: bf16 dot products where the
    target has them and ``dtype`` is bfloat16, else fp32 FMAs."""
    dot = isa_of(target).dot if dtype == "bfloat16" else None
    dots = dot is not None
    lanes = vector_lanes(target)
    chains = ACCUMULATORS.get(lanes, 8)
    vec = f"float32x{lanes}"
    operand = "int32" if dots else "float32"  # (an int32 lane: a pair of bf16 values)

    def step(acc, x, y):  # DEPTH instructions, each on the one before (bf16: acc + x·y; fp32: acc·y + x = acc + STEP)
        for _ in range(DEPTH):
            acc = T.call_extern(vec, dot.function, acc, x, y) if dots else T.call_intrin(vec, "tirx.fma", acc, y, x)
        return acc

    @T.prim_func
    def main(a: T.Buffer((lanes,), operand), b: T.Buffer((lanes,), operand),
             out: T.Buffer((tasks, chains, lanes), "float32")):
        for task in T.parallel(tasks):
            acc = T.alloc_local((chains, lanes), "float32")
            for i in T.unroll(chains):
                acc[i, T.Ramp(0, 1, lanes)] = T.Broadcast(T.float32(0), lanes)
            for _ in range(STEPS):
                for i in T.unroll(chains):
                    acc[i, T.Ramp(0, 1, lanes)] = step(acc[i, T.Ramp(0, 1, lanes)], a[T.Ramp(0, 1, lanes)],
                                                       b[T.Ramp(0, 1, lanes)])
            for i in T.unroll(chains):
                out[task, i, T.Ramp(0, 1, lanes)] = acc[i, T.Ramp(0, 1, lanes)]

    func = main.with_attr("global_symbol", "main")
    if dots:  # the dot product's LLVM function linked into the module; both operands bf16 pairs of 2⁻¹⁰
        body = tirx.AttrStmt(tvm.ir.StringImm("dot"), "pragma_import_llvm", tvm.ir.StringImm(dot.llvm), func.body)
        func = func.with_body(body)
        a = b = np.full(lanes, BF16_HALF_STEP * 0x10001, np.uint32).view(np.int32)
    else:
        a, b = np.full(lanes, STEP, np.float32), np.ones(lanes, np.float32)
    args = [tvm.runtime.tensor(x) for x in (a, b, np.zeros((tasks, chains, lanes), np.float32))]
    return PeakLoop(tvm.compile(tvm.IRModule({"main": func}), target), args,
                    tasks * STEPS * DEPTH * chains * lanes * (4 if dots else 2),
                    "bf16 dot products" if dots else "fp32 FMAs")


def peak_gflops(dtype: str = "float32") -> tuple[float, str]:
    """The fastest rate (GFLOP/s, all cores) this machine reaches on ``dtype`` values, and what reached
    it: the peak loop (the module docstring), NumPy's sgemm, and for bfloat16 PyTorch's bf16 matmul
    where installed (oneDNN)."""
    loop = peak_loop(resolve_target("cpu"), dtype, cpu_cores())
    candidates = [(loop.flops / measure(loop.run, 0.5) / 1e9, f"a TVM loop of {loop.instruction} in registers")]
    a = np.random.default_rng(0).standard_normal((GEMM_N, GEMM_N)).astype(np.float32)
    candidates.append((2 * GEMM_N**3 / measure(lambda: a @ a, 0.5) / 1e9, f"NumPy sgemm {GEMM_N}³"))
    if dtype == "bfloat16" and find_spec("torch") is not None:
        import torch

        b = torch.from_numpy(a).to(torch.bfloat16)
        candidates.append((2 * GEMM_N**3 / measure(lambda: b @ b, 0.5) / 1e9, f"torch bf16 matmul {GEMM_N}³"))
    return max(candidates)
