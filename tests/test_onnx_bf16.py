"""Whole imported models in 16 bits: ``import_onnx(model, dtype="bfloat16" | "float16")`` (its matmuls by
the weights in that precision, fp32 accumulation, the rest fp32: `schedules.ops.precision`), the bf16
GEMM on the bf16 dot products (`schedules.ops.matmul_bf16`), and graphs exported in fp16 or bf16.

References: float64 NumPy for one GEMM; ONNX Runtime in fp32 for whole models, at the dtype's
tolerance on max|out − ref| / max|ref| (bf16 5e-2, fp16 1e-2: `compiler.verify`'s)."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import onnx
import onnx.helper as oh
import pytest
import tvm
from helpers import NO_AMX, runs_here
from onnx import TensorProto as TP
from onnx_testing import ort_run
from tvm import te, tirx

import tvmattn
from tvmattn.compiler import build
from tvmattn.compiler.kernel import host_tensor
from tvmattn.compiler.passes import polynomial_math
from tvmattn.compiler.target import isa_of, resolve_target
from tvmattn.compiler.verify import TOLERANCE, errors
from tvmattn.models import zoo
from tvmattn.schedules.ops import RULES
from tvmattn.schedules.ops.matmul import CONSTANT_PARAMS, pack

HOST = resolve_target("cpu")
HAS_DOT = isa_of(HOST).dot is not None  # the host CPU has a bf16 dot product
ON_TILES = isa_of(HOST).tiles is not None  # the host CPU has AMX (its bf16 GEMMs take the tiles)
ZEN4 = resolve_target({"kind": "llvm", "mcpu": "znver4"})  # AVX512-BF16
ZEN3 = resolve_target({"kind": "llvm", "mcpu": "znver3"})  # AVX2
SPR = resolve_target({"kind": "llvm", "mcpu": "sapphirerapids"})  # AMX


def i64(n: int) -> tirx.IntImm:
    return tirx.IntImm("int64", n)


def bf16_gemm(rows, k: int, n: int, bias: bool = True) -> tirx.PrimFunc:
    """y = x · W + 1 (or, without ``bias``, x · W: no epilogue) with bf16 x and W, fp32 accumulation: a
    projection (a convolution's GEMM) as the bf16 import writes it."""
    x = te.placeholder((rows, i64(k)), "bfloat16", name="x")
    w = te.placeholder((i64(k), i64(n)), "bfloat16", name="w")
    r = te.reduce_axis((i64(0), i64(k)), name="c")
    y = te.compute((rows, i64(n)), lambda i, j: te.sum(x[i, r].astype("float32") * w[r, j].astype("float32"),
                                                       axis=r), name="matmul")
    out = te.compute(y.shape, lambda i, j: y[i, j] + 1.0, name="bias") if bias else y
    return te.create_prim_func([x, w, out]).with_attr(CONSTANT_PARAMS, [1])


def schedule(func: tirx.PrimFunc, target) -> tuple[str, tvm.IRModule]:
    name, rule, sch = next((n, r, s) for n, r in RULES if (s := r.apply(func, target, False)) is not None)
    return name, tvm.transform.Sequential([*getattr(rule, "passes", ()), polynomial_math()])(sch.mod)


@pytest.mark.parametrize("target", [HOST, pytest.param(NO_AMX, id="no-amx")])
@pytest.mark.parametrize("rows, k, n", [(64, 256, 128), ("symbolic", 96, 64), (130, 64, 48), (70, 96, 64), (1, 96, 64),
                                        (6, 64, 96), (1, 64, 40), (96, 1280, 64), ("symbolic", 64, 512),
                                        (50, 256, 64), (49, 64, 64), (67, 64, 64)])
def test_bf16_gemm_matches_float64(rows, k, n, target):
    """The bf16 GEMM with a bias epilogue: on AMX's tiles where the host has them (rows padded to whole
    blocks of 32 where ragged: 70, symbolic, a symbolic task's wider columns: 512; more reduction steps
    than a block's rows, each step beside a slice of the previous block's epilogue: 1280), on the dot
    products with AMX off (or without it), in register tiles of rows that divide a ragged count (70
    and 50: 5 rows; 49: 7 rows of 2 vectors) or padded to whole blocks (67), and so a decode step's
    few rows (1: a GEMV; 6), unpadded; widened to fp32 where the width is not whole vectors (48, 40)."""
    if target is NO_AMX and not ON_TILES:
        pytest.skip("the host has no AMX: HOST already runs the dot products")
    m = tirx.Var("m", "int64") if rows == "symbolic" else i64(rows)
    rule, mod = schedule(bf16_gemm(m, k, n), target)
    few = rows != "symbolic" and rows < 16
    assert rule == ("gemv" if rows == 1 else "matmul") + ("-bf16" if HAS_DOT and n % 16 == 0 else "")
    count = 37 if rows == "symbolic" else rows
    rng = np.random.default_rng(0)
    x = rng.standard_normal((count, k)).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(ml_dtypes.bfloat16)
    shape = [int(d) for d in mod["main"].params[1].ty.shape]
    if rule.endswith("-bf16"):  # a register tile's columns, one contiguous panel of pairs of W's rows
        tiles, half, width, pair = shape  # (n/w, k/2, w, 2)
        assert (tiles * width, half, pair) == (n, k // 2, 2)
        on_tiles = target is HOST and ON_TILES and n % 32 == 0 and not few
        assert ("tdpbf16ps" in mod.script()) == on_tiles
        assert width == 32 or not on_tiles  # a tile block's columns
    out = np.zeros((count, n), np.float32)
    fn = tvm.compile(mod, target, tir_pipeline=build.CPU_PIPELINE)["main"]
    fn(host_tensor(x), host_tensor(np.ascontiguousarray(pack(w, shape) if shape != [k, n] else w)), host_tensor(out))
    want = x.astype(np.float64) @ w.astype(np.float64) + 1.0  # the bf16 values' exact products
    assert errors(out, want)[1] <= 1e-5  # fp32 accumulation of exact bf16 products


@pytest.mark.parametrize("target", [HOST, pytest.param(NO_AMX, id="no-amx")])
@pytest.mark.parametrize("rows, k, bias", [(70, 10, False), ("symbolic", 10, False), (70, 96, True),
                                           ("symbolic", 96, True), ("symbolic", 96, False), (67, 96, False)])
def test_bf16_gemm_padded_rows_stay_in_the_output(rows, k, bias, target):
    """Rows padded to whole blocks (67, or 70 on the tiles; symbolic, run at 37): each register tile (or block of tiles)
    stores its real rows itself, the copy back part of its epilogue or its only one (a 10-tap
    convolution's GEMM has no other), and nothing past the output: it is a view of a larger array whose
    rows after it keep their sentinel. A padded GEMM's fp32 product is never a whole array."""
    if target is NO_AMX and not ON_TILES:
        pytest.skip("the host has no AMX: HOST already runs the dot products")
    n, count = 64, 37 if rows == "symbolic" else rows
    rule, mod = schedule(bf16_gemm(tirx.Var("m", "int64") if rows == "symbolic" else i64(rows), k, n, bias), target)
    assert rule == "matmul-bf16"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((count, k)).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(ml_dtypes.bfloat16)
    shape = [int(d) for d in mod["main"].params[1].ty.shape]
    whole = np.full((count + 40, n), 7.0, np.float32)  # the output, then 40 rows that must stay 7
    fn = tvm.compile(mod, target, tir_pipeline=build.CPU_PIPELINE)["main"]
    fn(host_tensor(x), host_tensor(np.ascontiguousarray(pack(w, shape))), host_tensor(whole[:count]))
    want = x.astype(np.float64) @ w.astype(np.float64) + (1.0 if bias else 0.0)
    assert errors(whole[:count], want)[1] <= 1e-5
    assert (whole[count:] == 7.0).all()


@pytest.mark.parametrize("target", [HOST, ZEN4, ZEN3], ids=["host", "znver4", "znver3"])
def test_bf16_rounding_on_the_conversion_instruction(target):
    """fp32 → bf16 of a vector: ``vcvtneps2bf16`` (two halves at a time: ``vcvtne2ps2bf16``) where the
    CPU has AVX512-BF16, TVM's integer rounding elsewhere (`passes.narrow_bf16`); both to nearest even,
    bit for bit as ml_dtypes rounds, on the CPUs this host runs."""
    x = te.placeholder((i64(8), i64(64)), "float32", name="x")
    y = te.compute(x.shape, lambda i, j: (x[i, j] * 3.0).astype("bfloat16"), name="y")
    rule, mod = schedule(te.create_prim_func([x, y]), target)
    lib = tvm.compile(mod, target, tir_pipeline=build.CPU_PIPELINE)
    asm = lib.mod.inspect_source("asm")
    assert ("vcvtne2ps2bf16" in asm or "vcvtneps2bf16" in asm) == (isa_of(target).dot is not None)
    if not runs_here(target):
        return
    rng = np.random.default_rng(0)
    xs = (rng.standard_normal((8, 64)) * 10.0 ** rng.integers(-30, 30, (8, 64))).astype(np.float32)
    xs[0, :4] = [np.inf, -np.inf, 0.0, -0.0]
    xs[0, 4] = np.nan
    out = np.zeros((8, 64), ml_dtypes.bfloat16)
    lib["main"](host_tensor(xs), host_tensor(out))
    want = (xs * np.float32(3.0)).astype(ml_dtypes.bfloat16)
    assert np.isnan(out[0, 4].astype(np.float32))
    keep = ~np.isnan(want.astype(np.float32))
    assert np.array_equal(out.view(np.uint16)[keep], want.view(np.uint16)[keep])


def bf16_products(heads: int, rows, k: int, n: int) -> tirx.PrimFunc:
    """y[h] = x[h] · b[h] with bf16 activations on both sides (no constant): DeBERTa's query × positional
    keys as the bf16 import writes it."""
    x = te.placeholder((i64(heads), rows, i64(k)), "bfloat16", name="x")
    b = te.placeholder((i64(heads), i64(k), i64(n)), "bfloat16", name="b")
    r = te.reduce_axis((i64(0), i64(k)), name="c")
    return te.create_prim_func([x, b, te.compute(
        (i64(heads), rows, i64(n)), lambda h, i, j: te.sum(x[h, i, r].astype("float32") * b[h, r, j].astype("float32"),
                                                           axis=r), name="matmul")])


@pytest.mark.parametrize("target", [HOST, pytest.param(NO_AMX, id="no-amx")])
@pytest.mark.parametrize("rows, n", [(48, 80), ("symbolic", 80), (48, 96), ("symbolic", 96)])
def test_bf16_activation_products_match_float64(rows, n, target):
    """Both operands activations: B's pairs of rows interleaved in the kernel, each call (`matmul_bf16`);
    on AMX's tiles where the host has them and the width is whole blocks of 32 (96)."""
    if target is NO_AMX and not ON_TILES:
        pytest.skip("the host has no AMX: HOST already runs the dot products")
    m = tirx.Var("m", "int64") if rows == "symbolic" else i64(rows)
    rule, mod = schedule(bf16_products(3, m, 64, n), target)
    assert rule == ("matmul-bf16" if HAS_DOT else "matmul")
    assert ("tdpbf16ps" in mod.script()) == (target is HOST and ON_TILES and n % 32 == 0)
    count = 37 if rows == "symbolic" else rows
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, count, 64)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((3, 64, n)).astype(ml_dtypes.bfloat16)
    out = np.zeros((3, count, n), np.float32)
    tvm.compile(mod, target, tir_pipeline=build.CPU_PIPELINE)["main"](host_tensor(x), host_tensor(b), host_tensor(out))
    assert errors(out, x.astype(np.float64) @ b.astype(np.float64))[1] <= 1e-5


def test_activation_products_in_16_bits():
    """A bf16 import runs an activation × activation MatMul of the dot product's shape on it (queries ×
    positional keys, transposed in the graph), one of another shape in fp32; against ONNX Runtime."""
    rng = np.random.default_rng(5)
    inits = [oh.make_tensor(name, TP.FLOAT, shape, rng.standard_normal(shape).astype(np.float32).ravel() / 8)
             for name, shape in {"wq": (64, 64), "pos": (4, 96, 16)}.items()]
    nodes = [oh.make_node("MatMul", ["x", "wq"], ["q"]),
             oh.make_node("Reshape", ["q", "heads"], ["qh"]),
             oh.make_node("Transpose", ["qh"], ["qt"], perm=[0, 2, 1, 3]),
             oh.make_node("Relu", ["pos"], ["p"]), oh.make_node("Transpose", ["p"], ["pt"], perm=[0, 2, 1]),
             oh.make_node("MatMul", ["qt", "pt"], ["c2p"]),  # (b, 4, n, 16) · (4, 16, 96): the dot's shape
             oh.make_node("Transpose", ["qt"], ["qt_t"], perm=[0, 1, 3, 2]),
             oh.make_node("MatMul", ["qt", "qt_t"], ["scores"])]  # (b, 4, n, 16) · (b, 4, 16, n): n symbolic
    heads = oh.make_tensor("heads", TP.INT64, (4,), [0, 0, 4, 16])
    graph = oh.make_graph(nodes, "c2p", [oh.make_tensor_value_info("x", TP.FLOAT, ["b", "n", 64])],
                          [oh.make_tensor_value_info("c2p", TP.FLOAT, ["b", 4, "n", 96]),
                           oh.make_tensor_value_info("scores", TP.FLOAT, ["b", 4, "n", "n"])],
                          initializer=[*inits, heads])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)])
    imported = tvmattn.import_onnx(model, dtype="bfloat16")
    if HAS_DOT:
        assert list(imported.report.rule_of.values()).count("matmul-bf16") == 2  # x · wq and q · posᵀ
    x = rng.standard_normal((2, 40, 64)).astype(np.float32)
    for got, want in zip(imported.run({"x": x}), ort_run(model, {"x": x})):
        assert errors(got, want)[1] <= TOLERANCE["bfloat16"]


@pytest.mark.parametrize("target, instruction", [(SPR, "tdpbf16ps"), (ZEN4, "vdpbf16ps"), (ZEN3, None)])
def test_bf16_gemm_assembly(target, instruction):
    """With AMX the GEMM's inner loop is tdpbf16ps, on AVX512-BF16 vdpbf16ps; on AVX2 it widens to FMAs."""
    rule, mod = schedule(bf16_gemm(i64(64), 128, 64), target)
    assert rule == ("matmul-bf16" if instruction else "matmul")
    asm = tvm.compile(mod, target, tir_pipeline=build.CPU_PIPELINE).mod.inspect_source("asm")
    assert {i for i in ("tdpbf16ps", "vdpbf16ps") if re.search(rf"\b{i}\b", asm)} == ({instruction} - {None})
    assert re.search(r"vfmadd\d+ps", asm) or instruction


@pytest.mark.parametrize("target, instruction", [(ZEN4, "vdpbf16ps"), (ZEN3, None)])
def test_experts_on_the_dot_product(target, instruction):
    """A mixture of experts' W[ids] · x in a bf16 import: on AVX512-BF16 the experts kernel multiplies an
    expert's block of rows on vdpbf16ps, its accumulators in registers (its loop of dot products stores
    nothing); on AVX2 fp32 FMAs. Both against the float64 product of the bf16-rounded W and x, with rows
    of each expert that fill no whole block."""
    experts, k, o = 4, 64, 128
    w = np.random.default_rng(3).standard_normal((experts, o, k)).astype(np.float32)
    nodes = [oh.make_node("GatherND", ["w", "ids"], ["ws"]), oh.make_node("MatMul", ["ws", "x"], ["y"])]
    inputs = [oh.make_tensor_value_info("ids", TP.INT64, ["s", 1]),
              oh.make_tensor_value_info("x", TP.FLOAT, ["s", k, 1])]
    graph = oh.make_graph(nodes, "moe", inputs, [oh.make_tensor_value_info("y", TP.FLOAT, ["s", o, 1])],
                          [onnx.numpy_helper.from_array(w, "w")])
    imported = tvmattn.import_onnx(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), target,
                                   dtype="bfloat16")
    assert "experts" in imported.report.rule_of.values(), imported.report.rule_of
    lib = imported.executable.mod
    asm = "".join(m.inspect_source("asm") for m in [lib, *lib.imports] if m.kind == "llvm")
    assert ("vdpbf16ps" in asm) == (instruction is not None)
    for block in [b for b in re.split(r"\n\.?[\w.]+:", asm) if "vdpbf16ps" in b]:
        body = block[block.index("vdpbf16ps"):block.rindex("vdpbf16ps")]
        assert not re.search(r"vmov\w*\s+%zmm\d+, [^%\n]*\(", body), body[:2000]
    if not runs_here(target):
        return
    rng = np.random.default_rng(0)
    ids = np.array([0, 2, 2, 1, 2, 0, 3, 2, 2, 2, 1])[:, None]  # 2, 2, 6 and 1 rows
    x = rng.standard_normal((len(ids), k, 1)).astype(np.float32)
    w16, x16 = (a.astype(ml_dtypes.bfloat16).astype(np.float64) for a in (w, x))
    want = w16[ids[:, 0]] @ x16
    got = imported.run({"ids": ids, "x": x})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_symbolic_bf16_gemm_accumulates_in_registers():
    """An imported symbolic-row bf16 GEMM with no epilogue (its padded rows' copy back is the only one)
    keeps its register tile in registers on AVX512-BF16: its loop of dot products stores nothing. In
    TVM's workspace, its body inlined into a small module's wrapper, the tile was stored after every
    update (a third of the speed)."""
    x = oh.make_tensor_value_info("x", TP.FLOAT, ["b", "n", 256])
    y = oh.make_tensor_value_info("y", TP.FLOAT, ["b", "n", 512])
    w = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32), "w")
    graph = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["y"])], "gemm", [x], [y], [w])
    imported = tvmattn.import_onnx(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), ZEN4,
                                   dtype="bfloat16")
    assert set(imported.report.rule_of.values()) >= {"matmul-bf16"}
    lib = imported.executable.mod
    asm = "".join(m.inspect_source("asm") for m in [lib, *lib.imports] if m.kind == "llvm")
    dots = [b for b in re.split(r"\n\.?[\w.]+:", asm) if "vdpbf16ps" in b]  # basic blocks, by their labels
    assert dots
    for block in dots:  # from its first dot product to its last: loads and dot products only
        body = block[block.index("vdpbf16ps"):block.rindex("vdpbf16ps")]
        assert not re.search(r"vmov\w*\s+%zmm\d+, [^%\n]*\(", body), body[:2000]


QUICK = {("bert", "bfloat16"), ("falcon-decode", "bfloat16"), ("bloom", "float16")}  # -m slow: every pair
MODELS = [pytest.param(name, dtype, marks=[] if (name, dtype) in QUICK else [pytest.mark.slow])
          for name in ("bert", "falcon-decode", "bloom", "vit-ort", "t5", "qwen3", "whisper-encoder")
          for dtype in ("bfloat16", "float16")]


@pytest.mark.parametrize("name, dtype", MODELS)
def test_zoo_model_in_16_bits(name, dtype):
    """The import in 16 bits against ONNX Runtime in fp32, at the dtype's tolerance; inputs and outputs
    keep the model's dtypes."""
    m = zoo.get(name)
    imported = tvmattn.import_onnx(m.export(), dtype=dtype)
    assert imported.report.dtype == dtype
    # the attention kernels too, but a decode step's over its fp32 cache (casting the cache costs more)
    assert all(r.spec.dtype == ("float32" if m.kind == zoo.DECODE else dtype) for r in imported.report.replacements)
    rules = set(imported.report.rule_of.values())
    if dtype == "bfloat16" and HAS_DOT and m.kind == zoo.DECODE:  # every GEMV on the dot product, small ones too
        assert "gemv-bf16" in rules and not rules & {"gemv", "matmul"}, rules
    elif dtype == "bfloat16" and HAS_DOT:
        assert "matmul-bf16" in rules, rules
    feed = m.feed(m.shapes[0])
    for got, want in zip(imported.run(feed), ort_run(m.export(), feed)):
        assert got.dtype == want.dtype
        assert errors(got, want)[1] <= TOLERANCE[dtype], (name, dtype, errors(got, want))


def test_gemm_with_transposed_weight_in_16_bits():
    """ONNX ``Gemm`` with ``transB`` (a 2-D export's MLP: OPT's) reads its weight transposed: still a
    constant, converted at import and run on the bf16 GEMM, against ONNX Runtime in fp32."""
    rng = np.random.default_rng(3)
    shapes = {"w1": (96, 64), "b1": (96,), "w2": (64, 96), "b2": (64,)}  # (out, in): transposed weights
    inits = [oh.make_tensor(name, TP.FLOAT, shape, rng.standard_normal(shape).astype(np.float32).ravel() / 8)
             for name, shape in shapes.items()]
    nodes = [oh.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1), oh.make_node("Relu", ["h"], ["r"]),
             oh.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1)]
    graph = oh.make_graph(nodes, "mlp", [oh.make_tensor_value_info("x", TP.FLOAT, ["rows", 64])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, ["rows", 64])], initializer=inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)])
    imported = tvmattn.import_onnx(model, dtype="bfloat16")
    if HAS_DOT:
        assert "matmul" not in imported.report.rule_of.values(), imported.report.rule_of
    x = rng.standard_normal((37, 64)).astype(np.float32)
    assert errors(imported.run({"x": x})[0], ort_run(model, {"x": x})[0])[1] <= TOLERANCE["bfloat16"]


@pytest.mark.parametrize("rows", ["rows", 100])
def test_reduction_padded_to_whole_tile_steps(rows):
    """A reduction that is not whole tile steps (Whisper's first convolution: 3·80 mel bins = 240) is
    padded with zeros where the target has AMX, x by a pad its producer could join and the weight at
    import, so that the product runs on the tiles; the same answer as ONNX Runtime in fp32."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((240, 96)).astype(np.float32) / 16
    graph = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["y"])], "conv-as-gemm",
                          [oh.make_tensor_value_info("x", TP.FLOAT, [2, rows, 240])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [2, rows, 96])],
                          initializer=[oh.make_tensor("w", TP.FLOAT, w.shape, w.ravel())])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)])
    imported = tvmattn.import_onnx(model, dtype="bfloat16")
    padded = [name for name in imported.report.rule_of if "pad" in name]  # (fused_cast_pad: the cast joined)
    assert bool(padded) == ON_TILES, imported.report.rule_of
    assert imported.report.scheduled.get("matmul-bf16") == 1 or not HAS_DOT, imported.report.rule_of
    x = rng.standard_normal((2, 100, 240)).astype(np.float32)
    assert errors(imported.run({"x": x})[0], ort_run(model, {"x": x})[0])[1] <= TOLERANCE["bfloat16"]


def test_bad_dtype_is_one_error():
    with pytest.raises(tvmattn.TvmAttnError, match="dtype='int8'"):
        tvmattn.import_onnx(zoo.get("bert").export(), dtype="int8")
    with pytest.raises(tvmattn.TvmAttnError, match="cache_dtype='int8'"):
        tvmattn.import_onnx(zoo.get("bert").export(), dtype="bfloat16", cache_dtype="int8")
    with pytest.raises(tvmattn.TvmAttnError, match="no KV cache"):  # an encoder has none
        tvmattn.import_onnx(zoo.get("bert").export(), dtype="bfloat16", cache_dtype="bfloat16")


def widened_caches(imported, feed: dict, length: int) -> list[str]:
    """The functions a run calls with a float32 argument of the cache's length: the cache widened."""
    vm = tvm.relax.VirtualMachine(imported.executable, tvm.cpu())
    seen: list[str] = []

    def instrument(_func, symbol, before, _ret, *args):
        if before and any(isinstance(a, tvm.runtime.Tensor) and a.dtype == "float32" and a.ndim == 4
                          and a.shape[2] == length for a in args):
            seen.append(symbol)
        return 0

    vm.set_instrument(instrument)
    vm["main"](*[host_tensor(feed[i.name]) for i in imported.inputs])
    return seen


# BLOOM's attention reads its cache through reshapes: (1, h, n, d) → (h, n, d) → (1, h, n, d)
@pytest.mark.parametrize("name", ["bloom-decode", pytest.param("falcon-decode", marks=pytest.mark.slow)])
def test_decode_loop_with_a_16_bit_cache(name):
    """``cache_dtype``: past_* inputs and present_* outputs in bf16, a decode loop feeding present back as
    past for three steps, against ONNX Runtime in fp32 fed the same cache (widened), at bf16's tolerance;
    each present extends its past with the past's bits unchanged, and no kernel reads it widened."""
    m = zoo.get(name)
    proto = m.export()
    imported = tvmattn.import_onnx(proto, dtype="bfloat16", cache_dtype="bfloat16")
    cache = dict(imported.report.cache)  # past → present
    assert len(cache) == 4 and all(i.dtype == "bfloat16" for i in imported.inputs if i.name in cache)
    assert all(r.spec.dtype == "bfloat16" for r in imported.report.replacements)  # the cache read in 16 bits
    ours = imported.declared(m.feed(m.shapes[0]))
    assert widened_caches(imported, ours, m.shapes[0][1] + 1) == []
    for token in (5, 17, 3):
        ours["input_ids"] = np.array([[token]], dtype=np.int64)
        wide = {k: v.astype(np.float32) if k in cache else v for k, v in ours.items()}
        got = dict(zip(imported.output_names, imported.run(ours)))
        for name, want in zip(imported.output_names, ort_run(proto, wide)):
            assert errors(got[name].astype(np.float32), want)[1] <= TOLERANCE["bfloat16"], name
        for past, present in cache.items():
            assert str(got[present].dtype) == "bfloat16"
            n = ours[past].shape[2]
            assert got[present].shape[2] == n + 1
            assert np.array_equal(got[present][:, :, :n].view(np.uint16), ours[past].view(np.uint16))
        ours.update({past: got[present] for past, present in cache.items()})


def _attention_of_width(d: int, variants: bool) -> onnx.ModelProto:
    """ONNX's Attention on (B, 4, S, d) q: causal, or with ``variants`` an additive (B, 1, S, S) mask, two
    KV heads (GQA) and a softcap. Phi-2's head width is 80."""
    kv_heads = 2 if variants else 4
    inputs = [("q", ["B", 4, "S", d]), ("k", ["B", kv_heads, "S", d]), ("v", ["B", kv_heads, "S", d])]
    inputs += [("m", ["B", 1, "S", "S"])] if variants else []
    node = oh.make_node("Attention", [name for name, _ in inputs], ["y"],
                        **(dict(softcap=30.0) if variants else dict(is_causal=1)))
    graph = oh.make_graph([node], "attention", [oh.make_tensor_value_info(n, TP.FLOAT, s) for n, s in inputs],
                          [oh.make_tensor_value_info("y", TP.FLOAT, ["B", 4, "S", d])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def _assert_matches_ort(model: onnx.ModelProto, imported: tvmattn.ImportedModel, width: int) -> None:
    """``imported`` (of `_attention_of_width` ``width``) against ONNX Runtime fp32 at two sizes, in bf16's tolerance."""
    rng = np.random.default_rng(0)
    for b, s in ((2, 64), (1, 200)):
        feed = {i.name: rng.standard_normal([b if d == "B" else s if d == "S" else d for d in
                                             (x.dim_param or x.dim_value for x in i.type.tensor_type.shape.dim)])
                .astype(np.float32) for i in model.graph.input}
        got, = imported.run(feed)
        assert got.shape == (b, 4, s, width)
        assert errors(got, ort_run(model, feed)[0])[1] <= TOLERANCE["bfloat16"]


@pytest.mark.parametrize("force, variants", [(False, False), (True, False), (True, True)])
def test_head_widths_padded_for_the_tiles(force, variants, monkeypatch):
    """A head width the tile registers do not take (80) runs on them padded to 96 where the target has
    them (`build.head_widths`): q, k and v get zero columns, the output loses them again, the scale
    stays 1/√80. ``force`` pads on any CPU (the padded kernel on this CPU's path), so that the graph's
    padding is checked everywhere against ONNX Runtime in fp32, with a mask, GQA and a softcap too."""
    from tvmattn.compiler.onnx import kernels
    from tvmattn.schedules.cpu.plan import padded_widths
    if force:
        monkeypatch.setattr(kernels, "head_widths", lambda spec, _target: spec.replace(
            head_dim=96, v_head_dim=96, scale=spec.softmax_scale))
    model = _attention_of_width(80, variants)
    imported = tvmattn.import_onnx(model, dtype="bfloat16")
    spec = imported.report.replacements[0].spec
    unpadded = spec.replace(head_dim=80, v_head_dim=80, scale=None)
    assert spec.d_k == (96 if force or padded_widths(unpadded, imported.target) else 80), spec
    assert spec.softmax_scale == pytest.approx(80 ** -0.5)
    _assert_matches_ort(model, imported, 80)


@pytest.mark.parametrize("variants", [False, True])
def test_head_widths_padded_for_the_dot_products(variants):
    """Without tile registers (this CPU with AMX off: Zen 4's AVX512-BF16), a width of 40 is no whole
    vector: P·V would run widened. Padded to 48 (d_k too, the keys being symbolic: `build.head_widths`),
    both products run on the dot products, and the output loses the columns again; against ONNX Runtime fp32."""
    if not runs_here(NO_AMX):
        pytest.skip("this CPU lacks AVX-512")
    model = _attention_of_width(40, variants)
    imported = tvmattn.import_onnx(model, NO_AMX, dtype="bfloat16")
    spec = imported.report.replacements[0].spec
    assert (spec.d_k, spec.d_v) == ((48, 48) if isa_of(NO_AMX).dot is not None else (40, 40)), spec
    assert spec.softmax_scale == pytest.approx(40 ** -0.5)
    _assert_matches_ort(model, imported, 40)


@pytest.mark.parametrize("dtype", [pytest.param("float16", marks=pytest.mark.slow), "bfloat16"])
def test_graph_exported_in_16_bits(dtype):
    """A Llama exported after ``.to(dtype)`` (every tensor 16-bit) imports and runs, against PyTorch in
    that dtype."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval().to(torch_dtype)

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        program = torch.onnx.export(Logits().eval(), (ids,), dynamo=True, input_names=["input_ids"],
                                    output_names=["logits"],
                                    dynamic_shapes=({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},))
        imported = tvmattn.import_onnx(program.model_proto)
        feed = np.random.default_rng(1).integers(0, 128, (2, 11)).astype(np.int64)
        want = Logits()(torch.from_numpy(feed)).float().numpy()
    got = imported.run({"input_ids": feed})[0]
    assert str(got.dtype) == dtype
    assert errors(got.astype(np.float32), want)[1] <= TOLERANCE[dtype]
