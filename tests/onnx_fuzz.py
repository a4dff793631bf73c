"""Mutants of small attention models, and a sandbox that runs them as a careless user would.

A mutant is a model (bytes) and a feed. The sandbox imports and runs it with tvmattn in a worker
process (a crash or a hang is a verdict, not the end of the run) and runs ONNX Runtime and ONNX's
reference evaluator on the same feed. `judge` says what happened:

    clean error     tvmattn raised one TvmAttnError of one line
    agrees          tvmattn's outputs equal a reference's at 1e-4 of the output's scale, NaN where it
                    has NaN, with tvmattn's two documented rules: a row the reference fills with NaN
                    and tvmattn with zeros (the query saw no key); and an entry the reference makes NaN
                    only through a non-finite input the mask hides (it adds the mask to scores it
                    computed), which equals the reference's output with that input made finite
    outside float32's range   a difference where the reference's outputs reach 1e29 (OVERFLOW_SCALE)
    crash, hang, other exception, mismatch, nan swallowed, ran where every reference refused
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import time
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

TOLERANCE = 1e-4
OUT_OF_RANGE = "outside float32's range"
# Outputs this large come from inputs whose scores (q·k, ~|x|²) overflow float32: every implementation's
# answer is then an artefact of its order of operations (tvmattn sums P·V before dividing by the row sum,
# as FlashAttention does, and may overflow to inf where a normalise-first reference stays finite; a
# finite mask fill such as finfo.min makes a reference average the hidden keys of a row whose visible
# scores overflowed to -inf, where tvmattn gives the row no key). Such cases are tallied on their own.
OVERFLOW_SCALE = 1e29
MUTATIONS = ("truncate", "flip_byte", "attribute", "swap_inputs", "dangling_input", "input_dtype",
             "input_rank", "opset", "initializer_bytes", "feed_nan", "feed_inf", "feed_huge", "feed_empty",
             "feed_index", "feed_dtype", "feed_broadcast", "feed_none")


@dataclass
class Mutant:
    base: str
    kind: str
    model: bytes
    feed: dict | None
    note: str = ""
    poked: tuple[str, int] | None = None  # the feed entry a NaN/inf mutation set (input, flat index)


# ---- base models: one per attention formulation the importer knows --------------------------------
def base_models() -> dict[str, tuple[onnx.ModelProto, dict]]:
    from tvmattn import AttentionSpec
    from tvmattn.compiler.onnx.export import export_onnx
    from tvmattn.compiler.verify import random_inputs
    from tvmattn.models import onnx_models

    rng = np.random.default_rng(0)
    out = {}
    for name, spec, opset in (
            ("attention23_causal", AttentionSpec(seq_len="n", num_heads=2, head_dim=8, causal=True,
                                                 projections=False), 23),
            ("attention23_gqa_mask", AttentionSpec(seq_len=8, kv_seq_len=12, num_heads=4, num_kv_heads=2,
                                                   head_dim=8, attn_mask="additive", projections=False), 23),
            ("decomposed17_layer", AttentionSpec(seq_len="n", d_model=16, num_heads=2, causal=True), 17)):
        model, _ = export_onnx(spec, opset=opset)
        sizes = {d: 8 for d in spec.symbolic_dims}
        feed = {k: v for k, v in random_inputs(spec, sizes, 0).items() if not k.startswith("w_")}
        out[name] = (model, feed)
    x = rng.standard_normal((1, 8, 16)).astype(np.float32)
    out["gpt2_block"] = (onnx_models.gpt2_block(d_model=16, heads=2, max_len=16), {"x": x})
    out["bert_block"] = (onnx_models.bert_block(d_model=16, heads=2),
                         {"x": x, "attention_mask": np.array([[1] * 6 + [0] * 2], np.int64)})
    out["llama_block"] = (onnx_models.llama_block(d_model=16, heads=2, kv_heads=1),
                          {"x": x, "position_ids": np.arange(8, dtype=np.int64)[None]})
    out["embedding"] = (_embedding_model(), {"ids": np.array([[1, 5, 3, 0]], np.int64)})
    return out


def _embedding_model() -> onnx.ModelProto:
    """ids (B, n) → Gather of a (10, 8) table: out-of-range ids are a user's mistake, not a crash."""
    table = onnx.numpy_helper.from_array(np.arange(80, dtype=np.float32).reshape(10, 8) / 80, "table")
    node = helper.make_node("Gather", ["table", "ids"], ["out"], name="Gather_0", axis=0)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "n"])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "n", 8])
    graph = helper.make_graph([node], "embedding", [ids], [out], [table])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# ---- mutations ------------------------------------------------------------------------------------
def mutate(base: str, model: onnx.ModelProto, feed: dict, kind: str, rng: random.Random) -> Mutant:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    feed = {k: np.array(v) for k, v in feed.items()}
    note = ""
    nodes = list(m.graph.node)
    if kind == "truncate":
        data = model.SerializeToString()
        cut = rng.randrange(0, len(data))
        return Mutant(base, kind, data[:cut], feed, f"{cut}/{len(data)} bytes")
    if kind == "flip_byte":
        data = bytearray(model.SerializeToString())
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        return Mutant(base, kind, bytes(data), feed, f"byte {at}")
    if kind == "attribute":
        candidates = [(n, a) for n in nodes for a in n.attribute if a.type in (onnx.AttributeProto.INT,
                                                                                 onnx.AttributeProto.INTS,
                                                                                 onnx.AttributeProto.FLOAT)]
        if candidates:
            node, attr = rng.choice(candidates)
            if attr.type == onnx.AttributeProto.INT:
                attr.i = rng.choice([-2, -1, 0, 1, 2, 3, 5, attr.i + 1])
            elif attr.type == onnx.AttributeProto.FLOAT:
                attr.f = rng.choice([0.0, -1.0, float("inf"), float("nan"), attr.f * 2])
            else:
                values = list(attr.ints)
                if values and sorted(values) == list(range(len(values))):  # a permutation
                    rng.shuffle(values)
                elif values:
                    values[rng.randrange(len(values))] = rng.choice([-1, 0, 1, 2, 3, 7])
                del attr.ints[:]
                attr.ints.extend(values)
            note = f"{node.name}.{attr.name}"
    elif kind == "swap_inputs":
        multi = [n for n in nodes if len(n.input) >= 2]
        if multi:
            node = rng.choice(multi)
            i, j = rng.sample(range(len(node.input)), 2)
            node.input[i], node.input[j] = node.input[j], node.input[i]
            note = f"{node.name} inputs {i}<->{j}"
    elif kind == "dangling_input":
        node = rng.choice(nodes)
        if node.input:
            node.input[rng.randrange(len(node.input))] = "no_such_tensor"
            note = node.name
    elif kind == "input_dtype":
        info = rng.choice(list(m.graph.input))
        info.type.tensor_type.elem_type = rng.choice([TensorProto.FLOAT16, TensorProto.INT32, TensorProto.DOUBLE,
                                                      TensorProto.BOOL, TensorProto.STRING])
        note = info.name
    elif kind == "input_rank":
        info = rng.choice(list(m.graph.input))
        dims = info.type.tensor_type.shape.dim
        if rng.random() < 0.5 and len(dims) > 1:
            del dims[len(dims) - 1]
        else:
            dims.add().dim_value = 1
        note = info.name
    elif kind == "opset":
        version = rng.choice([1, 7, 12, 99])
        for o in m.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = version
        note = f"opset {version}"
    elif kind == "initializer_bytes":
        if m.graph.initializer:
            init = rng.choice(list(m.graph.initializer))
            raw = onnx.numpy_helper.to_array(init).tobytes()
            init.ClearField("float_data")
            init.ClearField("int64_data")
            init.ClearField("int32_data")
            init.raw_data = raw[:max(0, len(raw) - rng.choice([1, 3, 4]))]
            note = init.name
    else:
        note, poked = _mutate_feed(feed, kind, rng)
        if kind == "feed_none":
            feed = None
        return Mutant(base, kind, m.SerializeToString(), feed, note, poked)
    return Mutant(base, kind, m.SerializeToString(), feed, note)


def _mutate_feed(feed: dict, kind: str, rng: random.Random) -> tuple[str, tuple[str, int] | None]:
    floats = [k for k, v in feed.items() if v.dtype.kind == "f"]
    ints = [k for k, v in feed.items() if v.dtype.kind in "iu"]
    name = rng.choice(floats or list(feed))
    a = feed[name]
    if kind in ("feed_nan", "feed_inf") and a.dtype.kind == "f":
        at = rng.randrange(a.size)
        a.flat[at] = np.nan if kind == "feed_nan" else rng.choice([np.inf, -np.inf])
        return name, (name, at)
    elif kind == "feed_huge" and a.dtype.kind == "f":
        a *= np.float32(rng.choice([1e20, 1e30, 3e38]))
    elif kind == "feed_empty":
        axis = rng.randrange(a.ndim)
        feed[name] = np.take(a, [], axis=axis)
        return f"{name} axis {axis}", None
    elif kind == "feed_index" and ints:
        name = rng.choice(ints)
        feed[name] = feed[name].copy()
        feed[name].flat[rng.randrange(feed[name].size)] = rng.choice([-100, -1, 10, 1000, 2 ** 40])
    elif kind == "feed_dtype":
        feed[name] = a.astype(rng.choice([np.float64, np.int32, np.float16, np.bool_]))
    elif kind == "feed_broadcast":
        feed[name] = Broadcast(a.reshape(-1)[:1].copy(), (1 << 20, 1 << 20))  # a 4 TiB zero-stride view
    return name, None


@dataclass
class Broadcast:
    """A zero-stride view, made in the worker (sending it through a queue would materialise it)."""

    value: np.ndarray
    shape: tuple[int, ...]

    def view(self) -> np.ndarray:
        return np.broadcast_to(self.value, self.shape)


# ---- running --------------------------------------------------------------------------------------
def _probes(model: bytes, feed: dict | None, poked: tuple[str, int] | None) -> list | None:
    """ONNX Runtime's outputs with the non-finite entry a mutation set replaced by 0, and by 1: an output
    entry equal in both does not depend on it (the mask hides it from that entry)."""
    import onnxruntime as ort

    if poked is None:
        return None
    name, at = poked
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    outs = []
    for fill in (0, 1):
        changed = feed[name].copy()
        changed.flat[at] = fill
        outs.append([np.asarray(o) for o in session.run(None, {**feed, name: changed})])
    return outs


def _worker(jobs: mp.Queue, results: mp.Queue) -> None:
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    import tvmattn

    while True:
        model, feed, poked = jobs.get()
        if feed is not None:
            feed = {k: v.view() if isinstance(v, Broadcast) else v for k, v in feed.items()}
        refs = []
        for name, make in (("onnxruntime", lambda: ort.InferenceSession(model, providers=["CPUExecutionProvider"])
                            .run(None, feed)),
                           ("reference", lambda: ReferenceEvaluator(onnx.load_from_string(model)).run(None, feed))):
            try:
                refs.append((name, [np.asarray(o) for o in make()]))
            except Exception as err:  # a reference that refuses the mutant says so
                refs.append((name, f"{type(err).__name__}: {err}"[:200]))
        try:
            probes = _probes(model, feed, poked)
        except Exception:  # noqa: BLE001 — ONNX Runtime refuses the model: no probe, a stricter judge
            probes = None
        results.put(("refs", refs, probes))
        try:
            imported = tvmattn.import_onnx(model)
            results.put(("ours", [np.asarray(o) for o in imported.run(feed)]))
        except tvmattn.TvmAttnError as err:
            results.put(("error", str(err)))
        except BaseException as err:  # noqa: BLE001 — every other exception is a verdict
            results.put(("other", f"{type(err).__name__}: {str(err)[:300]}"))


class Sandbox:
    """A worker process that runs mutants one at a time, restarted after a crash or a hang."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.proc = None

    def _start(self) -> None:
        self.jobs, self.results = self.ctx.Queue(), self.ctx.Queue()
        self.proc = self.ctx.Process(target=_worker, args=(self.jobs, self.results), daemon=True)
        self.proc.start()

    def run(self, mutant: Mutant) -> tuple[str, str]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.jobs.put((mutant.model, mutant.feed, mutant.poked))
        try:
            _, refs, probes = self._get()
            kind, value = self._get()
        except (TimeoutError, ChildProcessError) as err:
            hung = isinstance(err, TimeoutError)
            code = self.proc.exitcode
            self.proc.kill()
            self.proc.join()
            self.proc = None
            return ("hang", f"no answer in {self.timeout_s:.0f} s") if hung else ("crash", f"exit code {code}")
        return judge(refs, kind, value, probes)

    def _get(self):
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                return self.results.get(timeout=0.2)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise ChildProcessError from None
        raise TimeoutError

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()


def judge(refs: list, kind: str, value, probes: list | None = None) -> tuple[str, str]:
    accepted = [(name, outs) for name, outs in refs if not isinstance(outs, str)]
    if kind == "error":
        if "\n" in value.strip():
            return "multi-line error", value[:200]
        return "clean error", value[:200]
    if kind == "other":
        return "other exception", value
    if not accepted:
        return "ran where every reference refused", "; ".join(r for _, r in refs)[:200]
    verdicts = [_compare(value, outs, probes) for _, outs in accepted]
    if any(v == "agrees" for v in verdicts):
        return "agrees", ""
    return verdicts[0], ""


def _compare(ours: list, ref: list, probes: list | None) -> str:
    if len(ours) != len(ref):
        return "mismatch"
    for i, (got, want) in enumerate(zip(ours, ref)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if got.shape != want.shape:
            return "mismatch"
        if want.size == 0:
            continue
        width = want.shape[-1] if want.ndim else 1
        rows_want, rows_got = want.reshape(-1, width), got.reshape(-1, width)
        documented = np.isnan(rows_want).all(axis=-1) & (rows_got == 0).all(axis=-1)  # a row that saw no key
        if probes is not None:  # a non-finite value the mask hides: the reference's NaN is its arithmetic
            zero, one = (np.asarray(p[i], np.float64).reshape(rows_want.shape) for p in probes)
            hidden = (zero == one) & np.isnan(rows_want) & np.isfinite(rows_got)
            rows_want = np.where(hidden, zero, rows_want)
        want, got = rows_want[~documented], rows_got[~documented]
        finite = np.isfinite(want)
        scale = max(np.max(np.abs(want[finite]), initial=0.0), 1e-30)
        verdict = _disagreement(got, want, finite, scale)
        if verdict is not None:
            return OUT_OF_RANGE if scale >= OVERFLOW_SCALE else verdict
    return "agrees"


def _disagreement(got: np.ndarray, want: np.ndarray, finite: np.ndarray, scale: float) -> str | None:
    if (np.isnan(want) & ~np.isnan(got)).any():
        return "nan swallowed"
    if (np.isnan(got) & ~np.isnan(want)).any() or (np.isinf(want) & (got != want)).any():
        return "mismatch"
    if (np.isinf(got) & finite).any() or (
            finite.any() and np.max(np.abs(got[finite] - want[finite])) / scale > TOLERANCE):
        return "mismatch"
    return None
