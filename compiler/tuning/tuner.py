"""`tune`: search a schedule's knobs for one attention with MetaSchedule, writing every measurement.

One MetaSchedule task per representative point (a concrete spec: the spec itself, or a symbolic spec
with its sizes bound as the user named them), each searched by `KnobSearch`, built by tvmattn's build
function and measured locally or on RPC servers. Every measured round is appended to the log file
before the next begins, so an interrupted run loses at most the round in flight, and running the same
command again measures only what is missing (``trials`` is the total per point, not an increment:
knob points measured, not counting the confirmations that follow each search, `KnobSearch`).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule import _ffi_api
from tvm.s_tir.meta_schedule.cost_model import XGBModel
from tvm.s_tir.meta_schedule.database import MemoryDatabase
from tvm.s_tir.meta_schedule.logging import get_logging_func
from tvm.s_tir.meta_schedule.measure_callback import MeasureCallback
from tvm.s_tir.meta_schedule.task_scheduler import TaskScheduler
from tvm.s_tir.meta_schedule.tune_context import TuneContext, _normalize_mod

from tvmattn import schedules
from tvmattn.compiler.cross.toolchain import cross_gcc
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.explain import useful_flops
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import cpu_cores, is_foreign, resolve_target, target_arch, target_key
from tvmattn.compiler.tuning import measure
from tvmattn.compiler.tuning.lookup import schedule_name, user_dir
from tvmattn.compiler.tuning.progress import Progress
from tvmattn.compiler.tuning.records import (
    CONFIRM_ROUNDS,
    FINALISTS,
    Record,
    append,
    chosen,
    log_file,
    read_dirs,
    spec_key,
)
from tvmattn.compiler.tuning.search import KnobSearch, Measurement, Task
from tvmattn.compiler.tuning.space import KnobSpace, design_space, workload

TRIALS_PER_ROUND = 8  # candidates built and measured per round (a fresh build pool each round)
CONFIRMATIONS = (1 + FINALISTS) * CONFIRM_ROUNDS  # measurements after a task's search (`KnobSearch`)
COST_MODEL_WARMUP = 16  # measurements before the cost model's ranking replaces random ranking
logger = logging.getLogger("tvmattn.compiler.tuning")


@dataclass
class PointReport:
    at: dict[str, int]
    trials: int  # knob points measured at this point, this run's included
    measured_now: int  # knob points this run
    confirmations: int  # measurements this run of points measured before (`KnobSearch`)
    best: Record | None  # `records.chosen`: what a compile builds
    default: Record | None  # the default schedule's measurement (median): the baseline


@dataclass
class TuneReport:
    spec: AttentionSpec
    target: str
    log_file: Path
    points: list[PointReport]
    seconds: float
    stopped: bool  # Ctrl-C: the round in flight was finished, the rest left for a re-run

    @property
    def measured_now(self) -> int:
        return sum(p.measured_now for p in self.points)

    @property
    def confirmations(self) -> int:
        return sum(p.confirmations for p in self.points)


def representative_points(spec: AttentionSpec, at: Sequence[dict[str, int]]) -> list[dict[str, int]]:
    """The sizes each task binds: ``[{}]`` for a concrete spec, the named points for a symbolic one."""
    names = set(spec.symbolic_dims)
    if not names:
        if any(at):
            raise TvmAttnError(f"--at is for symbolic sizes; this spec has none ({spec.describe()})")
        return [{}]
    if not at:
        example = " ".join(f"--at {n}=512" for n in sorted(names))
        raise TvmAttnError(f"a symbolic spec is tuned at representative sizes: name them, e.g. {example} "
                           f"(repeat --at for several points)")
    for point in at:
        if set(point) != names:
            raise TvmAttnError(f"--at {' '.join(f'{k}={v}' for k, v in point.items())}: give a size for each "
                               f"of {', '.join(sorted(names))} and nothing else")
    return [dict(p) for p in dict.fromkeys(tuple(sorted(p.items())) for p in at)]


def instantiate(spec: AttentionSpec, sizes: dict[str, int]) -> AttentionSpec:
    fields = {f: sizes[getattr(spec, f)] for f in ("batch", "seq_len", "kv_seq_len")
              if isinstance(getattr(spec, f), str)}
    return spec.replace(**fields)


def log_path(spec: AttentionSpec, target: Any = "cpu", arch: str | None = None,
             log_dir: str | Path | None = None) -> Path:
    """The file `tune` appends the records of ``spec`` to."""
    directory = Path(log_dir).expanduser() if log_dir else user_dir()
    return log_file(directory, target_key(resolve_target(target, arch)), spec)


def tune(spec: AttentionSpec, target: Any = "cpu", *, trials: int = 64, at: Sequence[dict[str, int]] = (),
         arch: str | None = None, log_dir: str | Path | None = None, remote: measure.RemoteDevices | None = None,
         seed: int = 0, progress: bool | None = None,
         on_round: Callable[[list[Record]], None] | None = None) -> TuneReport:
    """Tune ``spec`` for ``target`` until each representative point has ``trials`` measurements.

    ``progress``: draw a live bar (None: when stderr is a terminal). ``on_round``: called with the
    records of each measured round as soon as they are stored (benchmarks of the search use it).
    """
    if trials <= 0:
        raise TvmAttnError(f"--trials {trials}: give a positive number of measurements")
    spec.validate()
    tgt = resolve_target(target, arch)
    rule = schedules.rule_for(spec, tgt)
    if not rule.KNOBS:
        raise TvmAttnError(f"the {rule.name} schedule declares no knobs: there is nothing to tune "
                           f"for {target_key(tgt)} yet")
    if tgt.kind.name == "cuda" and remote is None and not tvm.cuda(0).exist:
        raise TvmAttnError("tuning for CUDA measures on a GPU, and this machine has none: run `tvmattn tune` "
                           "where one is, or measure there over RPC (--rpc HOST:PORT --device-key KEY)")
    if is_foreign(tgt):
        if remote is None:
            raise TvmAttnError(f"tuning for {target_arch(tgt)} measures on that CPU, and emulation here times "
                               "nothing: measure there over RPC (--rpc HOST:PORT --device-key KEY; candidates are "
                               "cross-compiled here), or run `tvmattn tune --target cpu` on it")
        cross_gcc(target_arch(tgt))  # (the candidates are linked here: say now if its linker is missing)
    defaults = schedules.default_knobs(spec, tgt)  # per arch and spec where the schedule says so
    space = KnobSpace(tuple(dataclasses.replace(k, default=defaults[k.name]) for k in rule.KNOBS))
    points = representative_points(spec, at)
    out_dir = Path(log_dir).expanduser() if log_dir else user_dir()
    path = log_file(out_dir, target_key(tgt), spec)
    start = time.monotonic()

    prior = _earlier(out_dir, spec, tgt)
    tasks = []
    for sizes in points:
        instance = instantiate(spec, sizes)
        done = [r for r in prior if r.at == sizes]
        points_done = len({r.knob_key for r in done})  # (confirmations measure a point again: no trials)
        tasks.append((Task(spec, sizes, instance, workload(instance, tgt), tgt, space, trials - points_done), done))
    todo = [(t, done) for t, done in tasks if t.budget > 0]
    stop = _StopRequest()
    written: dict[tuple, int] = {}
    if todo:
        runner = measure.rpc_runner(spec, remote) if remote else measure.local_runner(spec)
        where = remote.describe() if remote else f"{socket.gethostname()} (local, {cpu_cores()} threads)"
        bar = Progress(sum(t.budget for t, _ in todo), live=progress)
        journal = _Journal(path, tgt, where, bar, prior, on_round)
        written = journal.written
        try:
            with stop:
                _run(todo, runner, journal, seed, stop)
        except Exception:
            if stop.requested:  # a second Ctrl-C, surfacing through TVM's FFI as a RuntimeError
                raise KeyboardInterrupt from None
            raise
        finally:
            bar.close()
            runner.pool.shutdown()  # its worker processes would otherwise idle until this process exits

    records = _earlier(out_dir, spec, tgt)
    reports = []
    for sizes in points:
        mine = [r for r in records if r.at == sizes]
        ok = [r for r in mine if r.ok]
        default = [r for r in ok if space.point(r.knobs) == space.default()]
        points = {r.knob_key for r in mine}
        new = len(points - {r.knob_key for r in prior if r.at == sizes})
        reports.append(PointReport(sizes, len(points), new, written.get(_point_key(sizes), 0) - new,
                                   chosen(ok), chosen(default)))
    return TuneReport(spec, target_key(tgt), path, reports, time.monotonic() - start, stop.requested)


def _earlier(out_dir: Path, spec: AttentionSpec, target: tvm.target.Target) -> list[Record]:
    """This workload's records already in the output directory (resuming from them)."""
    key, name = spec_key(spec), schedule_name(spec, target)
    return [r for r in read_dirs([out_dir], target_key(target)) if r.spec == key and r.schedule == name]


def _run(todo: list[tuple[Task, list[Record]]], runner, journal: "_Journal", seed: int,
         stop: "_StopRequest") -> None:
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)  # our progress, not its tables
    contexts = [_context(task, KnobSearch(task, done, journal.write, lambda: stop.requested, seed + i), seed + i)
                for i, (task, done) in enumerate(todo)]
    cost_model = _CostModel()
    builder = measure.PooledBuilder()
    try:
        TaskScheduler.create("round-robin").tune(
            tasks=contexts, task_weights=[1.0] * len(contexts),
            max_trials_global=sum(t.budget + CONFIRMATIONS for t, _ in todo),
            max_trials_per_task=max(t.budget for t, _ in todo) + CONFIRMATIONS,
            num_trials_per_iter=TRIALS_PER_ROUND, builder=builder, runner=runner,
            measure_callbacks=MeasureCallback.create("default"), database=MemoryDatabase(), cost_model=cost_model)
    finally:
        builder.close()


class _StopRequest:
    """Ctrl-C during tuning: the first finishes the round in flight (its measurements are kept) and
    stops; a second stops at once, losing only that round."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> "_StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_interrupt(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ntvmattn: stopping after the round in flight (Ctrl-C again to stop now)", file=sys.stderr, flush=True)


def _point_key(sizes: dict[str, int]) -> tuple:
    return tuple(sorted(sizes.items()))


@derived_object
class _CostModel(XGBModel._cls):
    """MetaSchedule's XGBoost model, trained first when its predictions start to be used (before
    `COST_MODEL_WARMUP` measurements it predicts at random; training it then only costs seconds on
    the cores that build), and stopped early after 20 rounds without progress, not 50."""

    def __init__(self) -> None:
        super().__init__(num_warmup_samples=COST_MODEL_WARMUP, num_tuning_cores=cpu_cores(),
                         early_stopping_rounds=20)
        self.last_train_size = COST_MODEL_WARMUP  # adaptive training waits for 20% more data than this


def _context(task: Task, strategy: KnobSearch, seed: int) -> TuneContext:
    """A TuneContext built through its FFI constructor: the Python one imports
    `tvm.s_tir.tensor_intrin`, about a minute here, for tensor intrinsics this space never uses."""
    ctx = TuneContext.__new__(TuneContext)
    ctx.__init_handle_by_constructor__(
        _ffi_api.TuneContext, _normalize_mod(task.func), task.target,
        design_space(task.instance, task.target), strategy,
        "attention" + "".join(f"_{k}{v}" for k, v in task.at.items()), cpu_cores(), seed, get_logging_func(logger))
    _ffi_api.TuneContextInitialize(ctx)
    return ctx


class _Journal:
    """Turns measurements into records, appends them to the log, moves the progress display."""

    def __init__(self, path: Path, target, where: str, progress: Progress, prior: list[Record],
                 on_round: Callable[[list[Record]], None] | None) -> None:
        self.path, self.target, self.where, self.progress, self.on_round = path, target, where, progress, on_round
        self.best: dict[tuple, float] = {}
        self.written: dict[tuple, int] = {}
        self._note_best(prior)
        try:
            self.version = metadata.version("tvmattn")
        except metadata.PackageNotFoundError:
            self.version = "unknown"

    def write(self, task: Task, measurements: list[Measurement], again: bool = False) -> None:
        """Store a round's measurements; ``again``: of points measured before (confirmations: no
        trials on the progress display)."""
        flops = useful_flops(task.instance)
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
        records = []
        for m in measurements:
            latency = statistics.median(m.run_secs) if m.run_secs else None
            records.append(Record(
                spec=spec_key(task.spec), at=task.at, target=target_key(self.target),
                schedule=schedule_name(task.spec, self.target), knobs=m.knobs,
                latency_us=round(latency * 1e6, 3) if latency else None,
                runs_us=[round(s * 1e6, 3) for s in m.run_secs or []], error=m.error,
                gflops=round(flops / latency / 1e9, 2) if latency and flops else None,
                target_full=str(self.target), measured_on=self.where, measured_at=now,
                tvm=tvm.__version__, tvmattn=self.version, ir_hash=m.ir_hash))
        append(self.path, records)
        if self.on_round:
            self.on_round(records)
        self._note_best(records)
        key = _point_key(task.at)
        self.written[key] = self.written.get(key, 0) + len(records)
        best = self.best.get(key)
        label = " ".join(f"{k}={v}" for k, v in task.at.items())
        self.progress.advance(0 if again else len(records), best, flops / best / 1e3 if best and flops else None,
                              f"at {label}" if label else "")

    def _note_best(self, records: list[Record]) -> None:
        for r in records:
            key = _point_key(r.at)
            if r.ok and r.latency_us < self.best.get(key, float("inf")):
                self.best[key] = r.latency_us
