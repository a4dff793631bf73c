"""tvmattn's decode kernel in TVM's own paged KV cache (`tvmattn.compiler.mlc`): the cache is driven through its
runtime operations (add, fork and remove sequences, begin/end forward, attention with fused QKV, pop)
with every kernel TVM's own except the decode one, and each decode step's output is checked against a
float64 reference of the keys the test appended, and against the same cache on TVM's decode kernel."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm
from tvm.relax.frontend.nn.llm import kv_cache as tk
from tvm_ffi import Shape

from tvmattn import TvmAttnError
from tvmattn.compiler import mlc
from tvmattn.compiler.target import host_target

LAYERS, HEADS, KV_HEADS, PAGE, SEQS, MAX_LEN, CHUNK = 2, 8, 2, 16, 8, 1024, 256
CPU = tvm.cpu()
TOLERANCE = {"float32": 1e-4, "float16": 2e-3}


def _built(func: tvm.tirx.PrimFunc):
    return tvm.compile(tvm.IRModule({"main": func}), host_target())["main"]


@functools.cache
def _functions(d: int, dtype: str, ours: bool) -> list:
    """The kernels `create` hands the cache, in its order: decode, prefill over pages and ragged prefill
    tvmattn's (``ours``, each called through a counter) or TVM's, the rest TVM's."""
    calls = {}

    def counted(name: str, func: tvm.tirx.PrimFunc):  # the cache calls our kernels through these
        kernel = _built(func)

        def call(*args):
            calls[name] = calls.get(name, 0) + 1
            return kernel(*args)
        return tvm.runtime.convert(call) if ours else kernel

    source = mlc if ours else tk
    decode = source.attention_decode_cpu if ours else tk._attention_decode_cpu
    prefill = source.attention_prefill_cpu if ours else tk._attention_prefill_cpu
    ragged = source.attention_prefill_ragged_cpu if ours else tk._attention_prefill_ragged_cpu
    return [_built(tk._kv_cache_transpose_append(KV_HEADS, d, dtype)), None,
            ["tirx", counted("ragged", ragged(KV_HEADS, HEADS, d, d, dtype, {}))],
            ["tirx", counted("prefill", prefill(KV_HEADS, HEADS, d, dtype, False, {}))],
            ["tirx", counted("decode", decode(KV_HEADS, HEADS, d, dtype, False, {}))],
            ["tirx", _built(tk._attention_prefill_cpu(KV_HEADS, HEADS, d, dtype, True, {}))],
            ["tirx", _built(tk._attention_decode_cpu(KV_HEADS, HEADS, d, dtype, True, {}))],
            ["tirx", _built(tk.tree_attn_with_paged_kv_cache_cpu(KV_HEADS, HEADS, d, dtype, {}))],
            ["tirx", _built(tk.tree_attn_cpu(KV_HEADS, HEADS, d, dtype, {}))], [],
            [_built(tk._merge_state_inplace_cpu(dtype))],
            _built(tk.llama_rope_with_position_map(1e4, 1.0, d, HEADS, KV_HEADS, dtype, {})),
            _built(tk._copy_single_page_cpu(KV_HEADS, PAGE, d, dtype)),
            _built(tk._kv_cache_debug_get_kv(LAYERS, KV_HEADS, d, dtype)),
            _built(tk._compact_kv_copy_cpu(KV_HEADS, d, dtype)), calls]


def _cache(d: int, dtype: str, ours: bool):
    f = _functions(d, dtype, ours)
    create = tvm.get_global_func("vm.builtin.paged_attention_kv_cache_create")
    return create(Shape([SEQS, MAX_LEN, CHUNK, PAGE, 0]), Shape([0, LAYERS]), HEADS, KV_HEADS, d, d,
                  Shape([int(tk.AttnKind.MHA)] * LAYERS), False, 0, 1.0, 1e4, None,  # rope mode NONE
                  tvm.runtime.empty((), dtype, device=CPU), *f[:-1])


def _op(name: str):
    return tvm.get_global_func(f"vm.builtin.{name}")


def _step(caches, keys: dict, values: dict, batch: list[tuple[int, int]], d: int, dtype: str, rng) -> None:
    """One forward of ``batch`` ((sequence, new tokens) each) on every cache; the outputs of the decode
    steps (one token each) against the float64 reference and each other."""
    for cache in caches:
        _op("kv_state_begin_forward")(cache, Shape([s for s, _ in batch]), Shape([n for _, n in batch]), None)
    new = {s: [rng.standard_normal((n, h, d)).astype(dtype) for h in (HEADS, KV_HEADS, KV_HEADS)]
           for s, n in batch}
    for layer in range(LAYERS):
        qkv = np.concatenate([np.concatenate(new[s], axis=1) for s, _ in batch])
        outs = []
        for cache in caches:
            out = tvm.runtime.empty((qkv.shape[0], HEADS, d), dtype, device=CPU)
            _op("attention_kv_cache_attention_with_fused_qkv")(cache, layer, d ** -0.5,
                                                              tvm.runtime.tensor(qkv, CPU), out)
            outs.append(out.numpy().astype(np.float64))
        row = 0
        for s, n in batch:
            keys[s][layer] = np.concatenate([keys[s][layer], new[s][1]])
            values[s][layer] = np.concatenate([values[s][layer], new[s][2]])
            for i in range(n):  # query i sees the sequence's keys up to its own position
                length = len(keys[s][layer]) - n + i + 1
                want = _attend(new[s][0][i], keys[s][layer][:length], values[s][layer][:length], d)
                for got in outs:
                    assert np.abs(got[row + i] - want).max() <= TOLERANCE[dtype] * max(np.abs(want).max(), 1.0)
            row += n
        np.testing.assert_allclose(outs[0], outs[-1], rtol=0, atol=TOLERANCE[dtype] * 4)
    for cache in caches:
        _op("kv_state_end_forward")(cache)


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, d: int) -> np.ndarray:
    """One query (h, d) over all of a sequence's keys (L, h_kv, d), in float64."""
    g = HEADS // KV_HEADS
    k, v = (np.repeat(x.astype(np.float64), g, axis=1) for x in (k, v))
    logits = np.einsum("hd,lhd->hl", q.astype(np.float64), k) * d ** -0.5
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("hl,lhd->hd", w / w.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("d,dtype", [(64, "float32"), pytest.param(128, "float16", marks=pytest.mark.slow)])
def test_tvmattn_kernels_in_tvms_paged_cache(d, dtype):
    rng = np.random.default_rng(0)
    caches = [_cache(d, dtype, True), _cache(d, dtype, False)]
    calls = _functions(d, dtype, True)[-1]
    keys, values = {}, {}
    for s in range(4):
        for cache in caches:
            _op("kv_state_add_sequence")(cache, s)
        keys[s], values[s] = ([np.zeros((0, KV_HEADS, d), dtype)] * LAYERS for _ in range(2))
    _step(caches, keys, values, [(0, 37), (1, 1), (2, 100), (3, 16)], d, dtype, rng)  # first prompts
    for _ in range(3):
        _step(caches, keys, values, [(0, 1), (1, 1), (2, 1), (3, 1)], d, dtype, rng)
    _step(caches, keys, values, [(1, 20), (3, 1), (0, 7)], d, dtype, rng)  # prefill chunks after a history
    for cache in caches:  # a fork sharing sequence 2's pages, a removal, a pop
        _op("kv_state_fork_sequence")(cache, 2, 4, -1)
        _op("kv_state_remove_sequence")(cache, 1)
        _op("kv_state_popn")(cache, 0, 5)
    keys[4], values[4] = list(keys[2]), list(values[2])
    keys[0], values[0] = [k[:-5] for k in keys[0]], [v[:-5] for v in values[0]]
    _step(caches, keys, values, [(2, 1), (4, 1), (0, 1)], d, dtype, rng)
    _step(caches, keys, values, [(3, 1)], d, dtype, rng)
    # every kernel of ours ran: the new tokens among themselves (ragged), over the pages of a history
    # (prefill, merged with the ragged part by the lse), the decode steps (after the fork, the shared
    # pages apart and merged by the lse too)
    assert set(calls) == {"ragged", "prefill", "decode"}, calls


def test_the_sliding_window_variant_is_refused():
    with pytest.raises(TvmAttnError, match="sliding-window"):
        mlc.attention_decode_cpu(KV_HEADS, HEADS, 64, "float32", True, {})


def test_in_tir_paged_kv_cache_swaps_the_kernels():
    with mlc.in_tir_paged_kv_cache():
        ours = [tk._attention_decode_cpu(KV_HEADS, HEADS, 64, "float32", False, {}),
                tk._attention_prefill_cpu(KV_HEADS, HEADS, 64, "float32", False, {}),
                tk._attention_prefill_ragged_cpu(KV_HEADS, HEADS, 64, 64, "float32", {})]
        window = tk._attention_decode_cpu(KV_HEADS, HEADS, 64, "float32", True, {})
    assert all("tirx.noalias" in f.attrs for f in ours)  # (tvmattn's; TVM's do not say it)
    assert [str(f.attrs["global_symbol"]) for f in ours] == [
        "batch_decode_paged_kv_cpu", "batch_prefill_paged_kv_cpu", "batch_prefill_ragged_kv"]
    assert window.attrs["global_symbol"] == "batch_decode_paged_kv_cpu_sliding_window"
    assert all(getattr(tk, n).__module__.startswith("tvm.") for n in (
        "_attention_decode_cpu", "_attention_prefill_cpu", "_attention_prefill_ragged_cpu"))
