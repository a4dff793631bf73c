"""schedules.ops, the CPU rules for an imported model's other functions: each rule's functions against
NumPy in float64 (GEMMs with odd and symbolic sizes, packed weights, epilogues; elementwise chains,
transposes), the loops they make (parallel, vectorised), the polynomial maths, and whole ONNX models:
every PrimFunc scheduled on CPU (`ScheduleFunctions`) and on CUDA (dlight, compiled, not run).
"""

from __future__ import annotations

import math
import re
import shutil

import numpy as np
import onnx
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh
from tvm import te, tirx, topi
from tvm.s_tir import Schedule

import tvmattn
from tvmattn.compiler import build
from tvmattn.compiler.cuda import tools as cuda_tools
from tvmattn.compiler.kernel import host_tensor
from tvmattn.compiler.onnx.importer import relax_module
from tvmattn.compiler.passes import polynomial_math
from tvmattn.compiler.target import resolve_target, vector_lanes
from tvmattn.compiler.verify import errors
from tvmattn.models.onnx_models import BUILDERS
from tvmattn.schedules.ops import RULES, ScheduleFunctions, is_scheduled
from tvmattn.schedules.ops.matmul import CONSTANT_PARAMS, Matmul, gemm_operands, pack

CPU = resolve_target("cpu")
MATMUL = Matmul()
TOL = 1e-5  # fp32: |got - want| <= TOL · max(1, |want|) against NumPy in float64


def i64(n: int) -> tirx.IntImm:  # Relax legalises shapes to int64
    return tirx.IntImm("int64", n)


def rows(n: int, symbolic: bool):
    return tirx.Var("m", "int64") if symbolic else i64(n)


def check(args, want: np.ndarray, *inputs: np.ndarray, constants=(), tol: float = TOL) -> tuple[str, tvm.IRModule]:
    """te.create_prim_func(args) (inputs…, output) scheduled as ScheduleFunctions does (the first rule of
    RULES that applies, its passes, polynomial_math), compiled and run on ``inputs`` (the ``constants``
    packed where the rule re-laid them out), against ``want`` (NaN where it is NaN, infinities equal).
    Returns the rule's name and the scheduled module."""
    func = te.create_prim_func(args)
    if constants:
        func = func.with_attr(CONSTANT_PARAMS, list(constants))
    rule, passes, sch = next((name, getattr(r, "passes", ()), sch) for name, r in RULES
                             if (sch := r.apply(func, CPU, False)) is not None)
    mod = tvm.transform.Sequential([*passes, polynomial_math()])(sch.mod)
    params = mod["main"].params
    shapes = [[int(d) for d in p.ty.shape] if all(isinstance(d, tirx.IntImm) for d in p.ty.shape) else None
              for p in params]
    arrays = [pack(x, shapes[i]) if i in constants and shapes[i] != list(x.shape) else x for i, x in enumerate(inputs)]
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a, a.dtype if a.dtype.kind in 'iu' else np.float32))
               for a in arrays]  # (indices stay integers)
    out = tvm.runtime.tensor(np.zeros(want.shape, np.float32))
    tvm.compile(mod, CPU, tir_pipeline=build.CPU_PIPELINE)["main"](*tensors, out)
    got = out.numpy().astype(np.float64)
    with np.errstate(invalid="ignore"):
        ok = (got == want) | (np.abs(got - want) <= tol * np.maximum(1, np.abs(want))) | \
            (np.isnan(got) & np.isnan(want))
    bad = np.argwhere(~ok)
    assert not bad.size, f"{rule}: {len(bad)} of {got.size} wrong, first at {tuple(bad[0])}: " \
        f"{got[tuple(bad[0])]} != {want[tuple(bad[0])]}"
    return rule, mod


def randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- matmul ------------------------------------------------------------------------------------------
def gemm(m, k: int, n: int, batch: tuple = ()):
    """A (…batch, m, k) · B (k, n), the TE that Relax legalises a MatMul to."""
    A = te.placeholder((*map(i64, batch), m, i64(k)), name="A")
    B = te.placeholder((i64(k), i64(n)), name="B")
    r = te.reduce_axis((i64(0), i64(k)), name="k")
    C = te.compute((*A.shape[:-1], i64(n)), lambda *i: te.sum(A[(*i[:-1], r)] * B[r, i[-1]], axis=r), name="matmul")
    return A, B, C


def check_gemm(M: int, K: int, N: int, symbolic: bool, constant: bool, batch: tuple = (), seed: int = 0) -> str:
    """A (…batch, M, K) · B (K, N) by the first rule that takes it (B a constant: packed); that rule."""
    rng = np.random.default_rng(seed)
    a, b = randn(rng, *batch, M, K), randn(rng, K, N, scale=K ** -0.5)
    rule, mod = check(gemm(rows(M, symbolic), K, N, batch), a.astype(np.float64) @ b, a, b,
                      constants=(1,) if constant else ())
    if rule in ("matmul", "gemv"):
        assert len(mod["main"].params[1].ty.shape) == (3 if constant else 2)  # packed: (N / width, K, width)
    return rule


@pytest.mark.parametrize("symbolic, constant", [(False, False), (True, True), (True, False), (False, True)])
@pytest.mark.parametrize("M, K, N", [(1, 64, 48), (7, 96, 200), (65, 256, 1000), (33, 128, 17),
                                     (37, 32, 8200),  # (a wide output, an LM head's: `matmul.WIDE`)
                                     (300, 512, 640)])  # a weight over `L2_WEIGHT`: tasks by column panel
def test_matmul(M, K, N, symbolic, constant):
    one_row = M == 1 and not symbolic  # legalised with the unit row axis dropped: a GEMV
    assert check_gemm(M, K, N, symbolic, constant) == ("gemv" if one_row else "matmul")


@settings(max_examples=8, deadline=None)
@given(st.integers(2, 40), st.integers(1, 160), st.integers(1, 130), st.booleans(), st.booleans())
def test_matmul_sizes(M, K, N, symbolic, constant):
    rule = check_gemm(M, K, N, symbolic, constant)
    assert rule == "matmul" or K == 1 or N == 1  # a unit K or N is an elementwise product or a GEMV


@pytest.mark.parametrize("symbolic, constant", [(False, False), (True, True)])
def test_matmul_batch(symbolic, constant):
    assert check_gemm(13, 64, 72, symbolic, constant, batch=(3,)) == "matmul"  # A (3, 13, 64) · B (64, 72)


def test_batch_matmul_both_batched():
    A, B = te.placeholder((i64(2), i64(9), i64(32)), name="A"), te.placeholder((i64(2), i64(32), i64(40)), name="B")
    r = te.reduce_axis((i64(0), i64(32)), name="k")
    C = te.compute((i64(2), i64(9), i64(40)), lambda b, i, j: te.sum(A[b, i, r] * B[b, r, j], axis=r), name="bmm")
    rng = np.random.default_rng(1)
    a, b = randn(rng, 2, 9, 32), randn(rng, 2, 32, 40)  # (2, 9, 32) · (2, 32, 40)
    assert check([A, B, C], a.astype(np.float64) @ b, a, b)[0] == "matmul"


@pytest.mark.parametrize("n", [1, 37, 130])
def test_batch_matmul_symbolic_reduction(n):
    """P·V of an attention TVM computes itself: (B·h, n, n) · (B·h, n, 64) with n symbolic, the
    reduction too: the GEMM rule's, not the fallback's."""
    m = tirx.Var("n", "int64")
    A, B = te.placeholder((i64(3), m, m), name="A"), te.placeholder((i64(3), m, i64(64)), name="B")
    r = te.reduce_axis((i64(0), m), name="k")
    C = te.compute((i64(3), m, i64(64)), lambda b, i, j: te.sum(A[b, i, r] * B[b, r, j], axis=r), name="bmm")
    rng = np.random.default_rng(2)
    a, b = randn(rng, 3, n, n), randn(rng, 3, n, 64, scale=n ** -0.5)
    assert check([A, B, C], a.astype(np.float64) @ b, a, b)[0] == "matmul"


@pytest.mark.parametrize("M", [1, 33])
def test_padded_columns_accumulate_whole_tiles(M):
    """A packed weight of 17 columns is zero-padded to a 64-column tile that the micro-kernel computes
    whole: its register accumulator must hold the whole tile (it once held 17 columns: a stack overflow)."""
    func = te.create_prim_func(gemm(i64(M), 128, 17)).with_attr(CONSTANT_PARAMS, [1])  # (M, 128) · (128, 17)
    rule, sch = next((name, s) for name, r in RULES if (s := r.apply(func, CPU, False)) is not None)
    mod = tvm.transform.Sequential(list(getattr(dict(RULES)[rule], "passes", ())))(sch.mod)
    width = int(mod["main"].params[1].ty.shape[2])  # (N / width, K, width)
    sizes = [int(x) for x in re.findall(r"T\.alloc_local\(\((\d+),\)", build.lower(mod, CPU).script())]
    assert sizes and min(sizes) % width == 0 and min(sizes) >= width


@pytest.mark.parametrize("symbolic, constant", [(False, False), (True, True)])
def test_matmul_bias_gelu_epilogue(symbolic, constant):
    M, K, N = 19, 96, 80  # gelu(A (19, 96) · B (96, 80) + bias (80)), tanh form
    A, B, C = gemm(rows(M, symbolic), K, N)
    bias = te.placeholder((i64(N),), name="bias")
    h = te.compute(C.shape, lambda i, j: C[i, j] + bias[j], name="add")
    c = math.sqrt(2 / math.pi)
    g = te.compute(C.shape, lambda i, j: 0.5 * h[i, j] * (1 + te.tanh(c * (h[i, j] + 0.044715 * te.power(
        h[i, j], tirx.const(3.0, "float32"))))), name="gelu")
    rng = np.random.default_rng(2)
    a, b, bb = randn(rng, M, K), randn(rng, K, N, scale=K ** -0.5), randn(rng, N)
    x = a.astype(np.float64) @ b + bb
    want = 0.5 * x * (1 + np.tanh(c * (x + 0.044715 * x ** 3)))
    assert check([A, B, bias, g], want, a, b, bb, constants=(1,) if constant else ())[0] == "matmul"


@pytest.mark.parametrize("M", [1, 37, 130])
def test_symbolic_row_tail_writes_only_its_rows(M):
    """(m, 10) · (10, 64) + R (m, 64), m symbolic: rows past m of the last register tile store row m - 1
    again (`clamp_row_tails`), never past the output (a view on a larger array whose other rows are
    NaN) and with the residual of their own row; the tile is an alloca (`stack_tiles`), not a workspace."""
    K, N = 10, 64
    A, B, C = gemm(rows(M, True), K, N)
    R = te.placeholder(C.shape, name="R")
    Y = te.compute(C.shape, lambda i, j: C[i, j] + R[i, j], name="add")
    func = te.create_prim_func([A, B, R, Y]).with_attr(CONSTANT_PARAMS, [1])
    sch = dict(RULES)["matmul"].apply(func, CPU, False)
    mod = tvm.transform.Sequential([*dict(RULES)["matmul"].passes, polynomial_math()])(sch.mod)
    assert "disable_lower_builtin" in build.lower(mod, CPU).script()
    rng = np.random.default_rng(3)
    a, b, r = randn(rng, M, K), randn(rng, K, N), randn(rng, M, N)
    big = np.full((M + 8, N), np.nan, np.float32)
    args = [tvm.runtime.tensor(x) for x in (a, pack(b, [int(d) for d in mod["main"].params[1].ty.shape]), r)]
    tvm.compile(mod, CPU, tir_pipeline=build.CPU_PIPELINE)["main"](*args, host_tensor(big[:M]))
    np.testing.assert_allclose(big[:M], a.astype(np.float64) @ b + r, rtol=1e-5, atol=1e-5)
    assert np.isnan(big[M:]).all()


def test_matmul_rule_rejects_what_is_not_a_gemm():
    x = te.placeholder((i64(8), i64(32)), name="x")
    r = te.reduce_axis((i64(0), i64(32)), name="k")
    row_sum = te.compute((i64(8),), lambda i: te.sum(x[i, r], axis=r), name="row_sum")  # (8, 32) → (8,)
    assert MATMUL.apply(te.create_prim_func([x, row_sum]), CPU, False) is None

    A, B = te.placeholder((i64(8), i64(32)), name="A"), te.placeholder((i64(16), i64(32)), name="B")  # B[n, k]
    r = te.reduce_axis((i64(0), i64(32)), name="k")
    C = te.compute((i64(8), i64(16)), lambda i, j: te.sum(A[i, r] * B[j, r], axis=r), name="matmul_nt")
    func = te.create_prim_func([A, B, C])
    sch = Schedule(func)
    assert gemm_operands(sch.get(sch.get_sblock("matmul_nt"))) is None
    assert MATMUL.apply(func, CPU, False) is None
    func = te.create_prim_func(gemm(i64(8), 32, 16))  # the same with B[k, n]: (c, B, rows)
    sch = Schedule(func)
    c, weight, has_rows = gemm_operands(sch.get(sch.get_sblock("matmul")))
    assert c == 32 and weight.same_as(func.params[1]) and has_rows


# ---- injective ---------------------------------------------------------------------------------------
def bias_tanh(m, n: int):
    x, b = te.placeholder((m, i64(n)), name="x"), te.placeholder((i64(n),), name="b")
    y = te.compute(x.shape, lambda i, j: x[i, j] + b[j], name="add")
    return x, b, te.compute(x.shape, lambda i, j: te.tanh(y[i, j]), name="tanh")


@pytest.mark.parametrize("M, N, symbolic, parallel", [
    (64, 256, False, True),  # tanh(x (64, 256) + b (256)): 16384 elements, parallel rows
    (4, 16, False, False),  # 64 elements: one thread
    (37, 256, True, True),  # symbolic rows
    (5, 30, False, False),  # 30 columns: no whole vectors
])
def test_injective_bias_tanh(M, N, symbolic, parallel):
    rng = np.random.default_rng(3)
    x, b = randn(rng, M, N), randn(rng, N)
    rule, mod = check(bias_tanh(rows(M, symbolic), N), np.tanh(x.astype(np.float64) + b), x, b, tol=1e-6)
    script = mod.script()
    assert rule == "injective"
    assert ("T.parallel" in script) == parallel
    assert ("T.vectorized" in script) == (N % vector_lanes(CPU) == 0)
    assert "T.tanh" not in script


def test_injective_transpose():
    x = te.placeholder((i64(3), i64(5), i64(7)), name="x")  # (3, 5, 7) → (7, 3, 5)
    y = te.compute((i64(7), i64(3), i64(5)), lambda c, a, b: x[a, b, c], name="transpose")
    data = randn(np.random.default_rng(4), 3, 5, 7)
    assert check([x, y], data.transpose(2, 0, 1).astype(np.float64), data, tol=0)[0] == "injective"


def test_injective_transpose_large_is_parallel_and_vectorised():
    x = te.placeholder((i64(128), i64(96)), name="x")  # (128, 96) → (96, 128)
    y = te.compute((i64(96), i64(128)), lambda i, j: x[j, i], name="transpose")
    data = randn(np.random.default_rng(5), 128, 96)
    rule, mod = check([x, y], data.T.astype(np.float64), data, tol=0)
    assert rule == "injective" and "T.parallel" in mod.script() and "T.vectorized" in mod.script()


@pytest.mark.parametrize("n", [5, 16, 37])
def test_injective_symbolic_gather_runs_in_vectors(n):
    """x[b, i, idx[i, j]] over a symbolic n (DeBERTa's c2p positions, read through their broadcast): whole
    vectors of j gathered, the tail's test peeled off them."""
    m = tirx.Var("n", "int64")
    x, idx = te.placeholder((i64(2), m, i64(64)), name="x"), te.placeholder((m, m), "int64", name="idx")
    out = te.compute((i64(2), m, m), lambda b, i, j: x[b, i, idx[i, j]], name="gather")
    rng = np.random.default_rng(6)
    data, where = randn(rng, 2, n, 64), rng.integers(0, 64, (n, n))
    rule, mod = check([x, idx, out], np.take_along_axis(data, np.broadcast_to(where, (2, n, n)), axis=2), data, where,
                      tol=0)
    assert rule == "injective" and "T.vectorized" in mod.script()


@pytest.mark.parametrize("n", [5, 32, 37])
def test_injective_symbolic_transpose_with_a_tail(n):
    """x + yᵀ over (3, n, n), n symbolic (DeBERTa's c2p + p2cᵀ): tiles of lanes × lanes, the tail's
    test peeled off the whole tiles (`passes.peel_key_tails`)."""
    m = tirx.Var("n", "int64")
    x, y = (te.placeholder((i64(3), m, m), name=name) for name in "xy")
    out = te.compute((i64(3), m, m), lambda b, i, j: x[b, i, j] + y[b, j, i], name="add")
    rng = np.random.default_rng(8)
    a, b = randn(rng, 3, n, n), randn(rng, 3, n, n)
    assert check([x, y, out], (a + b.transpose(0, 2, 1)).astype(np.float64), a, b, tol=0)[0] == "injective"


@pytest.mark.parametrize("n", [3, 40])
def test_injective_pad_runs_whole_vectors_between_its_bounds(n):
    """x (n, 3, 40) → (n, 3, 56), zero columns past 40 (`onnx.kernels.attend` pads head widths so), n
    symbolic: vectors whose lanes divide the bound, so that each vector is all x or all zeros. AVX-512's
    16 fp32 lanes would put the bound inside a vector, which TVM runs a lane at a time. In fp32 each side
    of the bound is a loop of its own, where lowering folds the test (left in, with 64-bit indices the
    vectoriser ran MobileViT's pads, a SiLU fused in, a lane at a time: 4.7 GB/s)."""
    m = tirx.Var("n", "int64")
    x = te.placeholder((m, i64(3), i64(40)), name="x")
    y = te.compute((m, i64(3), i64(56)), lambda i, h, j: tirx.if_then_else(j < 40, x[i, h, j], tirx.const(0.0)),
                   name="pad")
    data = randn(np.random.default_rng(9), n, 3, 40)
    assert check([x, y], np.pad(data, ((0, 0), (0, 0), (0, 16))).astype(np.float64), data, tol=0)[0] == "injective"
    avx512 = resolve_target({"kind": "llvm", "mcpu": "znver4"})
    sch = dict(RULES)["injective"].apply(te.create_prim_func([x, y]), avx512, False)
    assert set(re.findall(r"T\.vectorized\(T\.int64\((\d+)\)\)", sch.mod.script())) == {"8"}
    assert len(re.findall(r"_partition\"\)", sch.mod.script())) == 2  # x's 5 vectors, then the 2 of zeros


@pytest.mark.parametrize("n", [3, 40])
def test_injective_rotate_half_over_narrow_heads_runs_in_vectors(n):
    """cat(-x[..., 8:], x[..., :8]) over 16-wide heads, n symbolic (ESM's rotary): 8-lane vectors, each
    all of one half. With a symbolic size's 64-bit indices TVM's simplifier left the halves' test one
    per lane, and the vectoriser ran the loop a lane at a time (masked gathers, 10× slower than at
    static sizes); each half is now a loop of its own, its test folded."""
    m = tirx.Var("n", "int64")
    x = te.placeholder((m, i64(4), i64(16)), name="x")
    y = te.compute((m, i64(4), i64(16)), lambda i, h, j: tirx.if_then_else(8 <= j, x[i, h, j - 8], -x[i, h, j + 8]),
                   name="rotate")
    data = randn(np.random.default_rng(10), n, 4, 16)
    want = np.concatenate([-data[..., 8:], data[..., :8]], axis=-1).astype(np.float64)
    assert check([x, y], want, data, tol=0)[0] == "injective"
    avx512 = resolve_target({"kind": "llvm", "mcpu": "znver4"})
    sch = dict(RULES)["injective"].apply(te.create_prim_func([x, y]), avx512, False)
    ir = tvm.tirx.build(sch.mod, target=avx512).inspect_source("ll")
    assert "<8 x float>" in ir and "masked.gather" not in ir


@pytest.mark.parametrize("n", [1, 1000])
def test_injective_symbolic_length(n):
    x = te.placeholder((tirx.Var("n", "int64"),), name="x")  # x (n,) · 2 + 1
    y = te.compute(x.shape, lambda i: x[i] * 2.0 + 1.0, name="affine")
    data = randn(np.random.default_rng(6), n)
    assert check([x, y], data * 2.0 + 1.0, data, tol=0)[0] == "injective"


@pytest.mark.parametrize("mean, rule", [(False, "reduce"), (True, "reduction")])
def test_row_sum_and_mean(mean, rule):
    """The reduction rule wants an elementwise last block (the mean's division); a bare sum is `reduce`'s."""
    x = te.placeholder((tirx.Var("m", "int64"), i64(100)), name="x")  # (m, 100) → (m,)
    r = te.reduce_axis((i64(0), i64(100)), name="k")
    s = te.compute((x.shape[0],), lambda i: te.sum(x[i, r], axis=r), name="row_sum")
    if mean:
        s = te.compute(s.shape, lambda i: s[i] / 100.0, name="row_mean")
    data = randn(np.random.default_rng(7), 50, 100)
    assert check([x, s], data.astype(np.float64).sum(1) / (100 if mean else 1), data)[0] == rule


def test_min_over_a_stacked_axis():
    """T5's relative position buckets: min over a leading axis of size 2 (a stack), spatial axes after."""
    x = te.placeholder((i64(2), tirx.Var("m", "int64"), i64(37)), name="x")
    r = te.reduce_axis((i64(0), i64(2)), name="k")
    s = te.compute(x.shape[1:], lambda i, j: te.min(x[r, i, j], axis=r), name="stack_min")
    data = randn(np.random.default_rng(8), 2, 9, 37)
    assert check([x, s], data.astype(np.float64).min(0), data, tol=0)[0] == "reduce"


def test_cumsum_keeps_tvms_parallel_scan():
    """cumsum (RoBERTa's and OPT's positions from the attention mask), as TOPI writes it: kept."""
    x = te.placeholder((tirx.Var("b", "int64"), i64(40)), name="x")
    func = te.create_prim_func([x, topi.cumsum(x, axis=1)])
    rule = next(name for name, r in RULES if r.apply(func, CPU, False) is not None)
    assert rule == "scan"


@pytest.mark.parametrize("rows", [(1, 1), (3, 5), "symbolic"])
def test_layer_norm_and_softmax(rows):
    """LayerNorm and softmax over 768 as Relax legalises them (TOPI), one row (a decode step: dlight's
    rule raced there) to symbolic rows; each partial sum (an rfactor's lanes) a vector inside the
    reduction's loop, not lanes outside it (TOPI's LayerNorm had been 3.7× slower so, at 256 × 768), and
    the lanes combined in a vector of `COMBINED` sums (two rfactors a reduction)."""
    shape = (tirx.Var("b", "int64"), i64(7)) if rows == "symbolic" else tuple(map(i64, rows))
    sizes = (2, 7) if rows == "symbolic" else rows
    x = te.placeholder((*shape, i64(768)), name="x")  # (b, n, 768)
    gamma, beta = te.placeholder((i64(768),), name="gamma"), te.placeholder((i64(768),), name="beta")
    rng = np.random.default_rng(3)
    data, g, b = randn(rng, *sizes, 768, scale=3.0), randn(rng, 768), randn(rng, 768)
    d = data.astype(np.float64)
    norm = (d - d.mean(-1, keepdims=True)) / np.sqrt(d.var(-1, keepdims=True) + 1e-5) * g + b
    rule, mod = check([x, gamma, beta, topi.nn.layer_norm(x, gamma, beta, axis=[-1], epsilon=1e-5)], norm,
                      data, g, b, tol=1e-5)
    partial_sums = re.findall(r'(.*)\n\s*with T.sblock\("\w+_rf"\)', mod.script())
    assert rule == "reduction" and len(partial_sums) == 4 and all("T.vectorized" in line for line in partial_sums)
    e = np.exp(d - d.max(-1, keepdims=True))
    assert check([x, topi.nn.softmax(x, axis=-1)], e / e.sum(-1, keepdims=True), data)[0] == "reduction"


def test_norm_epilogue_in_the_block_that_writes_the_row():
    """A LayerNorm's elementwise epilogue (erf-GELU's stages) is inlined into the block that writes the
    row, and the stages before the statistics stay (softmax's exp would be computed twice)."""
    x = te.placeholder((i64(6), i64(256)), name="x")  # (6, 256) → (6, 256)
    gamma, beta = te.placeholder((i64(256),), name="gamma"), te.placeholder((i64(256),), name="beta")
    norm = topi.nn.layer_norm(x, gamma, beta, axis=[-1], epsilon=1e-5)
    half = te.compute(norm.shape, lambda i, j: norm[i, j] * 0.5, name="half")
    y = te.compute(norm.shape, lambda i, j: half[i, j] * (1.0 + te.erf(norm[i, j] * 0.7071067811865476)), name="gelu")
    rng = np.random.default_rng(4)
    data, g, b = randn(rng, 6, 256, scale=3.0), randn(rng, 256), randn(rng, 256)
    d = data.astype(np.float64)
    n = (d - d.mean(-1, keepdims=True)) / np.sqrt(d.var(-1, keepdims=True) + 1e-5) * g + b
    rule, mod = check([x, gamma, beta, y], 0.5 * n * (1 + erf(n / np.sqrt(2))), data, g, b, tol=2e-5)
    blocks = re.findall(r'T.sblock\("(\w+)"\)', mod.script())
    assert rule == "reduction" and blocks[-1] == "gelu" and not {"half", "T_layer_norm"} & set(blocks), blocks
    e = np.exp(d - d.max(-1, keepdims=True))
    _, mod = check([x, topi.nn.softmax(x, axis=-1)], e / e.sum(-1, keepdims=True), data)
    assert any("exp" in b for b in re.findall(r'T.sblock\("(\w+)"\)', mod.script()))


# ---- polynomial maths --------------------------------------------------------------------------------
WIDE = np.concatenate([np.linspace(-30, 30, 6001), np.linspace(-1e-3, 1e-3, 101), [-np.inf, np.inf, np.nan]])
erf = np.vectorize(math.erf)
sigmoid = lambda x: 0.5 * (1 + np.tanh(x / 2))  # noqa: E731 (no overflow at -inf)
MATHS = {  # name: (TE, NumPy in float64, inputs, tolerance); a NaN input must give NaN
    "tanh": (te.tanh, np.tanh, WIDE, 1e-6),
    "erf": (te.erf, erf, WIDE, 1e-6),
    "sigmoid": (te.sigmoid, sigmoid, WIDE * 4, 1e-6),
    "exp": (te.exp, np.exp, np.concatenate([np.linspace(-100, 88, 4001), [-np.inf, np.nan]]), 1e-6),  # > 88: clamped
    "log": (te.log, np.log, np.concatenate([np.geomspace(1e-45, 3e38, 6001), np.linspace(0.5, 2, 2001),
                                            [0.0, -0.0, -1.0, -np.inf, np.inf, np.nan]]), 1e-6),  # denormals too
    "pow": (lambda x: te.power(x, tirx.const(3.0, "float32")), lambda x: x ** 3, WIDE, 1e-6),
}


@pytest.mark.parametrize("name", sorted(MATHS))
def test_polynomial_math(name):
    op, ref, inputs, tol = MATHS[name]
    x = te.placeholder((i64(len(inputs)),), name="x")
    y = te.compute(x.shape, lambda i: op(x[i]), name=name)
    assert f"T.{name}(" in te.create_prim_func([x, y]).script()
    data = inputs.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        want = ref(data.astype(np.float64))
    rule, mod = check([x, y], want, data, tol=tol)
    assert rule == "injective" and f"T.{name}(" not in mod.script()


# ---- whole models ------------------------------------------------------------------------------------
D, H = 32, 48


def tiny_model() -> onnx.ModelProto:
    """x (batch, seq, 32) → tanh-GELU(x · W + b) → LayerNorm → Softmax (y), and LayerNorm's transpose (t)."""
    rng = np.random.default_rng(8)
    consts = {"w": randn(rng, D, H, scale=D ** -0.5), "b": randn(rng, H), "g": randn(rng, H), "beta": randn(rng, H),
              "three": np.float32(3), "c": np.float32(0.044715), "s": np.float32(math.sqrt(2 / math.pi)),
              "one": np.float32(1), "half": np.float32(0.5)}
    node = oh.make_node
    nodes = [node("MatMul", ["x", "w"], ["xw"]), node("Add", ["xw", "b"], ["h"]),
             node("Pow", ["h", "three"], ["h3"]), node("Mul", ["h3", "c"], ["ch3"]), node("Add", ["h", "ch3"], ["u"]),
             node("Mul", ["u", "s"], ["su"]), node("Tanh", ["su"], ["th"]), node("Add", ["th", "one"], ["th1"]),
             node("Mul", ["h", "th1"], ["hth"]), node("Mul", ["hth", "half"], ["gelu"]),
             node("LayerNormalization", ["gelu", "g", "beta"], ["ln"], axis=-1, epsilon=1e-5),
             node("Softmax", ["ln"], ["y"], axis=-1), node("Transpose", ["ln"], ["t"], perm=[0, 2, 1])]
    g = oh.make_graph(nodes, "tiny", [oh.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq", D])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["batch", "seq", H]),
                       oh.make_tensor_value_info("t", TP.FLOAT, ["batch", H, "seq"])],
                      [nh.from_array(np.asarray(v), k) for k, v in consts.items()])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 10
    return model


MODELS = {"tiny": tiny_model, "gpt2": BUILDERS["gpt2"]}


def legalized(model: onnx.ModelProto, target) -> tvm.IRModule:
    """The importer's Relax module (as `import_onnx` makes it) after the target's Relax legalisation and
    fusion: CPU as `compile_model` runs it before `ScheduleFunctions`; CUDA's includes dlight's rules."""
    mod = relax_module(model, target)
    with target:
        return tvm.transform.Sequential(build.until_scheduling(target))(mod)


def prim_funcs(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {g.name_hint: f for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def test_tiny_model_matches_onnx_runtime():
    pytest.importorskip("onnxruntime")
    from onnx_testing import ort_run
    model = tiny_model()
    imported = tvmattn.import_onnx(model, "cpu")
    for batch, seq in ((2, 7), (1, 33)):
        feed = {"x": randn(np.random.default_rng(seq), batch, seq, D)}
        for got, want in zip(imported.run(feed), ort_run(model, feed)):
            assert errors(got, want)[1] <= 1e-4, f"at batch {batch}, seq {seq}"
    assert {"matmul", "reduction", "injective"} <= set(imported.report.scheduled), str(imported.report)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_function_is_scheduled_on_cpu(name):
    model = MODELS[name]()
    mod = legalized(model, CPU)
    todo = [g for g, f in prim_funcs(mod).items() if not is_scheduled(f)]  # all but the attention kernels
    assert todo and (len(todo) < len(prim_funcs(mod))) == (name == "gpt2")  # gpt2: one attention kernel
    with CPU:
        out = ScheduleFunctions(CPU)(mod)
    assert [g for g, f in prim_funcs(out).items() if not is_scheduled(f)] == []
    assert len(prim_funcs(out)) == len(prim_funcs(mod))
    assert sum(tvmattn.import_onnx(model, "cpu").report.scheduled.values()) == len(todo)


def test_schedule_functions_leaves_its_input_alone():
    mod = legalized(tiny_model(), CPU)
    before = {g: is_scheduled(f) for g, f in prim_funcs(mod).items()}
    with CPU:
        ScheduleFunctions(CPU)(mod)
    assert {g: is_scheduled(f) for g, f in prim_funcs(mod).items()} == before


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_function_is_scheduled_on_cuda(name):
    target = resolve_target("cuda", "sm_80")
    funcs = prim_funcs(legalized(MODELS[name](), target))
    assert [g for g, f in funcs.items() if not is_scheduled(f)] == []
    tir = tvm.IRModule({g: f.with_attr("global_symbol", g) for g, f in funcs.items()})
    assert cuda_tools.verify_kernels(build.lower(tir, target), "sm_80") == []
    if shutil.which("nvcc"):
        for r in cuda_tools.kernel_resources(tir, target):
            assert r.spill_bytes == 0, r.line()


def test_every_rule_has_an_operator_class_in_the_bench():
    """`tvmattn bench model.onnx` splits a run by operator class from the rule that scheduled each
    function: a rule missing there would count its GEMMs as "other" (the VM's own work)."""
    from tvmattn.compiler.onnx.bench import RULE_CLASS

    assert {name for name, _ in RULES} - {"scan", "fallback"} <= set(RULE_CLASS)
    assert {RULE_CLASS[name] for name, _ in RULES if "gemv" in name or "matmul" in name} == {"matmul"}
