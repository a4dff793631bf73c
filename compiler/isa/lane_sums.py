"""A decode step's dot products along d_k, summed in registers: a tensor intrinsic.

With one query there is no vector of queries, so each key's dot product runs along d_k in one
vector of ``lanes`` partial sums (`schedules.cpu`), and the key's score is their sum.
Left to LLVM that sum is a chain of ``lanes`` dependent scalar adds (no reassociation: 16 adds and
their 15 extracts per key, 56 % of a bf16 decode kernel's time at (1, 32, 512, 128) on Zen 5). Here
it is a tree: log2(lanes) rounds that add a vector's upper half to its lower half.
"""

from __future__ import annotations

from tvm import tirx
from tvm.s_tir import SBlock, SBlockRealize
from tvm.script import tirx as T

from tvmattn.compiler.isa.intrinsics import registered
from tvmattn.compiler.isa.panels import shuffle


def lane_sum_intrinsic(lanes: int) -> str:
    """The name of the tensor intrinsic (registered on first use) that adds the sum of ``lanes``
    contiguous fp32 values to one accumulator."""
    return registered(f"tvmattn_lane_sum_{lanes}", lambda: _lane_sum(lanes))


def _lane_sum(lanes: int) -> tuple[tirx.PrimFunc, tirx.PrimFunc]:
    """`lane_sum_intrinsic`'s description (a serial reduction) and implementation (the tree)."""

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        partial = T.match_buffer(a, (lanes,), "float32", offset_factor=1)
        acc = T.match_buffer(c, (1,), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads(acc[0], partial[0:lanes])
            T.writes(acc[0])
            for lane in range(lanes):
                with T.sblock("sum"):
                    v = T.axis.reduce(lanes, lane)
                    acc[0] = acc[0] + partial[v]

    partial, acc = desc.params
    x = partial.vload([0], f"float32x{lanes}")
    width = lanes
    while width > 1:  # lanes i and i + width/2 added: the upper half onto the lower
        width //= 2
        x = shuffle([x], list(range(width))) + shuffle([x], list(range(width, 2 * width)))
    store = acc.vstore([0], acc.vload([0], "float32") + x)
    root = desc.body.block
    return desc, desc.with_body(SBlockRealize([], True, SBlock([], root.reads, root.writes, "root", store)))
