"""`tvmattn bench` runs every implementation on the same inputs and reports what it measured
(nothing here asserts a speed: timings belong to benchmarks, not tests)."""

import json

import numpy as np
import pytest

from tvmattn import AttentionSpec
from tvmattn.compiler import bench
from tvmattn.compiler.cli import main
from tvmattn.compiler.explain import useful_flops
from tvmattn.compiler.oracle import reference
from tvmattn.compiler.verify import TOLERANCE, random_inputs

SMALL = [
    AttentionSpec(batch=1, seq_len=64, num_heads=2, head_dim=16, causal=True, projections=False),
    AttentionSpec(batch=2, seq_len=48, num_heads=4, num_kv_heads=2, head_dim=8, window=9, key_padding=True,
                  projections=False),
    AttentionSpec(batch=2, seq_len=40, num_heads=2, head_dim=16, causal=True, attn_mask="bool",
                  attn_mask_dims="bst", projections=False),
    AttentionSpec(batch=1, seq_len=40, num_heads=2, head_dim=16, attn_mask="additive", projections=False),
]


def test_implementations_take_turns_round_by_round():
    """`bench.interleaved`: every implementation runs in every round, one turn each, in order (a slow
    spell of a shared machine then falls on all of them), and every run is timed."""
    calls = []
    runs = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    times = bench.interleaved(runs, budget_s=0.0, rounds=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # the warm-up, then a turn (one run here) per round
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3}


@pytest.mark.parametrize("spec", [pytest.param(s, marks=[] if i == 1 else [pytest.mark.slow])
                                  for i, s in enumerate(SMALL)],
                         ids=["causal", "gqa-window-padding", "bool-mask", "additive-mask"])
def test_every_implementation_agrees_with_the_oracle(spec):  # (-m slow: the causal and both mask cases too)
    rows = {r.impl: r for r in bench.bench(spec, budget_s=0.05)}
    assert rows["tvmattn"].ms > 0 and rows["tvmattn"].max_rel_error < 1e-4
    assert set(rows) == {"tvmattn", *bench.default_peers()}
    for name in bench.default_peers():
        row = rows[name]
        if row.ms is None:  # a peer that is not installed says so
            assert row.note in ("not installed",) or row.note.startswith("skipped")
            continue
        assert row.max_rel_error < 1e-4, name
        assert row.gflops == pytest.approx(useful_flops(spec) / row.ms / 1e6)


def _pairs(n: int, n_kv: int, sees) -> int:
    """(query, key) pairs ``sees(i, j)`` lets through, counted one by one."""
    return sum(sees(i, j) for i in range(n) for j in range(n_kv))


@pytest.mark.parametrize("spec, pairs", [
    (AttentionSpec(batch=2, seq_len=24, num_heads=3, head_dim=8, projections=False), 24 * 24),
    (AttentionSpec(batch=2, seq_len=24, num_heads=3, head_dim=8, causal=True, projections=False),
     24 * 25 // 2),
    (AttentionSpec(batch=1, seq_len=30, num_heads=2, head_dim=8, window=5, projections=False),
     _pairs(30, 30, lambda i, j: abs(i - j) < 5)),
    (AttentionSpec(batch=1, seq_len=30, num_heads=2, head_dim=8, window=5, causal=True, projections=False),
     _pairs(30, 30, lambda i, j: 0 <= i - j < 5)),
    (AttentionSpec(batch=1, seq_len=1, kv_seq_len=40, num_heads=4, head_dim=8, causal=True,
                   causal_align="bottom_right", projections=False), 40),  # decode: the query sees every key
    (AttentionSpec(batch=3, seq_len=16, num_heads=2, head_dim=8, key_padding=True, projections=False), 16 * 16),
], ids=["dense", "causal", "window", "causal-window", "decode", "key-padding"])
def test_flops_count_the_pairs_a_query_sees(spec, pairs):
    """GFLOP/s counts useful work, as FlashAttention does: 4·d_k per visible (query, key) pair and head."""
    assert useful_flops(spec) == 4 * spec.batch * spec.h * spec.d_k * pairs


def test_full_layer_rows_and_flops():
    spec = AttentionSpec(batch=1, seq_len=32, d_model=32, num_heads=2, causal=True)
    B, n, d, h, d_k = 1, 32, 32, 2, 16
    assert useful_flops(spec) == 4 * (2 * B * n * d * d) + 4 * B * h * (n * (n + 1) // 2) * d_k  # projections + core
    rows = {r.impl: r for r in bench.bench(spec, peers=("torch", "onnxruntime"), budget_s=0.05)}
    assert rows["tvmattn"].max_rel_error < 1e-4
    assert rows["onnxruntime"].note.startswith("skipped")


def test_cli_table_and_json(capsys, tmp_path):
    out_json = tmp_path / "r.json"
    code = main(["bench", "--seq", "32", "--heads", "2", "--head-dim", "16", "--no-projections", "--peers", "numpy",
                 "--budget", "0.05", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert code == 0 and "GFLOP/s" in text and "tvmattn ×" in text and "numpy" in text
    data = json.loads(out_json.read_text())
    assert {r["impl"] for r in data["results"]} == {"tvmattn", "numpy"} and data["peak_gflops"] > 0
    assert "bf16" not in data["peak_measured_with"]  # fp32 values: fp32 arithmetic's peak


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "r.png"
    assert main(["bench", "--seq", "32", "--heads", "2", "--head-dim", "16", "--no-projections", "--peers", "numpy",
                 "--budget", "0.05", "--plot", str(out_png)]) == 0
    assert out_png.stat().st_size > 0


def test_unknown_peer_and_symbolic_spec(capsys):
    assert main(["bench", "--seq", "8", "--d-model", "16", "--peers", "jax"]) == 2
    assert "unknown peer" in capsys.readouterr().err
    assert main(["bench", "--seq", "n", "--d-model", "16"]) == 2
    assert "concrete sizes" in capsys.readouterr().err


# ---- peers on their own, against the float64 oracle (no tvmattn build) -------------------------------
def _peer_error(name: str, spec: AttentionSpec) -> tuple[float, str]:
    """max rel error of peer ``name`` on ``spec``'s seeded inputs, over the rows that see a key."""
    args = random_inputs(spec, seed=0)
    fn, what = bench.PEERS[name](spec, args)
    out = np.asarray(bench._to_numpy(fn()), dtype=np.float64)
    ref = reference(spec, args["q"], args["k"], args["v"], kv_lens=args.get("kv_lens"), attn_mask=args.get("attn_mask"))
    return bench._error(out, ref, bench._rows_that_see_keys(spec, args)), what


CORE = dict(batch=1, seq_len=32, num_heads=2, head_dim=16, projections=False)
PEER_SPECS = {
    "plain": AttentionSpec(**CORE),
    "causal": AttentionSpec(**CORE, causal=True),
    "mask-padding": AttentionSpec(**{**CORE, "batch": 2}, key_padding=True),  # a mask input: _mask is not None
    "mask-gqa-window-padding": SMALL[1],
}


@pytest.mark.parametrize("case", PEER_SPECS)
def test_openvino_matches_the_oracle_at_fp32(case):
    pytest.importorskip("openvino")
    spec = PEER_SPECS[case]
    assert (bench._mask(spec, random_inputs(spec)) is not None) == case.startswith("mask")
    err, what = _peer_error("openvino", spec)
    assert err < TOLERANCE["float32"], what
    assert "f32 inference precision, fp32 I/O" in what


@pytest.mark.parametrize("case", ["causal", "mask-gqa-window-padding"])
def test_openvino_matches_the_oracle_at_bf16(case):
    """The label names the precision OpenVINO runs at: bf16 where its CPU plugin reports the
    capability (AVX512-BF16, AMX), else f32 with the bf16 asked for (AVX2)."""
    ov = pytest.importorskip("openvino")
    err, what = _peer_error("openvino", PEER_SPECS[case].replace(dtype="bfloat16"))
    assert err < TOLERANCE["bfloat16"], what
    has_bf16 = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    expected = "bf16 inference precision, fp32 I/O" if has_bf16 else "f32 inference precision (bf16 asked), fp32 I/O"
    assert expected in what, what


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_torch_and_numpy_peers_take_16_bit_inputs(dtype):
    spec = PEER_SPECS["mask-gqa-window-padding"].replace(dtype=dtype)
    for name in ("torch", "numpy"):
        if name == "torch":
            pytest.importorskip("torch")
        err, what = _peer_error(name, spec)
        assert err < TOLERANCE[dtype], (name, what)


def test_a_dtype_a_peer_cannot_do_is_skipped_with_a_note():
    pytest.importorskip("onnxruntime")
    spec = PEER_SPECS["causal"].replace(dtype="bfloat16")
    with pytest.raises(NotImplementedError, match="no bfloat16 Attention"):
        bench.onnxruntime_impl(spec, random_inputs(spec))
    err, what = _peer_error("onnxruntime", spec.replace(dtype="float16"))
    assert err < TOLERANCE["float16"] and "float16" in what


def test_bf16_bench_runs_every_peer_or_says_why_not():
    spec = AttentionSpec(**CORE, causal=True, dtype="bfloat16")
    rows = {r.impl: r for r in bench.bench(spec, peers=tuple(bench.PEERS), budget_s=0.01)}
    for name, row in rows.items():
        if row.ms is None:
            assert row.note == "not installed" or row.note.startswith("skipped: "), name
            continue
        assert row.max_rel_error < TOLERANCE["bfloat16"], (name, row.note)
    assert rows["tvmattn"].ms is not None


def test_openvino_is_a_default_peer_only_where_installed(monkeypatch):
    monkeypatch.setattr(bench, "find_spec", lambda name: None)
    assert "openvino" not in bench.default_peers() and "torch" in bench.default_peers()


def test_the_suite_takes_the_dtype():
    """`tvmattn bench --suite default --dtype bf16` benchmarks every suite shape in bf16."""
    assert {spec.dtype for spec in bench.suite("default", "bf16")} == {"bfloat16"}
