"""Which tuning record a compile uses, and where records are looked for.

Search path, in order: ``--log-dir`` directories, the user's log directory
(``$TVMATTN_TUNING_LOGS``, else ``$XDG_CACHE_HOME/tvmattn/tuning_logs``, else
``~/.cache/tvmattn/tuning_logs``), then the logs shipped in the package. Only records filed under the
target's key (``llvm-znver4``, ``cuda-sm_90``), made for the target's schedule and measured without
error are candidates. Among them:

1. records of exactly this spec: the fastest (`records.chosen`: of the knobs measured more than
   once, the lowest median). For a symbolic spec these were measured at the representative sizes
   named when tuning; the records at the largest point are used (long sequences dominate run time).
2. for a concrete spec, records of a symbolic spec that this spec instantiates, when each size lies
   within the range of sizes that spec was tuned at: the fastest at the nearest tuned point.

A record's knobs are applied with the current schedule code. If they no longer fit (a knob renamed
or a choice removed) or the schedule fails, the record is stale: a warning, and the default schedule.
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import tvm_ffi
from tvm import tirx
from tvm.s_tir import Schedule
from tvm.target import Target

from tvmattn import schedules
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import target_key
from tvmattn.compiler.tuning.records import (
    SHIPPED_DIR,
    Record,
    TuningLogWarning,
    chosen,
    read_dirs,
    spec_key,
)
from tvmattn.schedules.ops import RULES
from tvmattn.schedules.ops.matmul import Matmul

SIZE_FIELDS = ("batch", "seq_len", "kv_seq_len")


def user_dir() -> Path:
    """Where `tvmattn tune` writes when no ``--log-dir`` is given."""
    if os.environ.get("TVMATTN_TUNING_LOGS"):
        return Path(os.environ["TVMATTN_TUNING_LOGS"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "tvmattn" / "tuning_logs"


def search_dirs(extra: Iterable[str | Path] = ()) -> list[Path]:
    dirs = [Path(d).expanduser() for d in extra] + [user_dir(), SHIPPED_DIR]
    return list(dict.fromkeys(d.resolve() for d in dirs))


def schedule_name(spec: AttentionSpec, target: Target) -> str:
    """The name of the schedule rule that takes ``spec`` on ``target`` (records carry it)."""
    return schedules.rule_for(spec, target).name


def find(spec: AttentionSpec, target: Target, records: Iterable[Record]) -> Record | None:
    """The record a compile of ``spec`` for ``target`` should use (rules in the module docstring)."""
    key, tkey, sname = spec_key(spec), target_key(target), schedule_name(spec, target)
    usable = [r for r in records if r.ok and r.target == tkey and r.schedule == sname]
    canonical = {id(r): _canonical(r.spec) for r in usable}
    usable = [r for r in usable if canonical[id(r)] is not None]
    exact = [r for r in usable if canonical[id(r)] == key]
    if exact:
        largest = max(math.prod(r.at.values()) for r in exact)
        return chosen(r for r in exact if math.prod(r.at.values()) == largest)
    if spec.symbolic_dims:
        return None
    best: tuple[float, float, Record] | None = None
    for group in _by_spec(usable, canonical):
        binding = _binding(canonical[id(group[0])], key)
        if binding is None or not _covered(binding, [r.at for r in group]):
            continue
        by_point: dict[tuple, list[Record]] = {}
        for r in group:
            by_point.setdefault(tuple(sorted(r.at.items())), []).append(r)
        for measured in by_point.values():
            r = chosen(measured)
            rank = (_distance(binding, r.at), r.latency_us, r)
            if best is None or rank[:2] < best[:2]:
                best = rank
    return best[2] if best else None


def tuned_schedule(spec: AttentionSpec, target: Target,
                   log_dirs: Sequence[str | Path] = ()) -> tuple[Schedule | None, str]:
    """The schedule of the best applicable record and a sentence about it; ``(None, why)`` if none."""
    record = find(spec, target, read_dirs(search_dirs(log_dirs), target_key(target)))
    if record is None:
        return None, f"no tuning record for this workload ({target_key(target)})"
    rule = schedules.rule_for(spec, target)
    try:
        sch, how = schedules.schedule(spec, target, record.knobs)
    except Exception as err:  # a TvmAttnError from the knob check or a TVM ScheduleError
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        warnings.warn(f"tuning record {record.source} no longer applies to the {record.schedule} schedule "
                      f"({reason}); using the default schedule — re-tune to refresh it", TuningLogWarning,
                      stacklevel=2)
        return None, "the tuning record is stale"
    missing = [k.name for k in rule.KNOBS if k.name not in record.knobs]
    if missing:
        warnings.warn(f"tuning record {record.source} predates knob(s) {', '.join(missing)}: they take their "
                      f"defaults — re-tune to search them", TuningLogWarning, stacklevel=2)
    return sch, f"tuned record ({how}): {record_summary(record)}"


def record_summary(record: Record) -> str:
    """'312 µs (55.1 GFLOP/s) at n=512, measured on host (local) at 2025-11-30T15:20Z with TVM 0.27.0'."""
    at = (" at " + " ".join(f"{k}={v}" for k, v in record.at.items())) if record.at else ""
    rate = f" ({record.gflops:.1f} GFLOP/s)" if record.gflops else ""
    return (f"{record.latency_us:.1f} µs{rate}{at}, measured on {record.measured_on or 'unknown host'} "
            f"at {record.measured_at or 'unknown time'} with TVM {record.tvm or '?'}")


def _canonical(stored: dict) -> dict | None:
    """A stored spec with today's defaults filled in (records outlive new spec fields); None if it
    names a field that no longer exists or is no longer valid."""
    return _canonical_of(json.dumps(stored, sort_keys=True))


@functools.lru_cache(maxsize=8192)
def _canonical_of(stored: str) -> dict | None:
    """`_canonical` of a stored spec's JSON text, once per process (every compile looks at every record)."""
    try:
        return spec_key(AttentionSpec.from_dict(json.loads(stored)))
    except (ValueError, TypeError):
        return None


def _by_spec(records: list[Record], canonical: dict[int, dict]) -> list[list[Record]]:
    groups: dict[str, list[Record]] = {}
    for r in records:
        if r.at:
            groups.setdefault(repr(sorted(canonical[id(r)].items())), []).append(r)
    return list(groups.values())


def _binding(symbolic: dict, concrete: dict) -> dict[str, int] | None:
    """The sizes that make ``symbolic`` equal ``concrete``, or None if no binding does."""
    binding: dict[str, int] = {}
    for name in SIZE_FIELDS:
        s, c = symbolic.get(name), concrete.get(name)
        if isinstance(s, str) and isinstance(c, int):
            if binding.setdefault(s, c) != c:
                return None
    if not binding:
        return None
    bound = {k: binding.get(v, v) if isinstance(v, str) and k in SIZE_FIELDS else v for k, v in symbolic.items()}
    return binding if bound == concrete else None


def _covered(binding: dict[str, int], points: list[dict[str, int]]) -> bool:
    return all(min(p.get(n, math.inf) for p in points) <= v <= max(p.get(n, -math.inf) for p in points)
               for n, v in binding.items())


def _distance(binding: dict[str, int], at: dict[str, int]) -> float:
    return sum(abs(math.log(v / at[n])) for n, v in binding.items() if n in at)


# ---- the records of an imported model's functions (`tvmattn tune model.onnx`: `tuning.model`) ---------------
TUNED_RULES = tuple(name for name, rule in RULES if isinstance(rule, Matmul))


def workload_key(func: tirx.PrimFunc) -> str:
    """A model function's key in its records: its structural hash."""
    return f"{tvm_ffi.structural_hash(func) & (2**64 - 1):016x}"


def tuned_knobs(target: Target, log_dirs: Sequence[str | Path] = ()):
    """`ScheduleFunctions`' ``tuned`` hook: a function's best record at the largest sizes measured."""
    records = [r for r in read_dirs(search_dirs(log_dirs), target_key(target)) if r.ok and r.schedule in TUNED_RULES]
    by_key: dict[str, list[Record]] = {}
    for r in records:
        by_key.setdefault(r.spec.get("workload", ""), []).append(r)

    def lookup(func: tirx.PrimFunc, rule: str) -> dict | None:
        mine = [r for r in by_key.get(workload_key(func), []) if r.schedule == rule]
        if not mine:
            return None
        largest = max(np.prod(list(r.at.values())) for r in mine)
        pick = chosen(r for r in mine if np.prod(list(r.at.values())) == largest)
        return dict(pick.knobs) if pick else None

    return lookup


