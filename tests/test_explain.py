"""`explain`: the shape trace of the seeds, with FLOPs counted by hand here."""

from tvmattn import AttentionSpec
from tvmattn.compiler.explain import parameters, report, trace


def test_full_layer_trace_shapes_and_counts():
    B, n, d, h = 2, 10, 48, 4
    d_k = d // h
    rows = {r.name.split(" ")[0]: r for r in trace(AttentionSpec(batch=B, seq_len=n, d_model=d, num_heads=h))}
    assert rows["q_proj"].shape == (B, n, d)
    assert rows["head"].shape == (B, h, n, d_k)
    assert rows["scores"].shape == (B, h, n, n) and rows["scores"].flops == 2 * B * h * n * n * d_k
    assert rows["weights·v"].shape == (B, h, n, d_k)
    assert rows["merge"].shape == (B, n, d)
    assert rows["out"].shape == (B, n, d) and rows["out"].flops == 2 * B * n * d * d
    assert parameters(AttentionSpec(d_model=d, num_heads=h)) == 4 * d * d


def test_gqa_has_fewer_parameters_and_shows_the_group():
    spec = AttentionSpec(d_model=64, num_heads=8, num_kv_heads=2)
    assert parameters(spec) == 64 * 64 * 2 + 2 * 64 * 16
    assert any("4 query heads per k/v head" in r.note for r in trace(spec))


def test_report_totals_and_intensity():
    text = report(AttentionSpec(batch=1, seq_len=128, d_model=64, num_heads=4, causal=True))
    assert "parameters 16.38K = 4·d²" in text
    assert "arithmetic intensity" in text and "causal top-left" in text


def test_report_counts_the_useful_flops_of_a_causal_core():
    causal = AttentionSpec(batch=1, seq_len=128, num_heads=4, head_dim=16, causal=True, projections=False)
    # 4·h·d_k·(128·129/2 pairs) = 2,113,536 of the dense 4·h·d_k·128² = 4,194,304
    assert "2.11M, 50% of the dense 4.19M" in report(causal)
    assert "useful matmul FLOPs" not in report(causal.replace(causal=False))  # dense: nothing hidden


def test_symbolic_sizes_need_values():
    spec = AttentionSpec(seq_len="n", d_model=64, num_heads=4, projections=False)
    assert "give the symbolic sizes" in report(spec)
    assert "arithmetic intensity" in report(spec, {"n": 256})
