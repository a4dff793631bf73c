"""Paged decode (`tvmattn.PagedSpec`) against its peers, one process, interleaved rounds, ratios of one run:

    contiguous   tvmattn's dense decode kernel at the same total KV (B=4 × 900 keys, static shapes),
                 in the layout a page has (HND ~ BHSD, NHD ~ BSHD)
    uniform      the paged kernel on 4 sequences of 900 keys: the ragged batch's balance
    tvm          TVM's own paged-cache CPU decode kernel (TIRPagedKVCache's ``_attention_decode_cpu``),
                 on the same pages (its (pages, 2, h_kv, P, d) pool) and the same page table
    openvino     OpenVINO's CPU PagedAttention (``PagedAttentionExtension``) on pages of 32 (its CPU
                 plugin's size, HND), beside tvmattn's paged kernel on the same pages
    onnx         ONNX Runtime's com.microsoft.PagedAttention imported (`import_onnx`, NHD pages, its
                 layout): the decode step as a model runs it, each sequence's newest key and value
                 written into its page, then the attention

The workload is the issue's: B=4, lengths 2048/37/513/1000, 32 query / 8 KV heads, d=128, page 16.
Each kernel's result is checked against the paged oracle before timing. Run it alone
(``flock /tmp/bench.lock``) with ``TVM_NUM_THREADS`` set.

    python scripts/bench_paged.py [--rounds 7] [--dtypes float32 bfloat16] [--layouts HND NHD] [--no-tvm]
                                  [--no-openvino] [--prefill]

``--prefill`` adds the ragged prefill (causal, the same lengths) against tvmattn's dense kernel on the
batch padded to the longest, in useful GFLOP/s (not checked against the oracle here: tests do that),
and against TIRPagedKVCache's ragged prefill kernel (one call a round: it takes seconds).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import tvm
from onnx import TensorProto as TP
from onnx import helper as oh

import tvmattn
from tvmattn.compiler.arguments import numpy_dtype
from tvmattn.compiler.kernel import host_tensor
from tvmattn.compiler.onnx.bench import OV_PRECISION
from tvmattn.compiler.paged import with_unused
from tvmattn.compiler.target import cpu_cores
from tvmattn.compiler.verify import TOLERANCE, errors

LENGTHS = (2048, 37, 513, 1000)
PAUSE = 0.05  # seconds idle before each peer's turn
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def paged_inputs(spec: tvmattn.PagedSpec, lengths, seed: int = 0) -> dict[str, np.ndarray]:
    """The sequences' pages shuffled through one pool (as a server's cache is after a while)."""
    rng = np.random.default_rng(seed)
    page = spec.page_size
    width = max(-(-n // page) for n in lengths)
    pages = sum(-(-n // page) for n in lengths)
    order = rng.permutation(pages).astype(np.int32)
    table = np.zeros((len(lengths), width), np.int32)
    start = 0
    for b, n in enumerate(lengths):
        used = -(-n // page)
        table[b, :used] = order[start:start + used]
        start += used
    dt = numpy_dtype(spec.dtype)
    return {"q": rng.standard_normal((len(lengths), 1, HEADS, HEAD_DIM)).astype(dt),
            "k_cache": rng.standard_normal(spec.cache_shape(pages)).astype(dt),
            "v_cache": rng.standard_normal(spec.cache_shape(pages)).astype(dt),
            "block_table": table, "cache_seqlens": np.array(lengths, np.int32)}


def paged_peer(spec, lengths):
    kernel = tvmattn.compile(spec)
    args = paged_inputs(spec, lengths)
    out = np.empty(args["q"].shape, args["q"].dtype)
    positional = [args[n] for n in ("q", "k_cache", "v_cache", "block_table", "cache_seqlens")]
    check(kernel(*positional), tvmattn.paged_reference(spec, *positional), spec.dtype, f"paged {spec.kv_layout}")
    tensors = [host_tensor(a) for a in with_unused(spec, args).values()] + [host_tensor(out)]
    return lambda: kernel.run(*tensors)


def openvino_peer(spec: tvmattn.PagedSpec, lengths):
    """OpenVINO's CPU PagedAttention (``PagedAttentionExtension``, what vLLM's OpenVINO backend and
    openvino_genai's continuous batching run) on the same pages: its cache layout is HND with pages of
    32 (the CPU plugin's), the cache in ``spec.dtype`` (KV_CACHE_PRECISION), the block table as CSR.
    It writes each step's new key into the cache: fed the key already at position n − 1, it reads n."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino._pyopenvino.op import _PagedAttentionExtension

    heads, kv_heads, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    names = {"q": [-1, heads * d], "k": [-1, kv_heads * d], "v": [-1, kv_heads * d],
             "key_cache": [-1, kv_heads, spec.page_size, d], "value_cache": [-1, kv_heads, spec.page_size, d]}
    params = [ops.parameter(shape, ov.Type.f32, name=n) for n, shape in names.items()]
    params += [ops.parameter([-1], ov.Type.i32, name=n) for n in (
        "past_lens", "subsequence_begins", "block_indices", "block_indices_begins", "score_aggregation_window")]
    params.append(ops.parameter([], ov.Type.i32, name="max_context_len"))
    p = {param.get_friendly_name(): param for param in params}

    def const(value, dtype=np.int32, *shape):
        return ops.constant(np.full(shape, value, dtype))

    unused = [const(0, np.int32, 0), const(0, np.int32, 0), const(0, np.float32, 0), const(0, np.float32, 0),
              const(0), const(0), const(0, np.float32, 0), const(0), const(0, np.int32, 0), const(0, np.int32, 0),
              const(0, np.int32, 0), const(0, np.int32, 0), const(0, np.uint8, 0), const(0, np.int32, 0)]
    inputs = [p["q"], p["k"], p["v"], p["key_cache"], p["value_cache"], p["past_lens"], p["subsequence_begins"],
              p["block_indices"], p["block_indices_begins"], const(spec.scale or d ** -0.5, np.float32), const(0),
              const(0, np.float32, 0), p["max_context_len"], p["score_aggregation_window"], *unused]
    node = _PagedAttentionExtension([x.output(0) for x in inputs])
    for key, value in (("k_head_size", d), ("num_k_heads", kv_heads), ("v_head_size", d), ("num_v_heads", kv_heads)):
        node.get_rt_info()[key] = value
    precision = OV_PRECISION[spec.dtype]
    compiled = ov.Core().compile_model(ov.Model([node.output(0)], params), "CPU", {
        "INFERENCE_NUM_THREADS": cpu_cores(), "INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision})
    args = paged_inputs(spec, lengths)
    batch, n = len(lengths), np.array(lengths, np.int32)
    used = -(-n // spec.page_size)
    q = args["q"][:, 0].reshape(batch, heads * d).astype(np.float32)
    last = [(args["block_table"][b, (m - 1) // spec.page_size], (m - 1) % spec.page_size) for b, m in enumerate(n)]
    new_k, new_v = ([args[c][pg, :, off].reshape(-1).astype(np.float32) for pg, off in last]
                    for c in ("k_cache", "v_cache"))

    def cache(a):  # a 16-bit cache goes in as its bits
        return ov.Tensor(a.view(np.uint16), a.shape, ov.Type.bf16 if spec.dtype == "bfloat16" else ov.Type.f16) \
            if a.dtype.itemsize == 2 else ov.Tensor(a)

    feed = {"q": q, "k": np.stack(new_k), "v": np.stack(new_v), "key_cache": cache(args["k_cache"]),
            "value_cache": cache(args["v_cache"]), "past_lens": n - 1,
            "subsequence_begins": np.arange(batch + 1, dtype=np.int32),
            "block_indices": np.concatenate([args["block_table"][b, :u] for b, u in enumerate(used)]),
            "block_indices_begins": np.concatenate([[0], np.cumsum(used)]).astype(np.int32),
            "score_aggregation_window": np.zeros(batch, np.int32), "max_context_len": np.int32(n.max())}
    request = compiled.create_infer_request()
    out = np.asarray(request.infer(feed, share_inputs=True)[0]).reshape(batch, 1, heads, d)
    ref = tvmattn.paged_reference(spec, *(args[k] for k in ("q", "k_cache", "v_cache", "block_table", "cache_seqlens")))
    check(out, ref, spec.dtype, "OpenVINO PagedAttention")
    return lambda: request.infer(feed, share_inputs=True)


def contiguous_peer(dtype: str, layout: str, length: int):
    spec = tvmattn.AttentionSpec(batch=len(LENGTHS), seq_len=1, kv_seq_len=length, num_heads=HEADS,
                                 num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, layout=layout, dtype=dtype,
                                 projections=False)
    kernel = tvmattn.compile(spec)
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s).astype(numpy_dtype(dtype)) for s in spec.input_shapes().values()]
    out = np.empty(spec.output_shape(), numpy_dtype(dtype))
    check(kernel(*arrays), tvmattn.reference(spec, *arrays), dtype, f"contiguous {layout}")
    tensors = [host_tensor(a) for a in arrays] + [host_tensor(out)]
    return lambda: kernel.run(*tensors)


def tvm_peer(spec: tvmattn.PagedSpec, lengths):
    """TIRPagedKVCache's CPU decode kernel on the same pages: a (pages, 2, h_kv, P, d) pool, the page
    table as CSR (indptr, values), each sequence's last page's length."""
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_decode_cpu

    func = _attention_decode_cpu(KV_HEADS, HEADS, HEAD_DIM, spec.dtype, False, {}, PAGE)
    name = str(func.attrs["global_symbol"])
    fn = tvm.compile(tvm.IRModule({name: func}), target=tvmattn.compiler.target.host_target())[name]
    args = paged_inputs(spec.replace(kv_layout="HND"), lengths)
    pool = np.ascontiguousarray(np.stack([args["k_cache"], args["v_cache"]], axis=1))
    used = [-(-n // PAGE) for n in lengths]
    indptr = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
    values = np.concatenate([args["block_table"][b, :u] for b, u in enumerate(used)]).astype(np.int32)
    last = np.array([n - (u - 1) * PAGE if u else 0 for n, u in zip(lengths, used)], np.int32)
    q = np.ascontiguousarray(args["q"][:, 0])
    out = np.empty_like(q)
    lse = np.empty((len(lengths), HEADS), np.float32)
    zeros = np.zeros(len(lengths), np.int32)
    # (TVM's own kernels assume 64-byte aligned arguments: copies, not NumPy's memory)
    tensors = [tvm.runtime.tensor(a) for a in (q, pool, indptr, values, last, zeros, zeros, out, lse)]
    scale = 1.0 / np.sqrt(HEAD_DIM)
    fn(*tensors, 0, 1.0, 1e4, scale)
    out = tensors[7].numpy()
    ref = tvmattn.paged_reference(spec.replace(kv_layout="HND"), *(args[n] for n in (
        "q", "k_cache", "v_cache", "block_table", "cache_seqlens")))
    check(out[:, None], ref, spec.dtype, "TVM TIRPagedKVCache")
    return lambda: fn(*tensors, 0, 1.0, 1e4, scale)


def onnx_peer(spec: tvmattn.PagedSpec, lengths):
    """The imported PagedAttention node on the paged kernel's inputs: past = length − 1, the new token's
    key and value the ones already in its slot (so every call writes the same values)."""
    args = paged_inputs(spec, lengths)
    t = oh.np_dtype_to_tensor_dtype(numpy_dtype(spec.dtype))
    tokens, b = len(lengths), len(lengths)
    shapes = {"query": (t, [tokens, HEADS * HEAD_DIM]), "key": (t, [tokens, KV_HEADS * HEAD_DIM]),
              "value": (t, [tokens, KV_HEADS * HEAD_DIM]), "key_cache": (t, list(args["k_cache"].shape)),
              "value_cache": (t, list(args["v_cache"].shape)), "cumulative_sequence_length": (TP.INT32, [b + 1]),
              "past_seqlens": (TP.INT32, [b]), "block_table": (TP.INT32, list(args["block_table"].shape))}
    node = oh.make_node("PagedAttention", list(shapes), ["output", "key_cache_out", "value_cache_out"],
                        domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS)
    graph = oh.make_graph([node], "paged", [oh.make_tensor_value_info(n, *shapes[n]) for n in shapes], [
        oh.make_tensor_value_info("output", t, [tokens, HEADS * HEAD_DIM]),
        oh.make_tensor_value_info("key_cache_out", t, shapes["key_cache"][1]),
        oh.make_tensor_value_info("value_cache_out", t, shapes["value_cache"][1])])
    model = tvmattn.import_onnx(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21),
                                                                     oh.make_opsetid("com.microsoft", 1)]))
    last = np.array(lengths) - 1
    rows = args["block_table"][np.arange(b), last // spec.page_size], last % spec.page_size
    feed = {"query": args["q"].reshape(tokens, -1), "key": args["k_cache"][rows].reshape(tokens, -1),
            "value": args["v_cache"][rows].reshape(tokens, -1), "key_cache": args["k_cache"],
            "value_cache": args["v_cache"], "cumulative_sequence_length": np.arange(b + 1, dtype=np.int32),
            "past_seqlens": last.astype(np.int32), "block_table": args["block_table"]}
    positional = [args[n] for n in ("q", "k_cache", "v_cache", "block_table", "cache_seqlens")]
    check(model.run(feed)[0].reshape(args["q"].shape), tvmattn.paged_reference(spec, *positional), spec.dtype,
          "ONNX PagedAttention")
    return lambda: model.run(feed)


def prefill(dtype: str, rounds: int, with_tvm: bool) -> None:
    """Ragged prefill (`PagedSpec(q_len=None)`, causal, the same lengths, queries = keys) against tvmattn's
    dense kernel on the batch padded to the longest (bottom-right causal, key padding: it skips the
    padding's key tiles), in useful GFLOP/s (4·d per visible (query, key) pair and head)."""
    spec = tvmattn.PagedSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE, q_len=None,
                             causal=True, dtype=dtype)
    args = paged_inputs(spec.replace(q_len=1), LENGTHS)
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    q = np.random.default_rng(2).standard_normal((int(cu[-1]), HEADS, HEAD_DIM)).astype(numpy_dtype(dtype))
    ragged = tvmattn.compile(spec)
    tensors = [host_tensor(a) for a in with_unused(spec, {**args, "q": q, "cu_seqlens_q": cu}).values()]
    tensors.append(host_tensor(np.empty_like(q)))
    longest = max(LENGTHS)
    dense_spec = tvmattn.AttentionSpec(batch=len(LENGTHS), seq_len=longest, kv_seq_len=longest, num_heads=HEADS,
                                       num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, causal=True,
                                       causal_align="bottom_right", key_padding=True, layout="BSHD", dtype=dtype,
                                       projections=False)
    dense = tvmattn.compile(dense_spec)
    rng = np.random.default_rng(3)
    padded = [rng.standard_normal(shape).astype(numpy_dtype(dtype)) for shape in list(
        dense_spec.input_shapes().values())[:3]] + [np.array(LENGTHS, np.int32)]
    dense_tensors = [host_tensor(a) for a in padded] + [host_tensor(np.empty_like(padded[0]))]
    peers = {"ragged prefill": lambda: ragged.run(*tensors), "padded dense": lambda: dense.run(*dense_tensors)}
    if with_tvm:
        ragged.run(*tensors)  # (the output TVM's is checked against)
        peers["TVM TIRPagedKVCache"] = tvm_prefill_peer(spec, args, q, cu, tensors[-1])
    times = {name: [] for name in peers}
    for _ in range(rounds):
        for name, call in peers.items():
            times[name].append(timed(call, 0.5) if not name.startswith("TVM") else timed_once(call))
    flops = sum(n * (n + 1) / 2 for n in LENGTHS) * HEADS * 4 * HEAD_DIM
    rate = {name: flops / statistics.median(t) for name, t in times.items()}
    print(f"\nprefill {dtype}, causal, lengths {'/'.join(map(str, LENGTHS))}, {rounds} rounds:")
    for name, r in rate.items():
        print(f"  {name:24s} {flops / r * 1e3:8.1f} ms  {r / 1e9:6.1f} useful GFLOP/s")
    print(f"  ragged / padded dense (useful GFLOP/s): {rate['ragged prefill'] / rate['padded dense']:.2f}x")
    if with_tvm:
        print(f"  ragged / TVM TIRPagedKVCache's ragged prefill: "
              f"{rate['ragged prefill'] / rate['TVM TIRPagedKVCache']:.1f}x")


def tvm_prefill_peer(spec: tvmattn.PagedSpec, args: dict, q: np.ndarray, cu: np.ndarray, ours):
    """TIRPagedKVCache's CPU ragged prefill kernel (``_attention_prefill_ragged_cpu``: each sequence's new
    queries over its new keys, packed) on the same queries and keys, checked against tvmattn's output."""
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_prefill_ragged_cpu

    func = _attention_prefill_ragged_cpu(KV_HEADS, HEADS, HEAD_DIM, HEAD_DIM, spec.dtype, {})
    fn = tvm.compile(tvm.IRModule({"main": func}), target=tvmattn.compiler.target.host_target())["main"]
    rows = [(args["block_table"][b, t // spec.page_size], t % spec.page_size) for b, n in enumerate(LENGTHS)
            for t in range(n)]
    k, v = (np.ascontiguousarray(np.stack([args[c][p, r] for p, r in rows])) for c in ("k_cache", "v_cache"))
    out = np.empty_like(q)
    zeros = np.zeros(q.shape[0], np.int32)
    tensors = [tvm.runtime.tensor(a) for a in (q, cu, k, v, cu, zeros, zeros[:len(LENGTHS)], out,
                                               np.empty(q.shape[:2], np.float32))]
    scale = 1.0 / np.sqrt(HEAD_DIM)
    fn(*tensors, 1, 0, 1.0, 1e4, scale)
    check(tensors[7].numpy(), ours.numpy(), spec.dtype, "TVM TIRPagedKVCache prefill")
    return lambda: fn(*tensors, 1, 0, 1.0, 1e4, scale)


def timed_once(call) -> float:
    """Seconds of one call (TVM's serial kernels take seconds)."""
    time.sleep(PAUSE)
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def check(out, ref, dtype, what) -> None:
    max_abs, max_rel = errors(out, ref)
    if not max_rel <= TOLERANCE[dtype]:
        raise SystemExit(f"{what} {dtype}: max rel error {max_rel:.3g} over {TOLERANCE[dtype]}")


def timed(call, budget: float = 0.15) -> float:
    """Seconds per call: as many calls as fit ``budget``, at least 3; first a pause in which the previous
    peer's worker threads stop spinning (OpenVINO's and TVM's spin after a call and would take a core
    from the next peer)."""
    time.sleep(PAUSE)
    call()
    start, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - start < budget:
        call()
        n += 1
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--layouts", nargs="+", default=["HND", "NHD"])
    parser.add_argument("--no-tvm", action="store_true", help="leave out TVM's own (serial) kernel")
    parser.add_argument("--no-openvino", action="store_true", help="leave out OpenVINO's PagedAttention")
    parser.add_argument("--prefill", action="store_true", help="also ragged prefill against the padded dense kernel")
    opts = parser.parse_args()
    total = sum(LENGTHS)
    uniform = (total // len(LENGTHS),) * len(LENGTHS)
    for dtype in opts.dtypes:
        per_key = KV_HEADS * HEAD_DIM * 2 * numpy_dtype(dtype).itemsize  # K and V bytes of one key
        kv_bytes = total * per_key
        peers, keys = {}, {}
        for layout in opts.layouts:
            spec = tvmattn.PagedSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE,
                                     kv_layout=layout, dtype=dtype)
            peers[f"paged {layout}"] = paged_peer(spec, LENGTHS)
            peers[f"paged {layout} uniform"] = paged_peer(spec, uniform)
            dense = {"HND": "BHSD", "NHD": "BSHD"}[layout]
            peers[f"contiguous {dense}"] = contiguous_peer(dtype, dense, uniform[0])
            keys[f"paged {layout} uniform"] = keys[f"contiguous {dense}"] = sum(uniform)
        if "NHD" in opts.layouts:
            peers["ONNX PagedAttention"] = onnx_peer(spec.replace(kv_layout="NHD"), LENGTHS)
        if not opts.no_tvm:
            peers["TVM TIRPagedKVCache"] = tvm_peer(spec, LENGTHS)
        if not opts.no_openvino:  # its CPU plugin's pages are 32 keys: ours on the same pages beside it
            spec32 = tvmattn.PagedSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=32,
                                       kv_layout="HND", dtype=dtype)
            peers["paged HND, page 32"] = paged_peer(spec32, LENGTHS)
            peers["OpenVINO PagedAttention"] = openvino_peer(spec32, LENGTHS)
        times = {name: [] for name in peers}
        for _ in range(opts.rounds):  # interleaved: each round times every peer once
            for name, call in peers.items():
                times[name].append(timed(call, 0.05 if name.startswith("TVM") else 0.15))
        median = {name: statistics.median(t) for name, t in times.items()}
        rate = {name: keys.get(name, total) * per_key / seconds for name, seconds in median.items()}  # KV bytes/s
        print(f"\n{dtype}: B=4 lengths {'/'.join(map(str, LENGTHS))} (uniform {uniform[0]}), {HEADS}/{KV_HEADS} heads, "
              f"d={HEAD_DIM}, page {PAGE}, KV {kv_bytes / 1e6:.1f} MB, {opts.rounds} rounds")
        for name, seconds in median.items():
            print(f"  {name:24s} {seconds * 1e3:8.3f} ms  {rate[name] / 1e9:6.1f} GB/s")
        for layout in opts.layouts:
            dense = {"HND": "BHSD", "NHD": "BSHD"}[layout]
            mine = rate[f"paged {layout}"]
            print(f"  paged {layout} / contiguous {dense} (KV GB/s): {mine / rate[f'contiguous {dense}']:.2f}x;"
                  f"  ragged / uniform: {mine / rate[f'paged {layout} uniform']:.2f}x"
                  + (f";  vs TVM TIRPagedKVCache: {mine / rate['TVM TIRPagedKVCache']:.1f}x"
                     if "TVM TIRPagedKVCache" in median else ""))
        if "ONNX PagedAttention" in median:
            print(f"  ONNX PagedAttention imported / paged NHD kernel alone (time): "
                  f"{median['ONNX PagedAttention'] / median['paged NHD']:.2f}x")
        if "OpenVINO PagedAttention" in median:
            print(f"  paged HND, page 32 / OpenVINO PagedAttention (same pages): "
                  f"{median['OpenVINO PagedAttention'] / median['paged HND, page 32']:.2f}x")
    if opts.prefill:
        prefill(opts.dtypes[0], max(3, opts.rounds // 2), not opts.no_tvm)


if __name__ == "__main__":
    main()
