"""ONNX Runtime's test cases for its attention operators (tests/ort_cases.py), each graph run through ORT's
CPU EP and tvmattn: every output, ``present_*`` too, within float32's tolerance of ORT's; the attention on
tvmattn kernels; and every index input ORT refuses (outside a cache) refused as a TvmAttnError.

``python tests/test_onnx_ort_cases.py [--all]`` prints the table op × feature: pass / refused (the
reason) / wrong (the error) / rejected (an out-of-range input refused) / not refused.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import pytest
from onnx_testing import kernels_used, ort_run
from ort_cases import CASES, GQA, Case, Feed, MsAttention, Rotary

import tvmattn
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.verify import errors

ATTENTION_OPS = ("GroupQueryAttention", "MultiHeadAttention", "Attention")


# ---- inputs ORT refuses: an index outside the buffer it indexes -----------------------------------------------
@dataclass(frozen=True)
class Reject:
    op: str
    what: str
    model: Callable[[], onnx.ModelProto]
    feed: Callable[[], Feed]
    match: str  # what tvmattn's TvmAttnError must say (a regex)

    @property
    def id(self) -> str:
        return f"{self.op}:{self.what}"


_SHARED, _GROW = GQA(cache="shared"), GQA(cache="grow")
_ROTARY_SHARED = GQA(cache="shared", rotary="half", max_pos=32)
_ROTARY_POS = GQA(rotary="half", position_ids=True, max_pos=32)
_ROPE, _ROPE_OFFSET = Rotary(num_heads=2), Rotary(num_heads=2, offset=True)
_LENS = MsAttention(mask="lens")
_SEQLENS = r"node 'gqa' \(com.microsoft.GroupQueryAttention\).*seqlens_k"


def _positions(r: Rotary, positions: list) -> Callable[[], Feed]:
    return lambda: r.feed(0, 1, len(positions), positions=np.array([positions]))


REJECTS = [
    Reject("GroupQueryAttention", "seqlens_k past the shared buffer", _SHARED.model,
           lambda: _SHARED.feed(0, 1, 1, [41], past=25, total=20), _SEQLENS),
    Reject("GroupQueryAttention", "seqlens_k negative", _SHARED.model,
           lambda: _SHARED.feed(0, 2, 1, [5, -6], past=25, total=5), _SEQLENS),
    Reject("GroupQueryAttention", "seqlens_k 1e8", _SHARED.model,
           lambda: _SHARED.feed(0, 1, 1, [100_000_001], past=25, total=20), _SEQLENS),
    Reject("GroupQueryAttention", "seqlens_k past present (growing cache)", _GROW.model,
           lambda: _GROW.feed(0, 1, 1, [12], past=8, total=9), _SEQLENS),
    Reject("GroupQueryAttention", "total_sequence_length past the shared buffer", _SHARED.model,
           lambda: _SHARED.feed(0, 1, 1, [5], past=25, total=30),
           r"node 'gqa' \(com.microsoft.GroupQueryAttention\).*total_sequence_length"),
    Reject("GroupQueryAttention", "seqlens_k past the rotary cache", _ROTARY_SHARED.model,
           lambda: _ROTARY_SHARED.feed(0, 1, 1, [40], past=48, total=40), r"node 'gqa' .*cos_cache"),
    Reject("GroupQueryAttention", "position_ids past the rotary cache", _ROTARY_POS.model,
           lambda: _ROTARY_POS.feed(0, 1, 2, [2], positions=np.array([[31, 32]])), r"node 'gqa' .*position_ids"),
    Reject("GroupQueryAttention", "position_ids negative", _ROTARY_POS.model,
           lambda: _ROTARY_POS.feed(0, 1, 2, [2], positions=np.array([[-1, 0]])), r"node 'gqa' .*position_ids"),
    Reject("Attention", "mask_index negative", _LENS.model, lambda: _LENS.feed(0, 2, 3, lens=[-1, 2]),
           r"node 'attention' .*mask_index"),
    Reject("RotaryEmbedding", "position_ids at the cache's length", _ROPE.model, _positions(_ROPE, [30, 31, 32]),
           r"node 'rotary' .*position_ids"),
    Reject("RotaryEmbedding", "position_ids -1", _ROPE.model, _positions(_ROPE, [-1, 0]),
           r"node 'rotary' .*position_ids"),
    Reject("RotaryEmbedding", "position_ids 1e8", _ROPE.model, _positions(_ROPE, [100_000_000]),
           r"node 'rotary' .*position_ids"),
    Reject("RotaryEmbedding", "offset past the cache", _ROPE_OFFSET.model, lambda: _ROPE_OFFSET.feed(0, 1, 5, first=30),
           r"node 'rotary' .*position_ids"),
]


def outcome(case: Case) -> tuple[str, str]:
    """("pass" | "refused" | "wrong", detail) for ``case``."""
    try:
        imported = tvmattn.import_onnx(case.model())
    except TvmAttnError as err:
        return "refused", str(err)
    if case.op in ATTENTION_OPS and not kernels_used(imported):
        return "wrong", "the attention is not on a tvmattn kernel"
    reference = (case.reference or case.model)()
    for i, feed in enumerate(case.feeds()):
        try:
            want = ort_run(reference, case.convert(feed))
        except Exception as err:  # noqa: BLE001 (a case ORT itself refuses is a broken case)
            return "ORT refuses", f"feed {i}: {str(err)[:300]}"
        try:
            got = imported.run(feed)
        except TvmAttnError as err:
            return "refused", f"feed {i}: {err}"
        for name, g, w in zip((o.name for o in reference.graph.output), got, want, strict=True):
            if g.shape != w.shape:
                return "wrong", f"feed {i}: {name} has shape {g.shape}, ORT's {w.shape}"
            _, error = errors(g, w)
            if not error <= case.tolerance:
                return "wrong", f"feed {i}: {name} off by {error:.3g} (relative to max |ORT|)"
    return "pass", ""


def rejection(reject: Reject) -> tuple[str, str]:
    """("rejected" | "not refused", detail): ORT refuses the feed; tvmattn must, with ``reject.match``."""
    model, feed = reject.model(), reject.feed()
    with pytest.raises(Exception):  # noqa: B017 (ORT's error types are its own)
        ort_run(model, feed)
    try:
        out = tvmattn.import_onnx(model).run(feed)
    except TvmAttnError as err:
        return ("rejected" if re.search(reject.match, str(err)) else "rejected, unnamed"), str(err)
    return "not refused", f"finite output: {all(np.isfinite(o).all() for o in out)}"


@pytest.mark.parametrize("case", [c if c.quick else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
                         ids=lambda c: c.id)
def test_matches_onnx_runtime(case):
    status, detail = outcome(case)
    assert status == "pass", detail


@pytest.mark.parametrize("reject", REJECTS, ids=lambda r: r.id)
def test_out_of_range_index_is_refused(reject):
    status, detail = rejection(reject)
    assert status == "rejected", detail


def table(cases: list[Case], rejects: list[Reject]) -> str:
    rows = ["| op | feature | outcome |", "|---|---|---|"]
    for c in cases:
        status, detail = outcome(c)
        rows.append(f"| {c.op} | {c.feature} | {status}{': ' + detail[:160] if detail else ''} |")
    for r in rejects:
        status, detail = rejection(r)
        rows.append(f"| {r.op} | {r.what} | {status}: {detail[:160]} |")
    return "\n".join(rows)


if __name__ == "__main__":
    every = "--all" in sys.argv
    pick = [a for a in sys.argv[1:] if not a.startswith("--")]
    chosen = [c for c in CASES if (every or not c.id.endswith("(sweep)"))
              and (not pick or any(p in c.id for p in pick))]
    print(table(chosen, [r for r in REJECTS if not pick or any(p in r.id for p in pick)]))
