"""ONNX Runtime's own test cases for its attention operators, as graphs: their configurations and sweeps
(not their data), from ORT's test_gqa_cpu.py (GroupQueryAttention), test_mha.py (MultiHeadAttention),
attention_op_test.cc (Attention), rotary_embedding_op_test.cc and skiplayernorm_op_test.cc.

A `Case` is one graph with its feeds, each run through ONNX Runtime's CPU EP and tvmattn side by side;
every output (``present_*`` too) is compared. Where ORT's CPU EP has no kernel for a form (MultiHeadAttention's
packed QKV / KV), ``reference`` is the same attention written in a form it runs. `REJECTS` are inputs
ORT refuses at run time (an index outside a buffer, tests/test_onnx_ort_cases.py): tvmattn must refuse them too.
Sizes are symbolic in every graph, so one import serves a case's whole sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as oh

MS = (("", 17), ("com.microsoft", 1))
F32 = TP.FLOAT
Feed = dict[str, np.ndarray]


@dataclass(frozen=True)
class Case:
    op: str
    feature: str
    model: Callable[[], onnx.ModelProto]
    feeds: Callable[[], list[Feed]]
    quick: bool = False  # in the default run (the rest is the slow sweep)
    reference: Callable[[], onnx.ModelProto] | None = None  # the graph ORT runs, where not the model itself
    convert: Callable[[Feed], Feed] = field(default=lambda feed: feed)  # the reference's feed
    tolerance: float = 1e-4  # float32's (`compiler.verify.TOLERANCE`), relative to max |ORT|

    @property
    def id(self) -> str:
        return f"{self.op}:{self.feature}"


def graph(nodes, inputs, outputs) -> onnx.ModelProto:
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info(*i) for i in inputs],
                      [oh.make_tensor_value_info(*o) for o in outputs])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid(d, v) for d, v in MS])
    model.ir_version = 10
    return model


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def rotary_caches(rng: np.random.Generator, positions: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches of random angles (as ORT's tests draw them)."""
    angle = rng.random((positions, half)) * 2 * np.pi
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


# ---- GroupQueryAttention (test_gqa_cpu.py: prompt, token generation, shared buffer or not) -----------------
@dataclass(frozen=True)
class GQA:
    """One GroupQueryAttention graph. ``cache``: None (a prompt without past), "grow" (present = past + S
    rows) or "shared" (past and present one buffer of M rows, ORT's past_present_share_buffer)."""

    h: int = 6
    h_kv: int = 3
    d: int = 16
    cache: str | None = None
    packed: bool = False
    rotary: str | None = None  # "half" or "interleaved"
    rotary_dim: int = 0  # 0: the head width
    window: int = -1
    softcap: float = 0.0
    smooth: bool = False
    sink: bool = False
    bias: str | None = None  # attention_bias: "full" (B, h, S, T) or "broadcast" (1, 1, S, T)
    position_ids: bool = False
    causal: int = 1
    max_pos: int = 64

    @property
    def rd(self) -> int:
        return self.rotary_dim or self.d

    def model(self) -> onnx.ModelProto:
        h, h_kv, d = self.h, self.h_kv, self.d
        past = {"grow": "P", "shared": "M"}.get(self.cache)
        present = {"grow": "T", "shared": "M", None: "S"}[self.cache]
        total = {None: "S", "grow": "T", "shared": "T"}[self.cache]
        names = ["q", "" if self.packed else "k", "" if self.packed else "v", "pk" if past else "",
                 "pv" if past else "", "sl", "tot", "cos" if self.rotary else "", "sin" if self.rotary else "",
                 "pos" if self.position_ids else "", "bias" if self.bias else "", "sink" if self.sink else ""]
        attrs = dict(num_heads=h, kv_num_heads=h_kv, do_rotary=int(self.rotary is not None),
                     rotary_interleaved=int(self.rotary == "interleaved"), local_window_size=self.window,
                     smooth_softmax=int(self.smooth), causal=self.causal)
        if self.softcap:
            attrs["softcap"] = self.softcap
        node = oh.make_node("GroupQueryAttention", names, ["y", "present_k", "present_v"], name="gqa",
                            domain="com.microsoft", **attrs)
        width = (h + 2 * h_kv) * d if self.packed else h * d
        inputs = [("q", F32, ["B", "S", width])]
        inputs += [] if self.packed else [("k", F32, ["B", "S", h_kv * d]), ("v", F32, ["B", "S", h_kv * d])]
        inputs += [(n, F32, ["B", h_kv, past, d]) for n in ("pk", "pv")] if past else []
        inputs += [("sl", TP.INT32, ["B"]), ("tot", TP.INT32, [1])]
        inputs += [(n, F32, [self.max_pos, self.rd // 2]) for n in ("cos", "sin")] if self.rotary else []
        inputs += [("pos", TP.INT64, ["B", "S"])] if self.position_ids else []
        if self.bias:
            inputs.append(("bias", F32, ["B", h, "S", total] if self.bias == "full" else [1, 1, "S", total]))
        inputs += [("sink", F32, [h])] if self.sink else []
        outputs = [("y", F32, ["B", "S", h * d]), ("present_k", F32, ["B", h_kv, present, d]),
                   ("present_v", F32, ["B", h_kv, present, d])]
        return graph([node], inputs, outputs)

    def feed(self, seed: int, batch: int, seq: int, seqlens: list[int], past: int = 0, total: int | None = None,
             positions: np.ndarray | None = None) -> Feed:
        """``seqlens``: each sequence's keys after this step (ORT's seqlens_k + 1); ``past``: the past
        buffer's rows; ``total``: total_sequence_length (default: the longest sequence, as ORT's tests)."""
        rng = np.random.default_rng(seed)
        h, h_kv, d = self.h, self.h_kv, self.d
        total = max(seqlens) if total is None else total
        feed: Feed = {"sl": np.array(seqlens, np.int32) - 1, "tot": np.array([total], np.int32)}
        if self.packed:
            feed["q"] = randn(rng, batch, seq, (h + 2 * h_kv) * d)
        else:
            feed.update(q=randn(rng, batch, seq, h * d), k=randn(rng, batch, seq, h_kv * d),
                        v=randn(rng, batch, seq, h_kv * d))
        if self.cache:
            feed["pk"], feed["pv"] = randn(rng, batch, h_kv, past, d), randn(rng, batch, h_kv, past, d)
        if self.rotary:
            feed["cos"], feed["sin"] = rotary_caches(rng, self.max_pos, self.rd // 2)
        if self.position_ids:
            first = np.array(seqlens)[:, None] - seq
            feed["pos"] = (np.maximum(first, 0) + np.arange(seq)[None]).astype(np.int64) if positions is None \
                else positions
        keys = total if self.cache else seq
        if self.bias:
            feed["bias"] = randn(rng, *((batch, h) if self.bias == "full" else (1, 1)), seq, keys)
        if self.sink:
            feed["sink"] = randn(rng, h)
        return feed


def gqa_prompt(g: GQA, sweep: bool) -> list[Feed]:
    """Prompts: full lengths, and right padding (seqlens_k below S - 1)."""
    feeds = [g.feed(0, 3, 5, [5, 5, 5], past=8), g.feed(1, 2, 4, [4, 2], past=8)]
    return feeds + ([g.feed(2, 1, 17, [17], past=24), g.feed(3, 2, 9, [3, 9], past=12)] if sweep else [])


def gqa_decode(g: GQA, sweep: bool) -> list[Feed]:
    """Token generation: one new token after each sequence's own past (a batch of different lengths)."""
    shared = g.cache == "shared"
    feeds = [g.feed(0, 3, 1, [6, 3, 8], past=8 if shared else 7, total=8 if shared else None),
             g.feed(1, 1, 1, [5], past=12 if shared else 4, total=5 if shared else None)]
    return feeds + ([g.feed(2, 2, 1, [20, 2], past=24 if shared else 19, total=20 if shared else None)]
                    if sweep else [])


def gqa_chunk(g: GQA, sweep: bool) -> list[Feed]:
    """Interactive: S > 1 new tokens after a past (ORT takes it at batch 1)."""
    shared = g.cache == "shared"
    feeds = [g.feed(0, 1, 3, [9], past=12 if shared else 6, total=9 if shared else None)]
    return feeds + ([g.feed(1, 1, 5, [16], past=16 if shared else 11, total=16 if shared else None)]
                    if sweep else [])


def _gqa(feature: str, g: GQA, feeds: Callable[[GQA, bool], list[Feed]], quick: bool = False) -> list[Case]:
    return [Case("GroupQueryAttention", feature, g.model, lambda: feeds(g, False), quick=quick),
            Case("GroupQueryAttention", feature + " (sweep)", g.model, lambda: feeds(g, True))]


GQA_CASES = [
    *_gqa("prompt", GQA(), gqa_prompt, quick=True),
    *_gqa("prompt, MHA heads 6/6", GQA(h_kv=6, d=32), gqa_prompt),
    *_gqa("prompt, local window", GQA(window=2), gqa_prompt),
    *_gqa("prompt, rotary", GQA(rotary="half"), gqa_prompt, quick=True),
    *_gqa("prompt, rotary interleaved, partial", GQA(d=48, rotary="interleaved", rotary_dim=32), gqa_prompt),
    *_gqa("prompt, packed QKV", GQA(packed=True, rotary="half"), gqa_prompt),
    *_gqa("prompt, softcap", GQA(softcap=50.0), gqa_prompt),
    *_gqa("prompt, smooth_softmax", GQA(smooth=True), gqa_prompt, quick=True),
    *_gqa("prompt, head_sink", GQA(sink=True), gqa_prompt, quick=True),
    *_gqa("prompt, smooth_softmax and head_sink", GQA(smooth=True, sink=True), gqa_prompt),
    *_gqa("prompt, attention_bias", GQA(bias="full"), gqa_prompt),
    *_gqa("prompt, rotary at position_ids", GQA(rotary="half", position_ids=True), gqa_prompt),
    *_gqa("prompt, position_ids without rotary", GQA(position_ids=True), gqa_prompt, quick=True),
    *_gqa("prompt, not causal", GQA(causal=0), gqa_prompt),
    *_gqa("prompt into a shared buffer", GQA(cache="shared"), gqa_prompt, quick=True),
    *_gqa("prompt into a shared buffer, rotary", GQA(cache="shared", rotary="interleaved"), gqa_prompt),
    *_gqa("token generation", GQA(cache="grow"), gqa_decode),
    *_gqa("token generation, rotary, window, softcap", GQA(cache="grow", rotary="half", window=3, softcap=30.0),
          gqa_decode),
    *_gqa("token generation, shared buffer", GQA(cache="shared"), gqa_decode, quick=True),
    *_gqa("token generation, shared buffer, rotary", GQA(cache="shared", rotary="half"), gqa_decode),
    *_gqa("token generation, shared buffer, packed, sink", GQA(cache="shared", packed=True, sink=True), gqa_decode),
    *_gqa("token generation, smooth_softmax", GQA(cache="grow", smooth=True), gqa_decode),
    *_gqa("token generation, attention_bias", GQA(cache="grow", bias="broadcast"), gqa_decode),
    *_gqa("token generation, shared buffer, attention_bias", GQA(cache="shared", bias="full"), gqa_decode,
          quick=True),
    *_gqa("multi-token generation", GQA(cache="grow", rotary="half"), gqa_chunk),
    *_gqa("multi-token generation, shared buffer", GQA(cache="shared", rotary="half"), gqa_chunk),
]


# ---- MultiHeadAttention (test_mha.py: its input formats, masks, bias, cache) --------------------------------
@dataclass(frozen=True)
class MHA:
    """One MultiHeadAttention graph. ``form``: "q_k_v" (3-D Q, K, V), "bnsh_kv" (3-D Q with K, V as
    (B, N, L, H)), "qkv" (packed (B, S, N, 3, H)) or "kv" (Q and packed (B, L, N, 2, H)); ``mask``:
    None, "lens" (B,), "2d" (B, T), "3d" (B, S, T)."""

    h: int = 3
    d: int = 8
    form: str = "q_k_v"
    proj_bias: bool = False
    mask: str | None = None
    attn_bias: bool = False
    past: bool = False
    causal: int = 0
    scale: float | None = None

    def _node(self, names: list[str], outputs: list[str]) -> onnx.NodeProto:
        attrs = dict(num_heads=self.h, unidirectional=self.causal)
        if self.scale is not None:
            attrs["scale"] = self.scale
        return oh.make_node("MultiHeadAttention", names, outputs, name="mha", domain="com.microsoft", **attrs)

    def _graph(self, form: str) -> onnx.ModelProto:
        h, d = self.h, self.d
        kv_len = "S" if form == "qkv" else "L"
        keys = "T" if self.past else kv_len
        first = {"q_k_v": ["q", "k", "v"], "bnsh_kv": ["q", "k", "v"], "qkv": ["qkv", "", ""], "kv": ["q", "kv", ""]}
        names = first[form] + ["bias" if self.proj_bias else "", "mask" if self.mask else "",
                               "ab" if self.attn_bias else "", "pk" if self.past else "", "pv" if self.past else ""]
        q = ("q", F32, ["B", "S", h * d])
        inputs = {"q_k_v": [q, ("k", F32, ["B", "L", h * d]), ("v", F32, ["B", "L", h * d])],
                  "bnsh_kv": [q, ("k", F32, ["B", h, "L", d]), ("v", F32, ["B", h, "L", d])],
                  "qkv": [("qkv", F32, ["B", "S", h, 3, d])],
                  "kv": [("q", F32, ["B", "S", h * d]), ("kv", F32, ["B", "L", h, 2, d])]}[form]
        inputs += [("bias", F32, [3 * h * d])] if self.proj_bias else []
        inputs += [("mask", TP.INT32, {"lens": ["B"], "2d": ["B", keys], "3d": ["B", "S", keys]}[self.mask])] \
            if self.mask else []
        inputs += [("ab", F32, ["B", h, "S", keys])] if self.attn_bias else []
        inputs += [(n, F32, ["B", h, "P", d]) for n in ("pk", "pv")] if self.past else []
        outputs = [("y", F32, ["B", "S", h * d])]
        outputs += [(n, F32, ["B", h, keys, d]) for n in ("prk", "prv")] if self.past else []
        return graph([self._node(names, [o[0] for o in outputs])], inputs, outputs)

    def model(self) -> onnx.ModelProto:
        return self._graph(self.form)

    def apart(self) -> onnx.ModelProto:
        """The packed forms with Q, K, V apart: ORT's CPU EP has no kernel for packed QKV / KV."""
        return self._graph("q_k_v")

    def unpack(self, feed: Feed) -> Feed:
        out = {k: v for k, v in feed.items() if k not in ("qkv", "kv")}
        if "qkv" in feed:
            b, s = feed["qkv"].shape[:2]
            out.update({n: np.ascontiguousarray(feed["qkv"][:, :, :, i]).reshape(b, s, -1)
                        for i, n in enumerate("qkv")})
        if "kv" in feed:
            b, length = feed["kv"].shape[:2]
            out.update({n: np.ascontiguousarray(feed["kv"][:, :, :, i]).reshape(b, length, -1)
                        for i, n in enumerate("kv")})
        return out

    def feed(self, seed: int, batch: int, seq: int, kv: int, past: int = 0, lens: list[int] | None = None) -> Feed:
        rng = np.random.default_rng(seed)
        h, d = self.h, self.d
        kv = seq if self.form == "qkv" else kv
        feed: Feed = {"q_k_v": lambda: dict(q=randn(rng, batch, seq, h * d), k=randn(rng, batch, kv, h * d),
                                            v=randn(rng, batch, kv, h * d)),
                      "bnsh_kv": lambda: dict(q=randn(rng, batch, seq, h * d), k=randn(rng, batch, h, kv, d),
                                              v=randn(rng, batch, h, kv, d)),
                      "qkv": lambda: dict(qkv=randn(rng, batch, seq, h, 3, d)),
                      "kv": lambda: dict(q=randn(rng, batch, seq, h * d), kv=randn(rng, batch, kv, h, 2, d)),
                      }[self.form]()
        keys = kv + past
        if self.proj_bias:
            feed["bias"] = randn(rng, 3 * h * d)
        lens = lens or list(rng.integers(1, keys + 1, batch))
        if self.mask == "lens":
            feed["mask"] = np.array(lens, np.int32)
        elif self.mask:
            keep = np.arange(keys)[None] < np.array(lens)[:, None]  # right padding
            feed["mask"] = (keep[:, None] if self.mask == "3d" else keep).astype(np.int32)
            if self.mask == "3d":  # (a key for every query: a row of -10000s is fp32 noise in ORT and here)
                drawn = rng.random((batch, seq, keys)) < 0.8
                feed["mask"] = np.broadcast_to(feed["mask"], (batch, seq, keys)) & drawn
                feed["mask"][:, :, 0] = 1
        if self.attn_bias:
            feed["ab"] = randn(rng, batch, h, seq, keys)
        if self.past:
            feed["pk"], feed["pv"] = randn(rng, batch, h, past, d), randn(rng, batch, h, past, d)
        return feed


def mha_feeds(m: MHA, sweep: bool) -> list[Feed]:
    """Self-attention lengths, cross lengths, a one-query step; with a cache, its past."""
    past = (3, 6, 1) if m.past else (0, 0, 0)
    cross = (3, 1) if m.past else (7, 9)  # with a cache, the new keys are the queries' (as ORT's tests have them)
    feeds = [m.feed(0, 2, 4, 4, past[0]), m.feed(1, 1, 3, cross[0], past[1])]
    return feeds + ([m.feed(2, 3, 1, cross[1], past[2]), m.feed(3, 2, 16, 16, past[0], lens=[16, 1])] if sweep else [])


def _mha(feature: str, m: MHA, quick: bool = False) -> list[Case]:
    packed = m.form in ("qkv", "kv")
    extra = dict(reference=m.apart, convert=m.unpack) if packed else {}
    return [Case("MultiHeadAttention", feature, m.model, lambda: mha_feeds(m, False), quick=quick, **extra),
            Case("MultiHeadAttention", feature + " (sweep)", m.model, lambda: mha_feeds(m, True), **extra)]


MHA_CASES = [
    *_mha("Q, K, V", MHA(), quick=True),
    *_mha("Q, K, V, projection bias", MHA(proj_bias=True)),
    *_mha("key lengths (B,)", MHA(mask="lens")),
    *_mha("key padding mask (B, T)", MHA(mask="2d")),
    *_mha("mask (B, S, T)", MHA(mask="3d", h=2, d=16)),
    *_mha("attention_bias", MHA(attn_bias=True)),
    *_mha("causal, past and present", MHA(causal=1, past=True)),
    *_mha("past, present, key padding mask, bias", MHA(past=True, mask="2d", attn_bias=True, proj_bias=True)),
    *_mha("scale", MHA(scale=0.3)),
    *_mha("K, V in BNSH", MHA(form="bnsh_kv")),
    *_mha("K, V in BNSH, projection bias", MHA(form="bnsh_kv", proj_bias=True), quick=True),
    *_mha("packed QKV", MHA(form="qkv")),
    *_mha("packed QKV, projection bias", MHA(form="qkv", proj_bias=True), quick=True),
    *_mha("packed KV", MHA(form="kv", mask="lens")),
    *_mha("packed KV, projection bias", MHA(form="kv", proj_bias=True)),
]


# ---- Attention (attention_op_test.cc: its mask_index forms, past state, unidirectional, hidden sizes) -------
@dataclass(frozen=True)
class MsAttention:
    """One com.microsoft Attention graph. ``mask``: None, "lens" (B,), "end_start" (2B,), "2d" (B, T),
    "dummy" (B, 1) or "3d" (B, S, T). (ORT's CPU EP refuses Megatron's (B, 1, M, M): no case.)"""

    h: int = 2
    d: int = 4
    mask: str | None = None
    past: bool = False
    causal: int = 0
    qkv_sizes: tuple[int, int, int] | None = None
    input_hidden: int | None = None
    attn_bias: bool = False
    scale: float | None = None

    @property
    def sizes(self) -> tuple[int, int, int]:
        return self.qkv_sizes or (self.h * self.d,) * 3

    def model(self) -> onnx.ModelProto:
        hidden = self.input_hidden or self.h * self.d
        keys = "T" if self.past else "S"
        attrs = dict(num_heads=self.h, unidirectional=self.causal)
        if self.qkv_sizes:
            attrs["qkv_hidden_sizes"] = list(self.qkv_sizes)
        if self.scale is not None:
            attrs["scale"] = self.scale
        names = ["x", "w", "b", "mask" if self.mask else "", "past" if self.past else "",
                 "ab" if self.attn_bias else ""]
        outputs = [("y", F32, ["B", "S", self.sizes[2]])]
        outputs += [("present", F32, [2, "B", self.h, keys, self.d])] if self.past else []
        node = oh.make_node("Attention", names, [o[0] for o in outputs], name="attention", domain="com.microsoft",
                            **attrs)
        mask_shape = {"lens": ["B"], "end_start": ["B2"], "2d": ["B", keys], "dummy": ["B", 1],
                      "3d": ["B", "S", keys]}.get(self.mask)
        inputs = [("x", F32, ["B", "S", hidden]), ("w", F32, [hidden, sum(self.sizes)]), ("b", F32, [sum(self.sizes)])]
        inputs += [("mask", TP.INT32, mask_shape)] if self.mask else []
        inputs += [("past", F32, [2, "B", self.h, "P", self.d])] if self.past else []
        inputs += [("ab", F32, ["B", self.h, "S", keys])] if self.attn_bias else []
        return graph([node], inputs, outputs)

    def feed(self, seed: int, batch: int, seq: int, past: int = 0, lens: list[int] | None = None,
             starts: list[int] | None = None) -> Feed:
        rng = np.random.default_rng(seed)
        hidden = self.input_hidden or self.h * self.d
        keys = seq + past
        w = randn(rng, hidden, sum(self.sizes)) / np.float32(np.sqrt(hidden))
        feed: Feed = {"x": randn(rng, batch, seq, hidden), "w": w, "b": randn(rng, sum(self.sizes))}
        lens = list(rng.integers(1, keys + 1, batch)) if lens is None else lens
        starts = [0] * batch if starts is None else starts
        keep = (np.arange(keys)[None] < np.array(lens)[:, None]) & (np.arange(keys)[None] >= np.array(starts)[:, None])
        if self.mask == "lens":
            feed["mask"] = np.array(lens, np.int32)
        elif self.mask == "end_start":
            feed["mask"] = np.array(lens + starts, np.int32)
        elif self.mask == "2d":
            feed["mask"] = keep.astype(np.int32)
        elif self.mask == "dummy":
            feed["mask"] = np.ones((batch, 1), np.int32)
        elif self.mask == "3d":
            feed["mask"] = (keep[:, None] & (rng.random((batch, seq, keys)) < 0.8)).astype(np.int32)
            feed["mask"][:, :, 0] = 1  # a key for every query: a row of -10000s is fp32 noise in ORT and here
        if self.past:
            feed["past"] = randn(rng, 2, batch, self.h, past, self.d)
        if self.attn_bias:
            feed["ab"] = randn(rng, batch, self.h, seq, keys)
        return feed


def attention_feeds(a: MsAttention, sweep: bool, **lengths) -> list[Feed]:
    p = (2, 5) if a.past else (0, 0)
    feeds = [a.feed(0, 2, 3, p[0], **lengths.get("first", {})), a.feed(1, 1, 4, p[1], **lengths.get("second", {}))]
    return feeds + ([a.feed(2, 3, 7, p[1]), a.feed(3, 2, 1, p[0])] if sweep else [])


def _attention(feature: str, a: MsAttention, quick: bool = False, tolerance: float = 1e-4, **lengths) -> list[Case]:
    return [Case("Attention", feature, a.model, lambda: attention_feeds(a, False, **lengths), quick=quick,
                 tolerance=tolerance),
            Case("Attention", feature + " (sweep)", a.model, lambda: attention_feeds(a, True, **lengths),
                 tolerance=tolerance)]


ATTENTION_CASES = [
    *_attention("no mask", MsAttention()),
    *_attention("key lengths (B,)", MsAttention(mask="lens"), first={"lens": [2, 1]}, second={"lens": [9]}),
    # ORT adds -10000 to every logit of a row whose keys are all masked: its fp32 rounding at 1e4 (ulp 1e-3)
    # puts its answer 1.2e-4 (relative) from the exact one, every key alike, which tvmattn computes
    *_attention("key lengths all 0", MsAttention(mask="lens"), quick=True, tolerance=1e-3, first={"lens": [0, 0]},
                second={"lens": [0]}),
    *_attention("end and start positions (2B,), right padding", MsAttention(mask="end_start"),
                first={"lens": [2, 3]}, second={"lens": [3]}),
    *_attention("end and start positions (2B,), left padding", MsAttention(mask="end_start"), quick=True,
                first={"lens": [3, 3], "starts": [1, 0]}, second={"lens": [4], "starts": [2]}),
    *_attention("end and start positions (2B,), with past", MsAttention(mask="end_start", past=True, causal=1),
                first={"lens": [5, 5], "starts": [2, 0]}, second={"lens": [9], "starts": [3]}),
    *_attention("key padding mask (B, T)", MsAttention(mask="2d")),
    *_attention("dummy mask (B, 1)", MsAttention(mask="dummy")),
    *_attention("mask (B, S, T)", MsAttention(mask="3d")),
    *_attention("unidirectional, mask (B, S, T)", MsAttention(mask="3d", causal=1)),
    *_attention("unidirectional", MsAttention(causal=1)),
    *_attention("past state", MsAttention(past=True, causal=1), quick=True),
    *_attention("past state, key padding mask", MsAttention(past=True, causal=1, mask="2d")),
    *_attention("past state, key lengths", MsAttention(past=True, causal=1, mask="lens")),
    *_attention("qkv_hidden_sizes", MsAttention(qkv_sizes=(6, 6, 4), h=2)),
    *_attention("relative position bias", MsAttention(mask="lens", attn_bias=True)),
    *_attention("pruned input hidden size", MsAttention(input_hidden=12)),
    *_attention("scale", MsAttention(scale=0.25)),
]


# ---- RotaryEmbedding (rotary_embedding_op_test.cc) and SkipLayerNormalization (skiplayernorm_op_test.cc) ---
@dataclass(frozen=True)
class Rotary:
    """com.microsoft RotaryEmbedding. ``rank`` 3 (B, S, N·H) or 4 (B, N, S, H); ``num_heads`` 0: the head
    size comes from the cos cache (ORT's LlamaMSFT tests); ``offset``: position_ids (1,) is the first position."""

    h: int = 2
    d: int = 8
    rank: int = 3
    num_heads: int = 0
    rotary_dim: int = 0
    interleaved: int = 0
    offset: bool = False
    packed_batching: int = 0
    max_pos: int = 32

    def model(self) -> onnx.ModelProto:
        attrs = dict(interleaved=self.interleaved, is_packed_batching=self.packed_batching)
        attrs.update({k: v for k, v in (("num_heads", self.num_heads), ("rotary_embedding_dim", self.rotary_dim)) if v})
        node = oh.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], name="rotary", domain="com.microsoft",
                            **attrs)
        x = ["B", "S", self.h * self.d] if self.rank == 3 else ["B", self.h, "S", self.d]
        half = (self.rotary_dim or self.d) // 2
        return graph([node], [("x", F32, x), ("pos", TP.INT64, [1] if self.offset else ["B", "S"]),
                              ("cos", F32, [self.max_pos, half]), ("sin", F32, [self.max_pos, half])],
                     [("y", F32, x)])

    def feed(self, seed: int, batch: int, seq: int, first: int = 0, positions: np.ndarray | None = None) -> Feed:
        rng = np.random.default_rng(seed)
        x = randn(rng, batch, seq, self.h * self.d) if self.rank == 3 else randn(rng, batch, self.h, seq, self.d)
        cos, sin = rotary_caches(rng, self.max_pos, (self.rotary_dim or self.d) // 2)
        if positions is None:
            positions = np.array([first]) if self.offset else rng.integers(0, self.max_pos, (batch, seq))
        return {"x": x, "pos": positions.astype(np.int64), "cos": cos, "sin": sin}


def rotary_feeds(r: Rotary, sweep: bool) -> list[Feed]:
    feeds = [r.feed(0, 1, 3, first=0), r.feed(1, 2, 5, first=7)]
    return feeds + ([r.feed(2, 3, 16, first=16), r.feed(3, 1, 1, first=31)] if sweep else [])


def _rotary(feature: str, r: Rotary, quick: bool = False) -> list[Case]:
    return [Case("RotaryEmbedding", feature, r.model, lambda: rotary_feeds(r, False), quick=quick),
            Case("RotaryEmbedding", feature + " (sweep)", r.model, lambda: rotary_feeds(r, True))]


ROTARY_CASES = [
    *_rotary("3-D, head size from the cache, interleaved", Rotary(interleaved=1, offset=True), quick=True),
    *_rotary("3-D, head size from the cache", Rotary(offset=True)),
    *_rotary("3-D, head size from the cache, position_ids (B, S)", Rotary(h=4, d=16, interleaved=1)),
    *_rotary("3-D, num_heads", Rotary(num_heads=2)),
    *_rotary("3-D, num_heads, rotary_embedding_dim (Phi)", Rotary(h=2, d=16, num_heads=2, rotary_dim=8)),
    *_rotary("4-D (B, N, S, H)", Rotary(rank=4, interleaved=1)),
    *_rotary("4-D, rotary_embedding_dim", Rotary(rank=4, num_heads=2, d=16, rotary_dim=8, offset=True)),
    *_rotary("is_packed_batching", Rotary(packed_batching=1, num_heads=2), quick=True),
]


@dataclass(frozen=True)
class SkipNorm:
    """SkipLayerNormalization (or the simplified one): ``skip`` (B, S, H), (1, S, H) or (S, H)."""

    hidden: int = 16
    skip: str = "bsh"
    beta: bool = True
    bias: bool = False
    simplified: bool = False
    outputs: tuple[str, ...] = ("y",)
    epsilon: float = 1e-5

    def model(self) -> onnx.ModelProto:
        op = "SkipSimplifiedLayerNormalization" if self.simplified else "SkipLayerNormalization"
        names = ["x", "skip", "gamma"] + ([] if self.simplified else ["beta" if self.beta else ""])
        names += ["bias"] if self.bias else []
        outs = [n if n in self.outputs else "" for n in ("y", "mean", "inv_std_var", "sum")]
        node = oh.make_node(op, names, outs, name="skip_norm", domain="com.microsoft", epsilon=self.epsilon)
        h = self.hidden
        skip = {"bsh": ["B", "S", h], "1sh": [1, "S", h], "sh": ["S", h]}[self.skip]
        inputs = [("x", F32, ["B", "S", h]), ("skip", F32, skip), ("gamma", F32, [h])]
        inputs += [("beta", F32, [h])] if self.beta and not self.simplified else []
        inputs += [("bias", F32, [h])] if self.bias else []
        shapes = {"y": ["B", "S", h], "mean": ["B", "S", 1], "inv_std_var": ["B", "S", 1], "sum": ["B", "S", h]}
        return graph([node], inputs, [(n, F32, shapes[n]) for n in outs if n])

    def feed(self, seed: int, batch: int, seq: int) -> Feed:
        rng = np.random.default_rng(seed)
        skip = {"bsh": (batch, seq), "1sh": (1, seq), "sh": (seq,)}[self.skip]
        feed = {"x": randn(rng, batch, seq, self.hidden), "skip": randn(rng, *skip, self.hidden),
                "gamma": randn(rng, self.hidden), "beta": randn(rng, self.hidden), "bias": randn(rng, self.hidden)}
        return {k: v for k, v in feed.items() if k in ("x", "skip", "gamma") or getattr(self, k) and not (
            k == "beta" and self.simplified)}


def skip_feeds(s: SkipNorm, sweep: bool) -> list[Feed]:
    return [s.feed(0, 1, 2), s.feed(1, 2, 3)] + ([s.feed(2, 3, 33)] if sweep else [])


def _skip(feature: str, s: SkipNorm, quick: bool = False) -> list[Case]:
    return [Case("SkipLayerNormalization", feature, s.model, lambda: skip_feeds(s, False), quick=quick),
            Case("SkipLayerNormalization", feature + " (sweep)", s.model, lambda: skip_feeds(s, True))]


SKIP_CASES = [
    *_skip("skip (B, S, H), beta", SkipNorm()),
    *_skip("no beta, bias", SkipNorm(beta=False, bias=True)),
    *_skip("skip (1, S, H)", SkipNorm(skip="1sh")),
    *_skip("skip (S, H), input_skip_bias_sum", SkipNorm(skip="sh", bias=True, outputs=("y", "sum")), quick=True),
    *_skip("mean and inv_std_var", SkipNorm(outputs=("y", "mean", "inv_std_var", "sum")), quick=True),
    *_skip("hidden size 768, epsilon 1e-12", SkipNorm(hidden=768, epsilon=1e-12)),
    *_skip("hidden size 7", SkipNorm(hidden=7, bias=True)),
    *_skip("simplified", SkipNorm(simplified=True, bias=True, outputs=("y", "sum"))),
    *_skip("simplified, mean and inv_std_var", SkipNorm(simplified=True, outputs=("y", "mean", "inv_std_var"))),
]

CASES = GQA_CASES + MHA_CASES + ATTENTION_CASES + ROTARY_CASES + SKIP_CASES
