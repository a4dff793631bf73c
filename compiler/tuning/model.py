"""`tvmattn tune model.onnx`: the knobs of the rules that take an imported model's GEMMs
(`schedules/ops`: ``matmul``, ``gemv``), measured at the model's sizes and kept as tuning records
beside the attention kernels'; `import_onnx` then builds each function with its best record.

A task is one distinct function the rule is given (TVM's fusion makes one function of a GEMM that
every layer repeats, so it is tuned once), named in its records by the structural hash of that
function (``spec: {"function": name, "workload": hash}``, ``schedule``: the rule). Symbolic sizes are
bound for measurement to ``at`` (default: the last named size of each input 128, the others 1: a
batch of one 128-token sequence). The search measures the default knobs first, then random points of
the rule's knob grid (each rebuilt from its knobs, as a compile does), timed with TVM's
``time_evaluator``; every measurement is appended to the log as it completes, so Ctrl-C loses
nothing and a re-run measures only points not yet recorded. Then the default and the two fastest
points are measured again, alternately (`CONFIRM_ROUNDS`): the fastest of one noisy measurement
each is often a lucky one, and a build uses a point only when measured more than once (`records.chosen`).
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm.sym import Analyzer
from tvm.target import Target

from tvmattn.compiler.build import CPU_PIPELINE, until_scheduling
from tvmattn.compiler.errors import TvmAttnError, tvm_reason
from tvmattn.compiler.onnx.importer import graph_inputs, load, relax_module
from tvmattn.compiler.passes import polynomial_math, substitute
from tvmattn.compiler.target import resolve_target, target_key
from tvmattn.compiler.tuning.lookup import TUNED_RULES, user_dir, workload_key
from tvmattn.compiler.tuning.progress import Progress
from tvmattn.compiler.tuning.records import CONFIRM_ROUNDS, FINALISTS, SUFFIX, Record, append, chosen, read_dirs
from tvmattn.schedules.ops import RULES, first_rule, unscheduled
from tvmattn.schedules.ops.matmul import KNOBS


@dataclass(frozen=True)
class OpTask:
    name: str  # the function's name in the module (for people)
    rule: str
    func: tirx.PrimFunc  # as the rule is given it (with the constant-parameter attribute)
    key: str


@dataclass
class TaskReport:
    task: OpTask
    default_us: float | None
    best_us: float | None
    best_knobs: dict[str, int]
    measured_now: int


def tasks(model: Any, target: Target, shapes: Mapping[str, Sequence[int | str]] | None = None) -> list[OpTask]:
    """The distinct GEMM functions of ``model`` that a tuned rule takes, as `ScheduleFunctions` gives them."""
    mod = relax_module(model, target, shapes)
    with target:  # the passes `build.compile_model` runs before scheduling: the functions it schedules
        mod = tvm.transform.Sequential(until_scheduling(target))(mod)
    found: dict[str, OpTask] = {}
    for gvar, func in unscheduled(mod):
        chosen = first_rule(func, target)  # the rule the build gives it: a task only where that one is tuned
        if chosen is not None and chosen[0] in TUNED_RULES and dict(RULES)[chosen[0]].default_knobs(func, target):
            found.setdefault(workload_key(func), OpTask(gvar.name_hint, chosen[0], func, workload_key(func)))
    return list(found.values())


def default_sizes(inputs) -> dict[str, int]:
    """A batch of one 128-token sequence: each input's last named size 128, its others 1."""
    sizes: dict[str, int] = {}
    for spec in inputs:
        named = [d for d in spec.shape if isinstance(d, str)]
        for d in named:
            sizes.setdefault(d, 128 if d == named[-1] else 1)
    return sizes


def tune_model(model: Any, target: Any = "cpu", *, trials: int = 32, at: Mapping[str, int] | None = None,
               shapes: Mapping[str, Sequence[int | str]] | None = None, log_dir: str | Path | None = None,
               seed: int = 0, progress: bool = True) -> tuple[list[TaskReport], Path]:
    """Tune every GEMM task of ``model`` with ``trials`` measurements each (records → ``log_dir``)."""
    tgt = resolve_target(target)
    if tgt.kind.name != "llvm":
        raise TvmAttnError("tvmattn tune model.onnx tunes CPU models; CUDA models take TVM dlight's rules")
    checked = load(model)  # read and checked once: the tasks' import reads it as it is
    proto = checked.proto
    sizes = {**default_sizes(graph_inputs(proto)), **(at or {})}
    todo = tasks(checked, tgt, shapes)
    out = Path(log_dir).expanduser() if log_dir else user_dir()
    path = out / target_key(tgt) / f"model-{proto.graph.name or 'model'}{SUFFIX}"
    earlier = [r for r in read_dirs([out], target_key(tgt)) if r.schedule in TUNED_RULES]
    bar = Progress(trials * len(todo)) if progress else None
    reports = []
    try:
        for task in todo:
            reports.append(_tune_task(task, tgt, sizes, trials, path, earlier, random.Random(seed), bar))
    finally:
        if bar:
            bar.close()
    return reports, path


def _tune_task(task: OpTask, target: Target, sizes: dict[str, int], trials: int, path: Path,
               earlier: list[Record], rng: random.Random, bar: Progress | None) -> TaskReport:
    mine = [r for r in earlier if r.spec.get("workload") == task.key and r.at == sizes]
    done = {r.knob_key for r in mine}
    points_before = len(done)  # (confirmations measure a point again: they are not trials)
    grid = [dict(zip([k.name for k in KNOBS], values)) for values in itertools.product(*[k.choices for k in KNOBS])]
    rng.shuffle(grid)
    default = dict(RULES)[task.rule].default_knobs(task.func, target) or {}
    points = [default] + [p for p in grid if p != default]
    measured = 0
    records = list(mine)
    for knobs in points:
        if measured + points_before >= trials:
            break
        key = _key(knobs)
        if key in done:
            continue
        done.add(key)
        record = _measure(task, target, sizes, knobs)
        append(path, [record])
        records.append(record)
        measured += 1
        ok = [r for r in records if r.ok]
        best = min(ok, key=lambda r: r.latency_us) if ok else None
        if bar:
            bar.advance(1, best.latency_us if best else None, best.gflops if best else None, task.name)
    by_point = _latencies([r for r in records if r.ok])
    finalists = sorted((k for k in by_point if k != _key(default)), key=lambda k: min(by_point[k]))[:FINALISTS]
    for _ in range(CONFIRM_ROUNDS if finalists and measured else 0):  # a re-run with nothing new: none
        for key in [_key(default), *finalists]:
            record = _measure(task, target, sizes, dict(key))
            append(path, [record])
            records.append(record)
    pick = chosen(records)
    base = _latencies([r for r in records if r.ok]).get(_key(default))
    return TaskReport(task, float(np.median(base)) if base else None, pick.latency_us if pick else None,
                      dict(pick.knobs) if pick else {}, measured)


def _key(knobs: Mapping[str, int]) -> tuple:
    return tuple(sorted(knobs.items()))


def _latencies(records: list[Record]) -> dict[tuple, list[float]]:
    by_point: dict[tuple, list[float]] = {}
    for r in records:
        by_point.setdefault(r.knob_key, []).append(r.latency_us)
    return by_point


def _measure(task: OpTask, target: Target, sizes: dict[str, int], knobs: dict[str, int]) -> Record:
    rule = dict(RULES)[task.rule]
    common = dict(spec={"function": task.name, "workload": task.key}, at=dict(sizes), target=target_key(target),
                  schedule=task.rule, knobs=knobs, target_full=str(target), measured_on="host (local)",
                  measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), tvm=tvm.__version__)
    try:
        sch = rule.apply(task.func, target, False, knobs)
        func = sch.mod["main"].with_attr("global_symbol", "main")  # a module's private function, built alone
        mod = tvm.transform.Sequential([*rule.passes, polynomial_math()])(tvm.IRModule({"main": func}))
        lib = tvm.compile(mod, target, tir_pipeline=CPU_PIPELINE).jit()
        args = _arguments(mod["main"], sizes)
        timer = lib.time_evaluator("main", tvm.cpu(), number=1, repeat=5, min_repeat_ms=20)
        runs = [t * 1e6 for t in timer(*args).results]
    except Exception as err:  # a knob combination TVM rejects for this function: recorded as failed
        return Record(**common, latency_us=None, error=tvm_reason(err)[:200])
    median = float(np.median(runs))
    return Record(**common, latency_us=median, runs_us=runs, gflops=_flops(task.func, sizes) / median / 1e3)


def _arguments(func: tirx.PrimFunc, sizes: dict[str, int]) -> list:
    """Random tensors (and size scalars) for ``func``'s parameters at ``sizes``."""
    rng = np.random.default_rng(0)
    args = []
    for p in func.params:
        if hasattr(p.ty, "shape"):
            shape = [_at(d, sizes) for d in p.ty.shape]
            dtype = str(p.ty.dtype)
            data = rng.standard_normal(shape).astype(dtype) if "float" in dtype else np.zeros(shape, dtype)
            args.append(tvm.runtime.tensor(data))
        else:
            args.append(_at(p, sizes))
    return args


def _at(expr, sizes: dict[str, int]) -> int:
    """A size expression's value with the named sizes bound."""
    found: list = []
    tvm_ffi.structural_visit(expr, [(tirx.Var, lambda v, *_: found.append(v))])
    missing = sorted({v.name for v in found} - set(sizes))
    if missing:
        raise TvmAttnError(f"size {missing[0]!r} has no value: give it with --at {missing[0]}=N")
    return int(Analyzer().simplify(substitute(expr, {v: tirx.IntImm(v.ty.dtype, sizes[v.name]) for v in found})))


def _flops(func: tirx.PrimFunc, sizes: dict[str, int]) -> float:
    """2 · (output elements) · (reduction length) of the function's GEMM block."""
    from tvm.s_tir import Schedule
    from tvm.s_tir.dlight import normalize_prim_func

    sch = Schedule(func)
    block = next(i for i in normalize_prim_func(sch) if not i.is_injective())
    total = 2.0
    for it in block.iters:
        total *= it.dom if isinstance(it.dom, int) else _at(it.dom, sizes)
    return total
