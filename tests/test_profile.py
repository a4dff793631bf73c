"""`ImportedModel.profile` / `tvmattn bench model.onnx --profile`: every compiled function of a run with
its schedule rule, and its FLOPs and bytes as the graph's shapes give them (counted here by hand)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

import tvmattn
from tvmattn.compiler.cli import main
from tvmattn.models import onnx_models

B, N, D, W = 2, 33, 64, 96


def dense_model() -> onnx.ModelProto:
    """y = relu(x · W + b), then LayerNorm: a GEMM and a row reduction."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((D, W)).astype(np.float32), "w"),
             nh.from_array(rng.standard_normal(W).astype(np.float32), "b"),
             nh.from_array(np.ones(W, np.float32), "g"), nh.from_array(np.zeros(W, np.float32), "beta")]
    nodes = [oh.make_node("MatMul", ["x", "w"], ["xw"]), oh.make_node("Add", ["xw", "b"], ["h"]),
             oh.make_node("Relu", ["h"], ["r"]), oh.make_node("LayerNormalization", ["r", "g", "beta"], ["y"])]
    graph = oh.make_graph(nodes, "dense", [oh.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq", D])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, ["batch", "seq", W])], initializer=inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_profile_counts_each_function():
    imported = tvmattn.import_onnx(dense_model())
    x = np.random.default_rng(1).standard_normal((B, N, D)).astype(np.float32)
    prof = imported.profile({"x": x})
    compiled = {f.name: f for f in prof.functions if f.rule != "vm"}
    assert set(compiled) == set(imported.report.rule_of)  # every function the model runs, each once
    assert all(f.calls == 1 and f.ms >= 0 for f in compiled.values())
    gemm, = (f for f in compiled.values() if f.rule == "matmul")
    assert gemm.flops == 2 * B * N * D * W  # the MatMul's multiply-adds; the bias and ReLU count none
    # its arguments: x, W (packed at compile time into whole column tiles: at most 63 more columns), b, y
    unpacked = 4 * (B * N * D + D * W + W + B * N * W)
    assert unpacked <= gemm.bytes <= unpacked + 4 * D * 63
    norm, = (f for f in compiled.values() if f.rule == "reduction")
    assert norm.flops == 0 and norm.bytes >= 4 * 2 * B * N * W
    assert prof.run_ms > 0 and "matmul" in prof.by_rule


def test_profile_counts_attention_as_flashattention_does():
    """A causal attention kernel's FLOPs: 4·d_k per (query, key) pair a query sees."""
    imported = tvmattn.import_onnx(onnx_models.gpt2_block())
    x = np.random.default_rng(2).standard_normal((1, 40, 64)).astype(np.float32)
    kernel, = (f for f in imported.profile({"x": x}).functions if f.rule == "attention")
    assert kernel.flops == 4 * 16 * 4 * (40 * 41 // 2)  # d_k 16, 4 heads, causal pairs of 40 queries


def test_cli_bench_profile(tmp_path, capsys):
    path = tmp_path / "dense.onnx"
    onnx.save(dense_model(), path)
    assert main(["bench", str(path), "--at", "batch=2", "--at", "seq=33", "--budget", "0.05", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "tvmattn by function" in out and "matmul" in out and "GFLOP/s" in out
