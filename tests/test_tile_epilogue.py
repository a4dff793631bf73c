"""`passes.interleave_tile_epilogues`: a tile GEMM's epilogue of block j − 1 runs beside block j's products.

The tiles here are one fp32 register held in LLVM IR (`_TILES`), so the pass's kernels run on any CPU:
zero it, add x[i] to it (a product step), store it to acc (the block's store)."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te
from tvm.script import tirx as T

from tvmattn.compiler import passes
from tvmattn.compiler.annotations import CONSTANT_PARAMS, TILE_BLOCKS
from tvmattn.compiler.build import CPU_PIPELINE, lower
from tvmattn.compiler.kernel import host_tensor
from tvmattn.compiler.target import resolve_target
from tvmattn.schedules.ops import RULES

_TILES = """
@tile = internal global float 0.0
define i32 @tile_zero() {
  store float 0.0, ptr @tile
  ret i32 0
}
define i32 @tile_add(ptr %x) {
  %v = load float, ptr %x
  %t = load float, ptr @tile
  %s = fadd float %t, %v
  store float %s, ptr @tile
  ret i32 0
}
define i32 @tile_store(ptr %acc) {
  %t = load float, ptr @tile
  store float %t, ptr %acc
  ret i32 0
}
"""
BLOCKS, STEPS, ROWS = 5, 7, 12  # blocks, product steps a block, epilogue rows a block


def _kernel(case: str) -> tvm.IRModule:
    """y[j, r] = (r + 1) · Σ_s x[j·STEPS + s]: per block j, the steps' sum on the tile, stored to acc,
    then the epilogue. The other cases break one condition the pass needs."""

    @T.prim_func
    def kernel(x: T.Buffer((BLOCKS * STEPS,), "float32"), y: T.Buffer((BLOCKS, ROWS), "float32")):
        acc = T.alloc_buffer((1,), "float32")
        for j in T.serial(BLOCKS, annotations={TILE_BLOCKS: 1, "pragma_import_llvm": _TILES}):
            T.evaluate(T.call_extern("int32", "tile_zero"))
            for s in range(STEPS):
                T.evaluate(T.call_extern("int32", "tile_add", T.address_of(x[j * STEPS + s])))
                if case == "products write":
                    acc[0] = T.float32(0)
            T.evaluate(T.call_extern("int32", "tile_store", T.address_of(acc[0])))
            for r in range(ROWS):
                if case == "tile call":
                    T.evaluate(T.call_extern("int32", "tile_zero"))
                y[j, r] = acc[0] * T.Cast("float32", r + 1)
                if case == "writes an operand":
                    x[j * STEPS] = T.float32(1)
            if case == "two epilogues":
                for r in range(ROWS):
                    y[j, r] = y[j, r] + T.float32(1)

    return tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")})


def _lowered(mod: tvm.IRModule, target) -> tvm.IRModule:
    """TVM's own pipeline (flat loops), where the pass runs."""
    mod = tvm.tirx.transform.BindTarget(target.with_host(target))(mod)
    return tvm.tirx.get_tir_pipeline("default")[0](mod)


def _epilogue_inside_products(mod: tvm.IRModule, product: str = "tile_add", store: str = "tile_store",
                              output: str = "y") -> bool:
    """Whether a store to ``output`` stands inside the loop over a block's product steps."""
    found = []

    def on_for(loop):
        stores = []
        tvm_ffi.structural_walk(loop.body, [(tvm.tirx.BufferStore, lambda st: stores.append(st.buffer.name))])
        text = loop.body.script()  # (the steps' loop: products, not the block's store)
        found.append(product in text and store not in text and any(n.startswith(output) for n in stores))

    tvm_ffi.structural_walk(mod["main"].body, [(tvm.tirx.For, on_for)])
    return any(found)


def test_epilogue_runs_beside_the_next_blocks_products():
    target = resolve_target("cpu")
    before = _lowered(_kernel("plain"), target)
    assert not _epilogue_inside_products(before)
    assert _epilogue_inside_products(passes.interleave_tile_epilogues()(before))
    x = np.random.default_rng(0).standard_normal(BLOCKS * STEPS).astype(np.float32)
    y = np.zeros((BLOCKS, ROWS), np.float32)
    tvm.compile(_kernel("plain"), target, tir_pipeline=CPU_PIPELINE)["main"](host_tensor(x), host_tensor(y))
    want = x.astype(np.float64).reshape(BLOCKS, STEPS).sum(1)[:, None] * np.arange(1, ROWS + 1)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)  # every block's epilogue, the last's after the loop


@pytest.mark.parametrize("case", ["products write", "tile call", "writes an operand", "two epilogues"])
def test_unsafe_blocks_are_left_as_they_are(case):
    before = _lowered(_kernel(case), resolve_target("cpu"))
    tvm.ir.assert_structural_equal(passes.interleave_tile_epilogues()(before), before)


def test_a_bf16_gemm_on_amx_tiles_takes_it():
    """The bf16 GEMM rule's kernel for Sapphire Rapids (lowered only: any host), y = x · W + 1."""
    i64 = lambda n: tvm.tirx.IntImm("int64", n)  # noqa: E731
    x = te.placeholder((i64(64), i64(256)), "bfloat16", name="x")
    w = te.placeholder((i64(256), i64(128)), "bfloat16", name="w")
    c = te.reduce_axis((i64(0), i64(256)), name="c")
    y = te.compute((i64(64), i64(128)), lambda i, j: te.sum(x[i, c].astype("float32") * w[c, j].astype("float32"),
                                                            axis=c), name="matmul")
    out = te.compute(y.shape, lambda i, j: y[i, j] + 1.0, name="y_bias")
    func = te.create_prim_func([x, w, out]).with_attr(CONSTANT_PARAMS, [1])
    spr = resolve_target({"kind": "llvm", "mcpu": "sapphirerapids"})
    rule = dict(RULES)["matmul-bf16"]
    mod = tvm.transform.Sequential(list(rule.passes))(rule.apply(func, spr, False).mod)
    assert _epilogue_inside_products(lower(mod, spr), "tdpbf16ps", "tilestored64", "y_bias")
