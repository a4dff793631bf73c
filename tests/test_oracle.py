"""The NumPy oracle itself, checked against PyTorch's SDPA and hand-derived masks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import specs

from tvmattn import AttentionSpec
from tvmattn.compiler import arguments
from tvmattn.compiler.oracle import alibi_bias, allowed_keys, core, reference

torch = pytest.importorskip("torch")


def _sdpa(q, k, v, **kw):
    t = [torch.from_numpy(x) for x in (q, k, v)]
    return torch.nn.functional.scaled_dot_product_attention(*t, **kw).numpy()


@pytest.mark.parametrize("causal", [False, True])
def test_core_matches_torch_sdpa(causal):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 7, 5)) for _ in range(3))
    spec = AttentionSpec(seq_len=7, num_heads=3, head_dim=5, causal=causal, projections=False)
    np.testing.assert_allclose(core(spec, q, k, v), _sdpa(q, k, v, is_causal=causal), rtol=1e-10, atol=1e-12)


def test_gqa_matches_torch_with_repeated_heads():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 6, 4, 8))
    k, v = (rng.standard_normal((1, 2, 9, 8)) for _ in range(2))
    spec = AttentionSpec(seq_len=4, kv_seq_len=9, num_heads=6, num_kv_heads=2, head_dim=8, projections=False)
    want = _sdpa(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))
    np.testing.assert_allclose(core(spec, q, k, v), want, rtol=1e-10, atol=1e-12)


def test_full_layer_matches_torch_multihead_attention():
    rng = np.random.default_rng(2)
    d, h, n = 16, 4, 5
    x = rng.standard_normal((2, n, d))
    w_q, w_k, w_v, w_o = (rng.standard_normal((d, d)) / 4 for _ in range(4))
    mha = torch.nn.MultiheadAttention(d, h, bias=False, batch_first=True, dtype=torch.float64)
    with torch.no_grad():  # torch computes x·Wᵀ: hand it the transposes of our (in, out) weights
        mha.in_proj_weight.copy_(torch.from_numpy(np.concatenate([w_q.T, w_k.T, w_v.T])))
        mha.out_proj.weight.copy_(torch.from_numpy(w_o.T))
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        want = mha(*[torch.from_numpy(x)] * 3, attn_mask=mask, need_weights=False)[0].numpy()
    spec = AttentionSpec(batch=2, seq_len=n, d_model=d, num_heads=h, causal=True)
    np.testing.assert_allclose(reference(spec, x, w_q, w_k, w_v, w_o), want, rtol=1e-10, atol=1e-12)


def test_masks_by_hand():
    def keys(**fields):
        spec = AttentionSpec(num_heads=1, head_dim=4, projections=False, **fields)
        return allowed_keys(spec, 1, 3, 5, None)[0, 0].astype(int).tolist()

    assert keys(causal=True) == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert keys(causal=True, causal_align="bottom_right") == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert keys(causal=True, window=2) == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0]]
    assert keys(window=2) == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0]]


def test_padding_and_rows_that_see_nothing_give_zeros():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 1, 3, 4)) for _ in range(3))
    spec = AttentionSpec(batch=2, seq_len=3, num_heads=1, head_dim=4, key_padding=True, projections=False)
    out = core(spec, q, k, v, kv_lens=np.array([0, 2]))
    assert np.all(out[0] == 0)
    np.testing.assert_allclose(out[1], _sdpa(q[1:], k[1:, :, :2], v[1:, :, :2])[0], rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_sinks_scale_torch_sdpa_by_the_weight_the_keys_keep(causal):
    """With a sink s per head, the keys' weights sum to Σexp / (Σexp + e^s) = sigmoid(logsumexp − s): the
    output is SDPA's times that (s = 0: ONNX Runtime's smooth softmax), and a row that sees no key is 0."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, 6, 4)) for _ in range(3))
    sinks = np.array([0.0, 2.5, -1.0])
    spec = AttentionSpec(batch=2, seq_len=6, num_heads=3, head_dim=4, causal=causal, projections=False, sinks=True)
    scores = torch.from_numpy(q @ k.transpose(0, 1, 3, 2) / 2.0)
    if causal:
        scores = scores.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), -torch.inf)
    kept = torch.sigmoid(torch.logsumexp(scores, -1, keepdim=True) - torch.from_numpy(sinks)[:, None, None]).numpy()
    want = _sdpa(q, k, v, is_causal=causal) * kept
    np.testing.assert_allclose(core(spec, q, k, v, sinks=sinks), want, rtol=1e-10, atol=1e-12)
    padded = spec.replace(causal=False, key_padding=True)
    assert np.all(core(padded, q, k, v, kv_lens=np.array([0, 6]), sinks=sinks)[0] == 0)


def _alibi_as_flash_attention(slopes, n, n_kv, lens, causal):
    """FlashAttention's own test reference (``attn_bias_from_alibi_slopes``): causal, slope·(j − (n_kv − 1)),
    a constant per row off its signed distance; else −slope·|i + L − n − j|, L the valid key count."""
    if causal:
        return slopes[None, :, None, None] * (np.arange(n_kv) - (n_kv - 1))[None, None, None, :]
    i, j = np.arange(n)[:, None], np.arange(n_kv)[None, :]
    distance = np.abs(i + lens[:, None, None] - n - j)[:, None]  # (B, 1, n, n_kv)
    return -slopes[None, :, None, None] * distance


@pytest.mark.parametrize("alibi, causal", [("signed", True), ("symmetric", True), ("symmetric", False)])
def test_alibi_matches_flash_attentions_bias_in_torch_sdpa(alibi, causal):
    """ALiBi as FlashAttention defines it (bottom-right aligned), given to SDPA as a float mask; with
    padded keys for the symmetric form, whose distances then count from each sequence's last key."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 5, 8))
    k, v = (rng.standard_normal((2, 2, 9, 8)) for _ in range(2))
    slopes = 2.0 ** -np.arange(1, 5)
    lens = np.array([9, 9]) if causal else np.array([6, 9])
    spec = AttentionSpec(batch=2, seq_len=5, kv_seq_len=9, num_heads=4, num_kv_heads=2, head_dim=8, causal=causal,
                         causal_align="bottom_right", key_padding=not causal, projections=False, alibi=alibi)
    bias = _alibi_as_flash_attention(slopes, 5, 9, lens, causal)
    keep = allowed_keys(spec, 2, 5, 9, lens)
    want = _sdpa(q, np.repeat(k, 2, 1), np.repeat(v, 2, 1), attn_mask=torch.from_numpy(np.where(keep, bias, -np.inf)))
    got = core(spec, q, k, v, kv_lens=lens if spec.key_padding else None, alibi_slopes=slopes)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_alibi_by_hand():
    """One head, slope 1/2, two queries over three keys (top-left): the bias is slope·(j − i) signed,
    −slope·|j − i| symmetric; BLOOM's slope·j is the signed one plus slope·i in row i."""
    spec = AttentionSpec(seq_len=2, kv_seq_len=3, num_heads=1, head_dim=4, projections=False, alibi="signed")
    assert alibi_bias(spec, [0.5], 1, 2, 3, None)[0, 0].tolist() == [[0, 0.5, 1], [-0.5, 0, 0.5]]
    assert alibi_bias(spec.replace(alibi="symmetric"), [0.5], 1, 2, 3, None)[0, 0].tolist() == [
        [0, -0.5, -1], [-0.5, 0, -0.5]]
    assert alibi_bias(spec, [0.5], 1, 2, 3, None, keys_only=True)[0, 0].tolist() == [[0, 0.5, 1], [0, 0.5, 1]]
    bottom = spec.replace(causal_align="bottom_right", key_padding=True)  # query i sits at i + L − n
    assert alibi_bias(bottom, [0.5], 1, 2, 3, np.array([2]))[0, 0].tolist() == [[0, 0.5, 1], [-0.5, 0, 0.5]]
    assert alibi_bias(bottom, [0.5], 1, 2, 3, np.array([3]))[0, 0].tolist() == [[-0.5, 0, 0.5], [-1, -0.5, 0]]


@settings(max_examples=60, deadline=None)
@given(specs().filter(lambda s: s.alibi == "signed" and not s.sinks and s.output in ("attn", "weights")),
       st.integers(0, 2**16))
def test_alibi_both_signed_formulations_agree(spec, seed):
    """slope·(j − pos(i)) and BLOOM's slope·j differ by a constant per row, which no softmax sees (a sink
    or a logits output would: those take the first)."""
    sizes = {name: 5 + 7 * i for i, name in enumerate(spec.symbolic_dims)}
    arrays, named = arguments.split(spec, arguments.draw(spec, sizes, seed))
    want = reference(spec, *arrays, **named)
    np.testing.assert_allclose(reference(spec, *arrays, **named, alibi_keys_only=True), want, rtol=1e-9, atol=1e-12)
