"""export_onnx and the CLI's export-onnx / import: ONNX Runtime on the exported model against the
tvmattn kernel with the same weights, and the exported model imported back."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import every_other_slow
from onnx_testing import kernels_used, ort_run

import tvmattn
from tvmattn.compiler.cli import main
from tvmattn.compiler.onnx.export import export_onnx
from tvmattn.compiler.verify import random_inputs

SPECS = {
    "layer-causal": tvmattn.AttentionSpec(batch="B", seq_len=8, d_model=32, num_heads=4, causal=True),
    "layer-gqa-window": tvmattn.AttentionSpec(batch=2, seq_len=6, d_model=32, num_heads=4, num_kv_heads=2,
                                              causal=True, window=3),
    "layer-cross": tvmattn.AttentionSpec(batch=2, seq_len=5, kv_seq_len=7, d_model=32, num_heads=4),
    "core-bshd-padding": tvmattn.AttentionSpec(batch=2, seq_len=5, kv_seq_len=9, num_heads=4, head_dim=8,
                                               projections=False, layout="BSHD", causal=True,
                                               causal_align="bottom_right", key_padding=True),
    "core-additive-softcap": tvmattn.AttentionSpec(batch=2, seq_len=5, num_heads=2, head_dim=8, projections=False,
                                                   attn_mask="additive", attn_mask_dims="bst", softcap=2.0),
    "core-bool-fp16": tvmattn.AttentionSpec(batch=2, seq_len=5, num_heads=2, head_dim=8, projections=False,
                                            attn_mask="bool", attn_mask_dims="st", dtype="float16"),
}


def _arguments(spec: tvmattn.AttentionSpec, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    args = {**random_inputs(spec, {d: 6 for d in spec.symbolic_dims}, seed=3), **weights}
    if spec.attn_mask == "bool":
        args["attn_mask"][..., 0] = True  # no row without a key (ORT's softmax gives NaN there)
    if spec.key_padding:
        args["kv_lens"] = np.maximum(args["kv_lens"], spec.n_kv - spec.n_q + 1)
    return args


@pytest.mark.parametrize("name,opset", every_other_slow(sorted(SPECS), [23, 17]))
def test_export_runs_in_onnx_runtime_like_the_kernel(name, opset):
    spec = SPECS[name]
    model, weights = export_onnx(spec, opset)
    assert ("Attention" in {n.op_type for n in model.graph.node}) == (opset >= 23)
    args = _arguments(spec, weights)
    feed = {i.name: args[i.name] for i in model.graph.input}
    want = ort_run(model, feed)[0].astype(np.float64)
    keywords = {n: args[n] for n in ("x_kv", "kv_lens", "attn_mask") if n in args}
    kernel = tvmattn.compile(spec)
    got = kernel(*(args[n] for n in spec.input_shapes() if n not in keywords), **keywords).astype(np.float64)
    tolerance = {"float32": 1e-5, "float16": 2e-3}[spec.dtype]
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    imported = tvmattn.import_onnx(model)
    assert kernels_used(imported) == 1, str(imported.report)
    np.testing.assert_allclose(imported.run(feed)[0].astype(np.float64), want, rtol=tolerance, atol=tolerance)


def test_export_rejects_an_opset_without_a_form():
    with pytest.raises(tvmattn.TvmAttnError, match="opset 20"):
        export_onnx(SPECS["layer-cross"], 20)


def test_cli_export_then_import_check(tmp_path, capsys):
    path = tmp_path / "gpt2.onnx"
    assert main(["export-onnx", "--preset", "gpt2-small", "--batch", "B", "--seq", "16", "-o", str(path)]) == 0
    model = onnx.load(path)
    assert [o.version for o in model.opset_import] == [23]
    assert main(["import", str(path), "--check", "-o", str(tmp_path / "lib"), "--at", "B=2"]) == 0
    out = capsys.readouterr().out
    assert "Attention converter" in out and "causal" in out and "PASS" in out
    assert (tmp_path / "lib" / "gpt2.so").exists()


def test_cli_import_check_of_a_decomposed_export(tmp_path, capsys):
    path = tmp_path / "llama.onnx"
    assert main(["export-onnx", "--preset", "llama-gqa", "--batch", "1", "--seq", "8", "--d-model", "64",
                 "--heads", "4", "--kv-heads", "2", "--opset", "17", "-o", str(path)]) == 0
    assert main(["import", str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "pattern: decomposed attention" in out and "h_kv=2" in out and "PASS" in out
