"""Whole imported models for aarch64, run by TVM's own aarch64 runtime (the Relax VM of PyPI's aarch64
wheels, driven by `compiler/cross/model_driver.c`) under qemu-user, against ONNX Runtime run here."""

import concurrent.futures
import logging
import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_testing import ort_run
from test_cross import MISSING, needs_tools

import tvmattn
from tvmattn.compiler.cli import main
from tvmattn.compiler.cross import runtime, toolchain
from tvmattn.compiler.onnx.export import export_onnx
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.verify import TOLERANCE, errors
from tvmattn.models import zoo

LAYER = dict(batch=1, seq_len="n", num_heads=4, d_model=64)  # a full layer: projections, core, W_O
MODELS = {  # CPU, dtype of the import, the layer's fields
    "neon fp32 causal": ("aarch64", None, dict(causal=True)),
    "neon gqa key padding": ("cortex-a76", None, dict(num_kv_heads=2, key_padding=True)),
    "sve256 bf16 causal": ("neoverse-v1", "bfloat16", dict(causal=True)),
    "sve256 fp16 window": ("neoverse-v1", "float16", dict(causal=True, window=5)),
    "neon bf16 cross": ("neoverse-v2", "bfloat16", dict(kv_seq_len="m")),
    "neon fp16 fmas": ("neoverse-v2", "float16", dict(causal=True)),
}
ZOO = {"bert": "neoverse-v1", "falcon-decode": "neoverse-v2"}  # (the zoo's quick models: encoder, KV cache)


@pytest.fixture(scope="module")
def aarch64_runtime():
    """TVM's aarch64 runtime, fetched once: offline, these tests skip (in CI they fail)."""
    if MISSING:
        pytest.skip(f"{', '.join(MISSING)} not installed (.ci/run installs them)")
    try:
        return runtime.driver("aarch64")
    except tvmattn.TvmAttnError as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(err))


def assert_emulated_matches_ort(model, feed: dict, mcpu: str, dtype: str | None = None) -> None:
    """``model`` imported for ``mcpu`` (in ``dtype``), run under qemu, against ONNX Runtime's fp32 outputs."""
    imported = tvmattn.import_onnx(model, "aarch64", mcpu=mcpu, dtype=dtype)
    outs, refs = imported.run(imported.declared(feed)), ort_run(model, feed)
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        _, error = errors(out, ref)
        assert error <= TOLERANCE[dtype or "float32"], f"{mcpu} {dtype}: error {error:.3g}"


@pytest.mark.parametrize("case", list(MODELS))
def test_emulated_model_matches_ort(aarch64_runtime, case):
    mcpu, dtype, fields = MODELS[case]
    spec = AttentionSpec(**{**LAYER, **fields})
    model, _ = export_onnx(spec, 17 if spec.key_padding else 23, 0)  # (ORT's Attention rejects a (B,1,1,1) mask)
    rng = np.random.default_rng(0)
    n, m = 11, 7
    feed = {"x": rng.standard_normal((1, n, 64)).astype(np.float32)}
    if spec.kv_seq_len == "m":
        feed["x_kv"] = rng.standard_normal((1, m, 64)).astype(np.float32)
    if spec.key_padding:
        feed["kv_lens"] = np.array([6], np.int32)
    assert_emulated_matches_ort(model, feed, mcpu, dtype)


def small_shape(m: zoo.ZooModel) -> tuple[int, int]:
    """One sequence of 16 tokens (16 cached for a decode step); an image or Whisper's frames as the model
    fixes them; wav2vec2's audio at 4000 samples."""
    if m.kind in ("vision", "audio"):
        return (1, 4000 if m.name == "wav2vec2" else m.shapes[0][1])
    return (1, 16)


@pytest.mark.parametrize("name", [pytest.param(m.name, marks=[] if m.name in ZOO else [pytest.mark.slow])
                                  for m in zoo.MODELS])
def test_emulated_zoo_model_matches_ort(aarch64_runtime, name):
    """Exports as users bring them (Hugging Face through torch's exporters), fp32 on SVE-256 (Neoverse V1)
    unless `ZOO` names another CPU; ``-m slow``: the whole zoo."""
    pytest.importorskip("transformers")
    m = zoo.get(name)
    assert_emulated_matches_ort(m.export(), m.feed(small_shape(m)), ZOO.get(name, "neoverse-v1"))


def _lookup(name: str):
    """A Gather of rows of a (10, 4) table whose row i holds 4i … 4i + 3 (named: emulation is said once a name)."""
    table = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table")
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["y"])], name,
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "n", 4])], [table])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_emulated_model_runs_from_threads(aarch64_runtime):
    """Runs from several threads at once, each its own emulated process (racing first runs each export the
    library; one is kept)."""
    imported = tvmattn.import_onnx(_lookup("lookup-threads"), "aarch64")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda i: imported.run({"ids": np.array([[i, 9 - i]])})[0], range(6)))
    for i, out in enumerate(got):
        np.testing.assert_array_equal(out[0, :, 0], [4 * i, 4 * (9 - i)])


def test_emulated_model_says_so_once_and_reports_its_checks(aarch64_runtime, caplog):
    """An index the model checks at run time (a Gather's, out of its table) fails under emulation as it does
    here, as one line with the model's message; the emulation itself is said once, and profiling refused."""
    imported = tvmattn.import_onnx(_lookup("lookup-checked"), "aarch64")
    with caplog.at_level(logging.WARNING, logger="tvmattn.cross"):
        got = imported.run({"ids": np.array([[1, -1, 9]])})[0]
        np.testing.assert_array_equal(got, [[[4, 5, 6, 7], [36, 37, 38, 39], [36, 37, 38, 39]]])
        with pytest.raises(tvmattn.TvmAttnError, match=r"failed under qemu.*Gather.*indices lie in \[-10, 9\]"):
            imported.run({"ids": np.array([[1, 10]])})
    assert sum("qemu-user emulation" in r.message for r in caplog.records) == 1
    with pytest.raises(tvmattn.TvmAttnError, match="only emulated, which times nothing"):
        imported.profile({"ids": np.array([[1]])})


def test_import_checks_another_cpus_model_against_ort(aarch64_runtime, tmp_path, capsys):
    """`tvmattn import … --target aarch64 --mcpu … -o out/ --check`: the library, checked under emulation."""
    model, _ = export_onnx(AttentionSpec(**{**LAYER, "causal": True}), 23, 0)
    path = tmp_path / "layer.onnx"
    path.write_bytes(model.SerializeToString())
    argv = ["import", str(path), "--target", "aarch64", "--mcpu", "neoverse-v1", "-o", str(tmp_path), "--check",
            "--at", "n=9"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "layer.so").is_file() and out.splitlines()[-1].startswith("PASS at n=9")


@needs_tools
def test_runtime_without_a_wheel_is_one_line(monkeypatch, tmp_path):
    """riscv64 has no TVM wheel on PyPI, a named directory must hold both libraries, and qemu needs the
    C++ library TVM's runtime links: one line each."""
    monkeypatch.delenv(runtime.variable("riscv64"), raising=False)
    with pytest.raises(tvmattn.TvmAttnError, match=r"no riscv64 wheel .* \$TVMATTN_RUNTIME_RISCV64"):
        runtime.directory("riscv64")
    monkeypatch.setenv(runtime.variable("aarch64"), str(tmp_path))
    with pytest.raises(tvmattn.TvmAttnError, match=r"lacks libtvm_runtime.so and libtvm_ffi.so"):
        runtime.directory("aarch64")
    monkeypatch.setitem(toolchain.SYSROOT, "aarch64", (str(tmp_path), "libstdc++6-arm64-cross"))
    with pytest.raises(tvmattn.TvmAttnError, match=r"no libstdc\+\+.so.6 .*apt-get install libstdc\+\+6-arm64-cross"):
        toolchain.sysroot("aarch64")
