"""`tvmattn bench`: tvmattn against its peers on the same inputs, in one process.

Peers (each only if installed): PyTorch `scaled_dot_product_attention`, ONNX Runtime's `Attention`
(opset 23), OpenVINO's `ScaledDotProductAttention` (opset 13) and NumPy. Each runs with every core,
after a warm-up, in interleaved rounds (`interleaved`: a slow spell of the machine falls on every
implementation alike), for the median of its runs; idle worker threads are told not to spin so that
one implementation does not steal the next one's cores (OMP_WAIT_POLICY=PASSIVE, ORT allow_spinning=0;
TVM's workers yield ~160 µs before they sleep, tvmattn's default). OpenVINO's TBB
workers have no such switch: the pause before each turn lets them go idle.

16-bit specs: torch takes the bf16/fp16 arrays as they are, ONNX Runtime fp16 (it has no CPU bf16
`Attention`: skipped), OpenVINO fp32 tensors holding the same rounded values with a bf16/f16 inference
precision, NumPy float32 on the same rounded values.

GFLOP/s = useful FLOPs / time, FlashAttention's count (`explain.useful_flops`): 4·d_k per (query, key)
pair a query may see for the core (QKᵀ and P·V; a causal core is about half a dense one), plus the four projections
for a full layer. %peak is against this machine's arithmetic peak for the spec's precision, measured
here (`peak.peak_gflops`: a TVM-built loop of the kernels' FMAs or bf16 dot products in registers, or
a GEMM where that is faster).
"""

from __future__ import annotations

import os

# Before any runtime starts its thread pool (the CLI imports this module before running anything).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import ctypes  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from importlib.util import find_spec  # noqa: E402
from typing import Callable, Mapping, Sequence  # noqa: E402

import numpy as np  # noqa: E402

from tvmattn.compiler import arguments, variant  # noqa: E402
from tvmattn.compiler.errors import TvmAttnError  # noqa: E402
from tvmattn.compiler.explain import useful_flops  # noqa: E402
from tvmattn.compiler.kernel import numpy_dtype  # noqa: E402
from tvmattn.compiler.oracle import allowed_keys, reference  # noqa: E402
from tvmattn.compiler.spec import AttentionSpec  # noqa: E402
from tvmattn.compiler.target import cpu_cores  # noqa: E402
from tvmattn.compiler.verify import errors, random_inputs  # noqa: E402

DEFAULT_SUITE = [(1, 8, 128, 64), (1, 8, 512, 64), (4, 12, 512, 64), (1, 16, 2048, 64), (8, 8, 256, 32)]
NUMPY_LIMIT_BYTES = 2 << 30  # NumPy materialises the scores; skip it above this
ORACLE_LIMIT_ELEMENTS = 1 << 27  # the float64 oracle materialises them too
PAUSE_S = 0.2  # before each implementation's turn: the previous one's workers go idle


@dataclass
class Result:
    impl: str
    spec: str
    ms: float | None = None
    gflops: float | None = None
    max_rel_error: float | None = None
    peak_extra_mib: float | None = None
    note: str = ""


def suite(name: str, dtype: str = "float32") -> list[AttentionSpec]:
    """The named benchmark suite in ``dtype``: ``default`` is five common shapes, non-causal and causal."""
    if name != "default":
        raise TvmAttnError(f"unknown suite {name!r}: the only suite is 'default'")
    return [AttentionSpec(batch=b, seq_len=n, num_heads=h, head_dim=d, causal=c, projections=False, dtype=dtype)
            for b, h, n, d in DEFAULT_SUITE for c in (False, True)]


def measure(fn: Callable[[], object], budget_s: float = 1.0, warmup: int = 2) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls, repeated until ``budget_s`` (3 ≤ runs ≤ 50)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(runs: Mapping[str, Callable[[], object]], budget_s: float, rounds: int = 5,
                pause_s: float = 0.0, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per run of each callable, in ``rounds`` rounds that give each a turn of ``budget_s /
    rounds`` (at least one run), ``pause_s`` before each turn (for the previous one's workers to go
    idle): on a shared machine a slow spell then falls on every implementation alike, not on
    whichever ran during it."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            time.sleep(pause_s)
            end = time.perf_counter() + budget_s / rounds
            while True:
                t0 = time.perf_counter()
                run()
                t1 = time.perf_counter()
                times[name].append(t1 - t0)
                if t1 >= end:
                    break
    return times


def peak_extra_mib(fn: Callable[[], object], output_bytes: int = 0) -> float | None:
    """Resident memory a first call adds at its peak, less its output (Linux: VmHWM after resetting
    it; freed heap is returned first, so that reusing it does not hide an allocation)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
        fn()
        return max(_status_kib("VmHWM") - before - output_bytes / 1024, 0) / 1024
    except OSError:
        return None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(field)


# ---- implementations: each returns a zero-argument callable that produces the output ------------
def tvmattn_impl(spec: AttentionSpec, args: dict[str, np.ndarray], target: str = "cpu",
                 log_dirs: Sequence[str] = (), tuned: bool = True) -> tuple[Callable[[], np.ndarray], str]:
    import tvm

    from tvmattn.compiler.build import compile_attention

    kernel = compile_attention(spec, target, log_dirs=log_dirs, tuned=tuned)
    dev = kernel.device
    tensors = [tvm.runtime.tensor(a, dev) for a in args.values()]
    out = tvm.runtime.tensor(np.zeros(spec.output_shape(), numpy_dtype(spec.dtype)), dev)  # resident already

    def run():
        kernel.run(*tensors, out)
        return out

    return run, kernel.schedule


def torch_impl(spec: AttentionSpec, args: dict[str, np.ndarray]) -> tuple[Callable[[], object], str]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(cpu_cores())
    t = {k: _to_torch(v) for k, v in args.items()}
    mask = _mask(spec, args)
    kw = dict(attn_mask=_to_torch(mask) if mask is not None else None,
              is_causal=mask is None and spec.causal, enable_gqa=spec.h != spec.h_kv, scale=spec.softmax_scale)

    def heads(x, h):  # (B, n, h·d) → (B, h, n, d)
        return x.unflatten(-1, (h, -1)).transpose(1, 2)

    @torch.inference_mode()
    def run():
        if spec.projections:
            x_kv = t.get("x_kv", t["x"])
            q = heads(t["x"] @ t["w_q"], spec.h)
            k, v = heads(x_kv @ t["w_k"], spec.h_kv), heads(x_kv @ t["w_v"], spec.h_kv)
            o = F.scaled_dot_product_attention(q, k, v, **kw)
            return o.transpose(1, 2).flatten(2) @ t["w_o"]
        q, k, v = t["q"], t["k"], t["v"]
        if spec.layout == "BSHD":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, **kw)

    return run, f"torch {torch.__version__} scaled_dot_product_attention"


def _to_torch(a: np.ndarray):
    """``a`` as a torch tensor sharing its memory (torch.from_numpy refuses ml_dtypes' bfloat16)."""
    import torch

    if a.dtype == numpy_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def onnxruntime_impl(spec: AttentionSpec, args: dict[str, np.ndarray]) -> tuple[Callable[[], object], str]:
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as OrtNotImplemented

    from tvmattn.compiler.onnx.export import peer_model

    if spec.projections or spec.layout != "BHSD":
        raise NotImplementedError("the ORT peer covers the core BHSD kernel")
    feed = {"q": args["q"], "k": args["k"], "v": args["v"]}
    mask = _mask(spec, args)
    if mask is not None:
        feed["M"] = mask
    model = peer_model(spec, None if mask is None else "bool" if mask.dtype == bool else "additive")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = cpu_cores()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except OrtNotImplemented:  # bfloat16 in 1.32: no kernel, and the function body's Expand has none either
        raise NotImplementedError(f"onnxruntime {ort.__version__} has no {spec.dtype} Attention-23 on CPU") from None
    what = f"onnxruntime {ort.__version__} Attention-23" + ("" if spec.dtype == "float32" else f" ({spec.dtype})")
    return (lambda: session.run(None, feed)[0]), what


OPENVINO_PRECISION = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # INFERENCE_PRECISION_HINT


def openvino_impl(spec: AttentionSpec, args: dict[str, np.ndarray]) -> tuple[Callable[[], object], str]:
    """OpenVINO's SDPA-13 on fp32 tensors (16-bit specs: the same rounded values), run at the spec's
    precision as an inference precision hint; GQA repeats K/V heads in the graph."""
    import openvino as ov
    import openvino.opset13 as ops

    if spec.projections or spec.layout != "BHSD":
        raise NotImplementedError("the OpenVINO peer covers the core BHSD kernel")
    feed = {"Q": args["q"], "K": args["k"], "V": args["v"]}
    feed = {n: np.ascontiguousarray(a, dtype=np.float32) for n, a in feed.items()}  # exact for bf16/fp16
    mask = _mask(spec, args)
    if mask is not None:
        feed["M"] = mask
    params = {n: ops.parameter(a.shape, a.dtype, name=n) for n, a in feed.items()}

    def repeat_heads(x, shape):  # (B, h_kv, n, d) → (B, h_kv·group, n, d), as np.repeat(x, group, 1)
        if spec.group == 1:
            return x
        B, h_kv, n, d = shape
        x = ops.unsqueeze(x, ops.constant(np.array([2], np.int64)))
        x = ops.broadcast(x, ops.constant(np.array([B, h_kv, spec.group, n, d], np.int64)))
        return ops.reshape(x, ops.constant(np.array([B, h_kv * spec.group, n, d], np.int64)), False)

    k, v = (repeat_heads(params[n], feed[n].shape) for n in "KV")
    o = ops.scaled_dot_product_attention(params["Q"], k, v, params.get("M"),
                                         ops.constant(np.float32(spec.softmax_scale)),
                                         causal=spec.causal and mask is None)
    model = ov.Model([o], list(params.values()), "attention")
    asked = OPENVINO_PRECISION[spec.dtype]
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": cpu_cores(),
                                                      "INFERENCE_PRECISION_HINT": asked,
                                                      "PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    # the precision it runs at: a CPU without AVX512-FP16 runs an f16 hint in bf16
    got = compiled.get_property("INFERENCE_PRECISION_HINT").to_string()
    precision = f"{got} inference precision" + ("" if got == asked else f" ({asked} asked)")
    gqa = ", K/V heads repeated in the graph" if spec.group > 1 else ""
    what = f"openvino {ov.__version__.split('-')[0]} SDPA-13 ({precision}, fp32 I/O{gqa})"
    return (lambda: request.infer(feed, share_inputs=True)[0]), what


def numpy_impl(spec: AttentionSpec, args: dict[str, np.ndarray]) -> tuple[Callable[[], object], str]:
    if spec.projections or spec.layout != "BHSD":
        raise NotImplementedError("the NumPy peer covers the core BHSD kernel")
    scores_bytes = 4 * spec.batch * spec.h * spec.n_q * spec.n_kv
    if scores_bytes > NUMPY_LIMIT_BYTES:
        raise NotImplementedError(f"needs {scores_bytes / 2**30:.0f} GiB for the scores")
    # float32 throughout: 16-bit inputs are widened once (exactly), NumPy has no bf16 BLAS
    q, k, v = (np.asarray(args[n], np.float32) for n in "qkv")
    k, v = np.repeat(k, spec.group, 1), np.repeat(v, spec.group, 1)
    mask = _mask(spec, args)

    @np.errstate(invalid="ignore")  # a row that sees no key becomes NaN, as in most frameworks
    def run():
        s = (q @ k.transpose(0, 1, 3, 2)) * np.float32(spec.softmax_scale)
        if mask is not None and mask.dtype != bool:  # additive
            s = s + mask
        elif mask is not None or spec.causal:
            s = np.where(mask if mask is not None else _causal(spec), s, np.float32(-np.inf))
        s = np.exp(s - s.max(-1, keepdims=True))
        return (s / s.sum(-1, keepdims=True)) @ v

    inputs = "" if spec.dtype == "float32" else f" on the {spec.dtype} inputs"
    return run, f"numpy {np.__version__} (float32{inputs}, scores materialised)"


PEERS = {"torch": torch_impl, "onnxruntime": onnxruntime_impl, "openvino": openvino_impl, "numpy": numpy_impl}
OPTIONAL_PEERS = {"openvino"}  # in the default list only where installed (the bench extra)


def default_peers() -> tuple[str, ...]:
    """The peers a plain `tvmattn bench` runs: every one, but an optional one only if it is installed."""
    return tuple(name for name in PEERS if name not in OPTIONAL_PEERS or find_spec(name) is not None)


def _causal(spec: AttentionSpec) -> np.ndarray:
    return allowed_keys(spec, 1, spec.n_q, spec.n_kv, None)


def _mask(spec: AttentionSpec, args: dict[str, np.ndarray]) -> np.ndarray | None:
    """The mask a peer takes where it has no built-in for the spec's masking: boolean (B, 1|h, n, n_kv)
    from the position rules and a bool attn_mask, or float32 (an additive attn_mask, −inf where the
    position rules hide a key)."""
    if spec.attn_mask is None and (variant.plain_causal(spec) or not variant.has_position_rules(spec)):
        return None
    allowed = allowed_keys(spec, spec.batch, spec.n_q, spec.n_kv, args.get("kv_lens"))  # (B, 1, n, n_kv)
    if spec.attn_mask == "bool":
        return allowed & args["attn_mask"]
    if spec.attn_mask == "additive":
        return np.where(allowed, args["attn_mask"], -np.inf).astype(np.float32)
    return allowed


# ---- the run -------------------------------------------------------------------------------------
def bench(spec: AttentionSpec, peers: Sequence[str] | None = None, budget_s: float = 1.0,
          target: str = "cpu", log_dirs: Sequence[str] = (), tuned: bool = True) -> list[Result]:
    """tvmattn and each available peer (``default_peers()`` unless given) on the same seeded inputs;
    tvmattn's row comes first.

    tvmattn uses the best tuning record (``log_dirs`` first) unless ``tuned`` is False."""
    peers = default_peers() if peers is None else tuple(peers)
    if spec.symbolic_dims:
        raise TvmAttnError(f"bench needs concrete sizes, not {', '.join(spec.symbolic_dims)}: "
                           f"give --seq/--batch numbers")
    args = random_inputs(spec, seed=0)
    label = spec.describe()
    ref = None
    if spec.batch * spec.h * spec.n_q * spec.n_kv <= ORACLE_LIMIT_ELEMENTS:
        arrays, named = arguments.split(spec, args)
        ref = reference(spec, *arrays, **named)
        seen = _rows_that_see_keys(spec, args)
    out_bytes = int(np.prod(spec.output_shape())) * np.dtype(numpy_dtype(spec.dtype)).itemsize
    impls: list[tuple[str, Callable]] = [("tvmattn", lambda s, a: tvmattn_impl(s, a, target, log_dirs, tuned))]
    impls += [(name, PEERS[name]) for name in peers]
    results: dict[str, Result] = {}
    runs, memory, notes = {}, {}, {}
    no_peer = [a.name for a in arguments.taken(spec) if not a.peers]  # (their SDPA ops have no such argument)
    for name, make in impls:
        if no_peer and name != "tvmattn":
            results[name] = Result(name, label, note=f"skipped: {', '.join(no_peer)}")
            continue
        try:
            runs[name], notes[name] = make(spec, args)
        except ImportError:
            results[name] = Result(name, label, note="not installed")
            continue
        except NotImplementedError as why:
            results[name] = Result(name, label, note=f"skipped: {why}")
            continue
        time.sleep(PAUSE_S)
        memory[name] = peak_extra_mib(runs[name], 0 if name == "tvmattn" else out_bytes)  # the first call, cold
    times = interleaved(runs, budget_s, pause_s=PAUSE_S)
    for name, run in runs.items():
        seconds = statistics.median(times[name])
        out = np.asarray(_to_numpy(run()), dtype=np.float64)
        err = _error(out, ref, seen) if ref is not None else None
        gflops = useful_flops(spec) / seconds / 1e9
        results[name] = Result(name, label, seconds * 1e3, gflops, err, memory[name], notes[name])
    return [results[name] for name, _ in impls]


def _rows_that_see_keys(spec: AttentionSpec, args: dict[str, np.ndarray]) -> np.ndarray:
    """(B, h|1, n, 1) True where a query sees a key: rows that see none are zeros for tvmattn and NaN
    for most peers, so errors are taken over the others."""
    mask = _mask(spec, args)
    if mask is None:
        mask = allowed_keys(spec, spec.batch, spec.n_q, spec.n_kv, args.get("kv_lens"))
    seen = (mask if mask.dtype == bool else mask != -np.inf).any(-1, keepdims=True)
    if spec.projections:
        return np.ones((1, 1, 1), bool)
    return seen if spec.layout == "BHSD" else seen.transpose(0, 2, 1, 3)


def _error(out: np.ndarray, ref: np.ndarray, seen: np.ndarray) -> float:
    """`verify.errors`' relative error over the rows that see a key."""
    return errors(np.where(seen, out, ref), ref)[1]


def _to_numpy(x) -> np.ndarray:
    if str(getattr(x, "dtype", "")) == "torch.bfloat16":  # NumPy has no bf16: widen (exactly) first
        x = x.float()
    if hasattr(x, "numpy"):
        return x.numpy()
    return np.asarray(x)


def table(results: list[Result], peak: float) -> str:
    """One block per spec: ms, GFLOP/s, % of ``peak`` (GFLOP/s), how much faster tvmattn is, error, memory."""
    lines = []
    for label in dict.fromkeys(r.spec for r in results):
        rows = [r for r in results if r.spec == label]
        ours = next((r for r in rows if r.impl == "tvmattn" and r.ms), None)
        lines.append(label)
        lines.append(f"  {'implementation':<12} {'ms':>9} {'GFLOP/s':>8} {'%peak':>6} {'tvmattn ×':>10} "
                     f"{'max rel err':>11} {'peak MiB':>9}  notes")
        for r in rows:
            if r.ms is None:
                lines.append(f"  {r.impl:<12} {'—':>9} {'':>8} {'':>6} {'':>10} {'':>11} {'':>9}  {r.note}")
                continue
            speedup = f"{r.ms / ours.ms:.2f}" if ours and r is not ours else "—"
            err = f"{r.max_rel_error:.1e}" if r.max_rel_error is not None else "—"
            mem = f"{r.peak_extra_mib:.1f}" if r.peak_extra_mib is not None else "—"
            lines.append(f"  {r.impl:<12} {r.ms:>9.3f} {r.gflops:>8.1f} {100 * r.gflops / peak:>5.0f}% "
                         f"{speedup:>10} {err:>11} {mem:>9}  {r.note}")
    return "\n".join(lines)


def write_json(results: list[Result], peak: float, measured_with: str, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"peak_gflops": peak, "peak_measured_with": measured_with, "threads": cpu_cores(),
                   "results": [asdict(r) for r in results]}, f, indent=1)


def plot(results: list[Result], path: str) -> None:
    """GFLOP/s against sequence length, one line per implementation (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for impl in dict.fromkeys(r.impl for r in results):
        pts = sorted((_seq_len(r.spec), r.gflops) for r in results if r.impl == impl and r.gflops)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("GFLOP/s (4·d_k per visible (query, key) pair / time)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _seq_len(label: str) -> int:
    return int(label.split(" n=")[1].split()[0])
