"""Tuning records: what a measurement found, stored so that it survives crashes, concurrency and change.

A record is one measured point of a schedule's knob space for one workload on one target:

    {"format": "tvmattn-tuning-record/1",
     "spec": {...AttentionSpec fields...},   the workload as the user named it (sizes may be symbolic)
     "at": {"n": 512},                       what the symbolic sizes were bound to when measured
     "target": "llvm-znver4",                `target_key`: the directory the record is filed under
     "target_full": "{...}",                 the whole TVM target, for people
     "schedule": "cpu",                      the schedule module whose KNOBS the knobs belong to
     "knobs": {"q_tile": 32, ...},           the decisions: all that is needed to rebuild the kernel
     "latency_us": 312.4, "runs_us": [...],  median and every repeat; null latency + "error" = failed
     "gflops": 55.1,
     "measured_on": "host (local)", "measured_at": "2025-11-30T15:20:00Z",
     "tvm": "0.27.0.post1", "tvmattn": "0.1.0",
     "ir_hash": "9f2c..."}                   structural hash of the scheduled TIR (dedupe within a TVM)

Files are JSON Lines, one record per line, appended under an exclusive `flock` in a single write, so
concurrent tuners never interleave or lose a line and a crash loses at most the line being written.
Readers skip what they cannot use (a truncated line, a foreign file) with one warning per file.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tvmattn.compiler.spec import AttentionSpec

FORMAT = "tvmattn-tuning-record/1"
SUFFIX = ".jsonl"
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "tuning_logs"  # the package root
# After a search, the tuners measure the default and the FINALISTS fastest points again, alternately,
# CONFIRM_ROUNDS times: `chosen` then builds from a median of several measurements
CONFIRM_ROUNDS = 2
FINALISTS = 2


class TuningLogWarning(UserWarning):
    """A tuning log or record that tvmattn skipped (corrupt, foreign, stale)."""


@dataclass(frozen=True)
class Record:
    spec: dict[str, Any]
    at: dict[str, int]
    target: str
    schedule: str
    knobs: dict[str, int]
    latency_us: float | None
    runs_us: list[float] = field(default_factory=list)
    error: str | None = None
    gflops: float | None = None
    target_full: str = ""
    measured_on: str = ""
    measured_at: str = ""
    tvm: str = ""
    tvmattn: str = ""
    ir_hash: str = ""
    source: str = field(default="", compare=False)  # "file:line" it was read from; not stored

    @property
    def ok(self) -> bool:
        return self.latency_us is not None

    @property
    def knob_key(self) -> tuple[tuple[str, int], ...]:
        return tuple(sorted(self.knobs.items()))

    def to_json(self) -> str:
        data = {"format": FORMAT, **dataclasses.asdict(self)}
        del data["source"]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str, source: str = "") -> "Record":
        """Parse one stored line; ValueError when it is not a well-formed record of this format."""
        data = json.loads(line)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} record")
        data.pop("format")
        names = {f.name for f in dataclasses.fields(cls)} - {"source"}
        if not {"spec", "at", "target", "schedule", "knobs", "latency_us"} <= set(data) <= names:
            raise ValueError("missing or unknown fields")
        record = cls(**data, source=source)
        if not (isinstance(record.spec, dict) and isinstance(record.at, dict) and isinstance(record.knobs, dict)
                and all(isinstance(v, int) for v in record.knobs.values())
                and (record.latency_us is None or isinstance(record.latency_us, (int, float)))):
            raise ValueError("fields of the wrong type")
        return record


def chosen(records: Iterable[Record]) -> Record | None:
    """The record to build with among measurements of one workload at one point: of the knobs measured
    more than once (the tuners measure their finalists again, alternately: the fastest of one noisy
    measurement each is often a lucky one), the lowest median; in a log without such (written before
    the tuners confirmed), the fastest measurement. The record returned carries that median."""
    by_point: dict[tuple, list[Record]] = {}
    for r in records:
        if r.ok:
            by_point.setdefault(r.knob_key, []).append(r)
    confirmed = {k: v for k, v in by_point.items() if len(v) > 1} or by_point
    if not confirmed:
        return None

    def median(rs: list[Record]) -> float:
        return statistics.median(r.latency_us for r in rs)

    point = min(confirmed.values(), key=median)
    best = min(point, key=lambda r: r.latency_us)
    latency = median(point)
    return dataclasses.replace(best, latency_us=latency,
                               gflops=round(best.gflops * best.latency_us / latency, 2) if best.gflops else None)


def spec_key(spec: AttentionSpec | dict[str, Any]) -> dict[str, Any]:
    """The workload identity of a spec: its fields as plain JSON values (what records store)."""
    data = spec.to_dict() if isinstance(spec, AttentionSpec) else spec
    return json.loads(json.dumps(data, sort_keys=True))


def log_file(directory: Path, target: str, spec: AttentionSpec) -> Path:
    """Where tuning writes records for ``spec``: a readable name plus a hash of the whole spec.

    Readers look at every ``*.jsonl`` under the target's directory, so the name is only for people.
    """
    digest = hashlib.sha256(json.dumps(spec_key(spec), sort_keys=True).encode()).hexdigest()[:10]
    kind = "layer" if spec.projections else "core"
    flags = "".join(f"-{f}" for f, on in (("causal", spec.causal), (f"w{spec.window}", spec.window is not None),
                                          ("pad", spec.key_padding)) if on)
    name = f"{kind}-B{spec.batch}-n{spec.n_q}-kv{spec.n_kv}-h{spec.h}x{spec.h_kv}-d{spec.d_k}-{spec.dtype}{flags}"
    return directory / target / f"{name}-{digest}{SUFFIX}"


def append(path: Path, records: Iterable[Record]) -> None:
    """Append ``records`` to ``path`` atomically with respect to other tvmattn writers, and durably."""
    text = "".join(r.to_json() + "\n" for r in records)
    if not text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            # A writer killed mid-line leaves no newline: start on a fresh line so that only the
            # broken record is lost, not the next one too.
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    text = "\n" + text
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# path → ((mtime, size), its records), the latest version read: every compile reads the logs
_READ: dict[str, tuple[tuple[int, int], list[Record]]] = {}


def read_file(path: Path) -> list[Record]:
    """The records of one file; a file with unusable lines gives one warning naming it (each time: a
    clean file is read again only when it changes)."""
    try:
        stat = path.stat()
        version = (stat.st_mtime_ns, stat.st_size)
        if _READ.get(str(path), (None,))[0] == version:
            return list(_READ[str(path)][1])
    except OSError:
        version = None
    try:
        with open(path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # never read a line a writer is half-way through
            try:
                raw = f.read()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        lines = raw.decode("utf-8", errors="replace").splitlines()
    except OSError as err:
        warnings.warn(f"tuning log {path} could not be read ({err.strerror}); skipped", TuningLogWarning,
                      stacklevel=2)
        return []
    records: list[Record] = []
    bad: list[int] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(Record.from_json(line, f"{path}:{number}"))
        except (ValueError, TypeError):
            bad.append(number)
    if bad and not records:
        warnings.warn(f"{path} is not a tvmattn tuning log (no line is a {FORMAT} record); skipped",
                      TuningLogWarning, stacklevel=2)
    elif bad:
        shown = ", ".join(map(str, bad[:5])) + (" …" if len(bad) > 5 else "")
        warnings.warn(f"tuning log {path}: {len(bad)} corrupt or truncated line(s) skipped (line {shown}); "
                      f"{len(records)} record(s) used", TuningLogWarning, stacklevel=2)
    elif version is not None:
        _READ[str(path)] = (version, records)
    return list(records)


def read_dirs(directories: Iterable[Path], target: str) -> list[Record]:
    """Every record filed under ``target`` in ``directories``, in order; files that are not logs warn."""
    records: list[Record] = []
    for directory in directories:
        folder = Path(directory) / target
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if path.name.startswith(".") or path.name.lower().startswith("readme") or not path.is_file():
                continue
            records += read_file(path)
    return records
