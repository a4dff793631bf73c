"""Small steps every CPU schedule rule takes: vectorising by the widest vector that fits, split factors
that respect static extents, knob values under MetaSchedule, copies of an operand, tensorizing."""

from __future__ import annotations

import tvm
from tvm.s_tir import Schedule

from tvmattn.compiler.isa.intrinsics import registered
from tvmattn.compiler.passes import KEY_BLOCKS
from tvmattn.compiler.te_attention import KEY_STAGE
from tvmattn.schedules.knobs import KnobValue


def vectorize(sch: Schedule, loop, extent: int | None, lanes: int) -> None:
    """Vectorise ``loop`` by the widest vector (at most ``lanes``) dividing its extent; split off if longer."""
    if extent is None:
        extent_expr = sch.get(loop).extent
        if not hasattr(extent_expr, "value"):  # symbolic: whole vectors, and a tail predicate
            sch.vectorize(sch.split(loop, [None, lanes])[1])  # (the tail peeled: passes.peel_key_tails)
            return
        extent = int(extent_expr.value)
    width = lanes_for(extent, lanes)
    if width == 1:
        return
    sch.vectorize(loop if extent == width else sch.split(loop, [None, width])[1])


def lanes_for(extent: int, lanes: int) -> int:
    """The widest power-of-two vector, at most ``lanes``, that divides ``extent``."""
    while lanes > 1 and extent % lanes:
        lanes //= 2
    return lanes


def at_most(sch: Schedule | None, factor: KnobValue, extent) -> KnobValue:
    """A split factor no larger than a static extent: a tile of one real row and padding rows makes
    TVM's buffer compaction leak loop variables into allocation sizes."""
    return extent if isinstance(extent, int) and extent < knob_int(sch, factor) else factor


def knob_int(sch: Schedule | None, value: KnobValue) -> int:
    """A knob's value now: itself, or the current decision of a sampled variable. Only buffer layouts
    read it, and a layout never changes what is computed, so a later resampling stays correct."""
    return value if isinstance(value, int) else int(sch.get(value))


def divisor_at_most(n, limit: int) -> int:
    """The largest factor of ``n`` up to ``limit`` (1 when n is symbolic)."""
    if not isinstance(n, int):
        return 1
    return max(d for d in range(1, limit + 1) if n % d == 0)


def loops_by_axis(sch: Schedule, block) -> dict:
    """An untransformed block's loops by the TE axis they run over (b, i, s, c, …)."""
    return {iv.var.name.removeprefix("v_"): loop for iv, loop in zip(sch.get(block).iter_vars, sch.get_loops(block))}


def has_block(sch: Schedule, name: str) -> bool:
    try:
        sch.get_sblock(name)
        return True
    except Exception:  # s_tir raises ScheduleError for an unknown name
        return False


def copy_of(sch: Schedule, block, names: tuple[str, ...], consumers: list | None = None):
    """`cache_read` of ``block``'s operand named one of ``names`` (a TE input or the stage it was
    inlined from), for ``consumers`` (default: every reader)."""
    reads = [r.source.name for r in sch.get(block).reads]
    index = next(i for i, name in enumerate(reads) if name in names)
    if consumers is None:
        return sch.cache_read(block, index, "global")
    return sch.cache_read(block, index, "global", consumer_blocks=consumers)


def tensorize(sch: Schedule, loop, intrinsic: str, key_blocks: str | None = None) -> None:
    """Tensorize the loop nest from ``loop`` in with ``intrinsic``; ``key_blocks`` (`passes.KEY_BLOCKS`)
    says which of the new block's iterators are its queries and keys, for `skip_masked_key_tiles`."""
    outer = sch.blockize(loop)
    sch.tensorize(outer, registered(intrinsic))
    if key_blocks is not None:
        sch.annotate(outer, KEY_STAGE, 1)
        sch.annotate(outer, KEY_BLOCKS, key_blocks)


def only_consumer(sch: Schedule, producer, block) -> bool:
    """``block`` is ``producer``'s one consumer and covers all it writes: TVM 0.27's
    `reverse_compute_inline` of a consumer over fewer elements (a padded GEMM's real rows) keeps the
    producer's domain and its stores past the consumer's buffer."""
    consumers = sch.get_consumers(producer)
    return len(consumers) == 1 and sch.get(consumers[0]).same_as(sch.get(block)) and same_domain(sch, producer, block)


def same_domain(sch: Schedule, producer, block) -> bool:
    """The two blocks iterate over the same elements (their axes of extent one aside)."""
    analyzer = tvm.sym.Analyzer()
    mine, theirs = ([iv.dom.extent for iv in sch.get(b).iter_vars if not analyzer.can_prove_equal(iv.dom.extent, 1)]
                    for b in (producer, block))  # (a GEMV's unit row axis is on one side only)
    return len(mine) == len(theirs) and all(analyzer.can_prove_equal(a, b) for a, b in zip(mine, theirs))
