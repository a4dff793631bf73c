"""`tvmattn bench` runs every implementation on the same inputs and reports what it measured
(nothing here asserts a speed: timings belong to benchmarks, not tests)."""

import json

import pytest

from tvmattn import AttentionSpec
from tvmattn.compiler import bench
from tvmattn.compiler.cli import main

SMALL = [
    AttentionSpec(batch=1, seq_len=64, num_heads=2, head_dim=16, causal=True, projections=False),
    AttentionSpec(batch=2, seq_len=48, num_heads=4, num_kv_heads=2, head_dim=8, window=9, key_padding=True,
                  projections=False),
]


@pytest.mark.parametrize("spec", SMALL, ids=["causal", "gqa-window-padding"])
def test_every_implementation_agrees_with_the_oracle(spec):
    rows = {r.impl: r for r in bench.bench(spec, budget_s=0.05)}
    assert rows["tvmattn"].ms > 0 and rows["tvmattn"].max_rel_error < 1e-4
    for name in bench.PEERS:
        row = rows[name]
        if row.ms is None:  # a peer that is not installed says so
            assert row.note in ("not installed",) or row.note.startswith("skipped")
            continue
        assert row.max_rel_error < 1e-4, name
        assert row.gflops == pytest.approx(bench.flops(spec) / row.ms / 1e6)


def test_full_layer_rows_and_flops():
    spec = AttentionSpec(batch=1, seq_len=32, d_model=32, num_heads=2, causal=True)
    B, n, d, h, d_k = 1, 32, 32, 2, 16
    assert bench.flops(spec) == 4 * (2 * B * n * d * d) + 4 * B * h * n * n * d_k  # projections + core
    rows = {r.impl: r for r in bench.bench(spec, peers=("torch", "onnxruntime"), budget_s=0.05)}
    assert rows["tvmattn"].max_rel_error < 1e-4
    assert rows["onnxruntime"].note.startswith("skipped")


def test_cli_table_json_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["bench", "--seq", "32", "--heads", "2", "--head-dim", "16", "--no-projections", "--peers", "numpy",
                 "--budget", "0.05", "--json", str(out_json), "--plot", str(out_png)])
    text = capsys.readouterr().out
    assert code == 0 and "GFLOP/s" in text and "tvmattn ×" in text and "numpy" in text
    data = json.loads(out_json.read_text())
    assert {r["impl"] for r in data["results"]} == {"tvmattn", "numpy"} and data["fp32_peak_gflops"] > 0
    assert out_png.stat().st_size > 0


def test_unknown_peer_and_symbolic_spec(capsys):
    assert main(["bench", "--seq", "8", "--d-model", "16", "--peers", "jax"]) == 2
    assert "unknown peer" in capsys.readouterr().err
    assert main(["bench", "--seq", "n", "--d-model", "16"]) == 2
    assert "concrete sizes" in capsys.readouterr().err
