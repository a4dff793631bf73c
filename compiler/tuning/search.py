"""`KnobSearch`: a MetaSchedule search strategy over the knob grid of a tvmattn schedule.

Each round proposes unmeasured points (the default schedule first, then neighbours of the best points
measured so far, then random points), schedules them, drops those whose scheduled TIR equals one
already measured (knobs that do not matter for this spec, e.g. projection tiles of a core kernel),
and measures the ones MetaSchedule's cost model ranks best, plus a few random ones so a wrong model
cannot trap the search. Points measured in earlier runs (the records given to it) are never measured
again, and they train the cost model before the first round, so an interrupted search resumes where
it stopped. After the search the default and the `FINALISTS` fastest points are measured again,
alternately, in `CONFIRM_ROUNDS` rounds (unless each was measured more than once before): compiles
build from the lowest median of the points measured more than once (`records.chosen`), not from one
lucky measurement.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import Schedule
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.runner import RunnerResult
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate, PySearchStrategy
from tvm.target import Target
from tvm.tirx import PrimFunc

from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.tuning.records import CONFIRM_ROUNDS, FINALISTS, Record
from tvmattn.compiler.tuning.space import KnobSpace, Point, candidate, relevant

POOL_FACTOR = 3  # schedules built per candidate measured: the cost model's room to choose
EXPLORE = 0.25  # share of each round measured at random from the pool
WARM_START = 64  # earlier measurements that train the cost model before the first round


@dataclass(frozen=True)
class Task:
    """One workload to tune: the user's spec, the sizes it is measured at, its concrete instance."""

    spec: AttentionSpec
    at: dict[str, int]
    instance: AttentionSpec
    func: PrimFunc
    target: Target
    space: KnobSpace
    budget: int  # trials still to measure


@dataclass(frozen=True)
class Measurement:
    knobs: dict[str, int]
    ir_hash: str
    run_secs: list[float] | None
    error: str | None


@derived_object
class KnobSearch(PySearchStrategy):
    def __init__(self, task: Task, prior: list[Record], report: Callable[[Task, list[Measurement], bool], None],
                 stop: Callable[[], bool], seed: int = 0) -> None:
        self.task, self.prior, self.report, self.stop, self.seed = task, prior, report, stop, seed
        self.rng = random.Random(seed)
        self.space = task.space  # narrowed to the knobs that matter for this spec in pre_tuning
        self.measured: dict[Point, float] = {}  # latency in s; inf when it failed
        self.times: dict[Point, int] = {}  # measurements of each point, earlier runs' included
        self.hashes: set[str] = set()
        self.skip: set[Point] = set()  # points that did not schedule, or duplicate a measured TIR
        self.pending: list[tuple[Point, Schedule, str]] = []
        self.args_info = ArgInfo.from_prim_func(task.func)
        self.context = None
        self.cost_model = None
        self.max_trials = self.per_round = self.done = 0
        self.confirmations: int | None = None  # rounds left, once the search is over
        self.finalists: list[tuple[Point, Schedule, str]] = []  # (point, its schedule, its TIR's hash)

    def _initialize_with_tune_context(self, context) -> None:
        self.context = context

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        self.max_trials = min(max_trials, self.task.budget)
        self.per_round = num_trials_per_iter
        self.cost_model = cost_model
        self.space = relevant(self.task.space, self._hash_of)
        for r in self.prior:
            point = self.space.point(r.knobs)
            if point is not None:
                self.measured[point] = r.latency_us * 1e-6 if r.ok else float("inf")
                self.times[point] = self.times.get(point, 0) + 1
            if r.ir_hash:
                self.hashes.add(r.ir_hash)
        self._warm_cost_model()

    def post_tuning(self) -> None:
        self.pending = []

    def generate_measure_candidates(self) -> list[MeasureCandidate] | None:
        wanted = min(self.per_round, self.max_trials - self.done)
        if self.stop():
            return None
        if wanted <= 0:
            return self._confirmation()
        pool = self._pool(wanted * POOL_FACTOR)
        if not pool:  # every point of the space is measured
            return self._confirmation()
        self.pending = self._choose(pool, wanted)
        return [MeasureCandidate(sch, self.args_info) for _, sch, _ in self.pending]

    def notify_runner_results(self, measure_candidates, results) -> None:
        out = []
        for (point, _, ir_hash), result in zip(self.pending, results):
            secs = _seconds(result)
            self.measured[point] = statistics.median(secs) if secs else float("inf")
            self.times[point] = self.times.get(point, 0) + 1
            self.hashes.add(ir_hash)
            error = None if secs else (str(result.error_msg or "no timing").strip().splitlines() or ["?"])[-1][:300]
            out.append(Measurement(self.space.values(point), ir_hash, secs, error))
        self.done += len(out)
        self.pending = []
        self.report(self.task, out, self.confirmations is not None)

    def _confirmation(self) -> list[MeasureCandidate] | None:
        """The next round measuring the default and the finalists again (scheduled once, for every
        round); None when there is none left, or every finalist has been measured more than once
        already (a re-run that finds the budget spent)."""
        if self.confirmations is None:  # the search is over: the points to confirm, fixed now
            fastest = [p for _, p in sorted((t, p) for p, t in self.measured.items() if t < float("inf"))]
            default = [self.space.default()] if self.space.default() in fastest else []
            points = default + [p for p in fastest if p not in default][:FINALISTS]
            unconfirmed = any(self.times.get(p, 0) < 2 for p in points)
            self.confirmations = CONFIRM_ROUNDS if unconfirmed and len(points) > 1 else 0
            if self.confirmations:
                schedules = [self._schedule(p) for p in points]
                self.finalists = [(p, sch, _ir_hash(sch)) for p, sch in zip(points, schedules)]
        if self.confirmations == 0:
            return None
        self.confirmations -= 1
        self.pending = list(self.finalists)
        return [MeasureCandidate(sch, self.args_info) for _, sch, _ in self.pending]

    def clone(self) -> "KnobSearch":
        return KnobSearch(self.task, self.prior, self.report, self.stop, self.seed)

    # ---- proposals ------------------------------------------------------------------------------
    def _proposals(self):
        """Points worth trying, best ideas first; random points without end."""
        space = self.space
        if space.default() not in self.measured:
            yield space.default()
        best = sorted((t, p) for p, t in self.measured.items() if t < float("inf"))[:3]
        near = [n for _, p in best for n in space.neighbours(p)]
        self.rng.shuffle(near)
        yield from near
        while True:
            yield space.random(self.rng)

    def _pool(self, size: int) -> list[tuple[Point, Schedule, str]]:
        pool: list[tuple[Point, Schedule, str]] = []
        seen: set[Point] = set()
        pooled: set[str] = set()
        attempts = min(self.space.size, size * 20)
        for point in self._proposals():
            if len(pool) >= size or attempts <= 0:
                break
            attempts -= 1
            if point in self.measured or point in self.skip or point in seen:
                continue
            seen.add(point)
            try:
                sch = self._schedule(point)
            except Exception:  # a combination the schedule rejects for this spec: not a candidate
                self.skip.add(point)
                continue
            ir_hash = _ir_hash(sch)
            if ir_hash in self.hashes or ir_hash in pooled:
                self.skip.add(point)  # the same kernel as one measured or pooled
                continue
            pooled.add(ir_hash)
            pool.append((point, sch, ir_hash))
        return pool

    def _schedule(self, point: Point) -> Schedule:
        return candidate(self.task.func, self.task.instance, self.task.target, self.space.values(point))

    def _hash_of(self, point: Point) -> str | None:
        try:
            return _ir_hash(self._schedule(point))
        except Exception:  # a combination the schedule rejects for this spec
            return None

    def _choose(self, pool: list, wanted: int) -> list:
        """The default first (when new), then the cost model's favourites, then a few at random."""
        if len(pool) <= wanted:
            return pool
        first = [i for i, c in enumerate(pool) if c[0] == self.space.default()][:1]
        rest = [i for i in range(len(pool)) if i not in first]
        scores = self.cost_model.predict(self.context, [MeasureCandidate(pool[i][1], self.args_info) for i in rest])
        ranked = [rest[j] for j in np.argsort(-np.asarray(scores), kind="stable")]
        explore = int(round(EXPLORE * wanted)) if wanted > 2 else 0
        chosen = first + ranked[:wanted - len(first) - explore]
        leftovers = [i for i in ranked if i not in chosen]
        chosen += self.rng.sample(leftovers, min(explore, len(leftovers)))
        return [pool[i] for i in chosen]

    def _warm_cost_model(self) -> None:
        recent = [r for r in self.prior if r.ok][-WARM_START:]
        if not recent or self.cost_model is None:
            return
        candidates, results = [], []
        for r in recent:
            try:
                sch = candidate(self.task.func, self.task.instance, self.task.target, r.knobs)
            except Exception:  # a stale record: it cannot teach the model about today's schedule
                continue
            candidates.append(MeasureCandidate(sch, self.args_info))
            results.append(RunnerResult([x * 1e-6 for x in r.runs_us or [r.latency_us]], None))
        if candidates:
            self.cost_model.update(self.context, candidates, results)


def _ir_hash(sch: Schedule) -> str:
    return f"{tvm_ffi.structural_hash(sch.mod):x}"


def _seconds(result: RunnerResult) -> list[float] | None:
    if result.error_msg or not result.run_secs:
        return None
    return [float(getattr(x, "value", x)) for x in result.run_secs]
