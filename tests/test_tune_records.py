"""Tuning records without tuning: the stored format, concurrent appends, damaged and foreign files,
which record a compile picks, and stale records. Records are written by hand here; the tuning runs
that produce them are in test_tune.py."""

from __future__ import annotations

import json
import multiprocessing
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_matches_oracle

import tvmattn
from tvmattn.compiler.cli import main
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import resolve_target, target_key
from tvmattn.compiler.tuning.lookup import find
from tvmattn.compiler.tuning.records import (
    Record,
    TuningLogWarning,
    append,
    chosen,
    log_file,
    read_dirs,
    read_file,
    spec_key,
)
from tvmattn.schedules import cpu

SPEC = AttentionSpec(seq_len=24, d_model=32, num_heads=2, causal=True, projections=False)
TARGET = resolve_target("cpu")
KEY = target_key(TARGET)
DEFAULTS = {k.name: k.default for k in cpu.KNOBS}
# A knob set that differs from the default in its first knob, so a compile shows which one it used.
FIRST = cpu.KNOBS[0]
OTHER = {**DEFAULTS, FIRST.name: next(c for c in FIRST.choices if c != FIRST.default)}


def record(spec=SPEC, knobs=None, latency=10.0, at=None, target=KEY) -> Record:
    return Record(spec=spec_key(spec), at=at or {}, target=target, schedule="cpu", knobs=knobs or OTHER,
                  latency_us=latency, runs_us=[latency] if latency else [], measured_on="test (local)",
                  measured_at="2026-01-01T00:00Z", tvm="0.27.0.post1", tvmattn="0.1.0")


def write(directory: Path, *records: Record, spec=SPEC) -> Path:
    path = log_file(directory, KEY, spec)
    append(path, records)
    return path


def compile_quietly(spec, directory, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel = tvmattn.compile(spec, "cpu", log_dirs=[directory], **kwargs)
    return kernel, [str(w.message) for w in caught if issubclass(w.category, TuningLogWarning)]


# ---- format and storage ------------------------------------------------------------------------------
def test_record_round_trips_through_its_line():
    r = record()
    assert Record.from_json(r.to_json()) == r
    for bad in ('{"format": "something-else/1"}', "[1, 2]", "{", json.dumps({**json.loads(r.to_json()), "x": 1})):
        with pytest.raises(ValueError):
            Record.from_json(bad)


def _append_many(path: str, tag: int, count: int) -> None:
    for i in range(count):
        append(Path(path), [record(latency=float(tag * 1000 + i + 1))])


def test_concurrent_appends_lose_nothing(tmp_path):
    path = tmp_path / KEY / "log.jsonl"
    ctx = multiprocessing.get_context("fork")  # the children only append: no TVM runtime in use
    procs = [ctx.Process(target=_append_many, args=(str(path), tag, 150)) for tag in (1, 2, 3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any damaged line would warn
        records = read_file(path)
    assert len(records) == 450
    assert len({r.latency_us for r in records}) == 450


def test_append_after_a_truncated_line_starts_a_fresh_one(tmp_path):
    path = write(tmp_path, record(latency=1.0))
    with open(path, "a") as f:
        f.write(record(latency=2.0).to_json()[:40])  # a writer killed mid-line
    append(path, [record(latency=3.0)])
    with pytest.warns(TuningLogWarning, match=rf"{path.name}.*1 corrupt or truncated line"):
        latencies = [r.latency_us for r in read_file(path)]
    assert latencies == [1.0, 3.0]


def test_a_log_read_again_after_it_changes(tmp_path):
    """Compiles read the logs each time (from a cache while a file is unchanged): records appended since,
    by this process or another tuner, count."""
    path = write(tmp_path, record(latency=4.0))
    assert [r.latency_us for r in read_dirs([tmp_path], KEY)] == [4.0]
    append(path, [record(latency=2.0)])
    assert [r.latency_us for r in read_dirs([tmp_path], KEY)] == [4.0, 2.0]
    path.write_text(record(latency=3.0).to_json() + "\n")  # rewritten in place (a smaller file)
    assert [r.latency_us for r in read_file(path)] == [3.0]


def test_foreign_corrupt_and_binary_files_warn_by_name_and_are_skipped(tmp_path):
    write(tmp_path, record(latency=5.0))
    folder = tmp_path / KEY
    (folder / "database_workload.json").write_text('["0x1234", {"main": "an IRModule"}]\n')
    (folder / "notes.jsonl").write_text('{"hello": "world"}\n')
    (folder / "garbage.jsonl").write_bytes(bytes(range(256)) * 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = read_dirs([tmp_path], KEY)
    messages = " | ".join(str(w.message) for w in caught)
    assert [r.latency_us for r in records] == [5.0]
    for name in ("database_workload.json", "notes.jsonl", "garbage.jsonl"):
        assert name in messages and "not a tvmattn tuning log" in messages


# ---- which record a compile uses -------------------------------------------------------------------
def test_exact_spec_fastest_successful_record_of_this_target():
    records = [record(latency=30.0), record(knobs=DEFAULTS, latency=20.0), record(latency=None),
               record(latency=1.0, target="llvm-some-other-cpu"),
               record(spec=SPEC.replace(causal=False), latency=2.0)]
    assert find(SPEC, TARGET, records).latency_us == 20.0
    assert find(SPEC.replace(seq_len=25), TARGET, records) is None


def test_records_outlive_new_spec_fields():
    old = record()
    stored = {k: v for k, v in old.spec.items() if k != "scale"}  # written before `scale` existed
    assert find(SPEC, TARGET, [Record(**{**old.__dict__, "spec": stored})]) is not None


def test_symbolic_records_cover_the_range_they_were_tuned_over():
    sym = SPEC.replace(seq_len="n")
    records = [record(sym, latency=4.0, at={"n": 16}), record(sym, latency=90.0, at={"n": 64}),
               record(sym, knobs=DEFAULTS, latency=80.0, at={"n": 64})]
    assert find(sym, TARGET, records).at == {"n": 64}  # the symbolic kernel: the largest point's best
    assert find(sym, TARGET, records).latency_us == 80.0
    assert find(SPEC.replace(seq_len=20), TARGET, records).at == {"n": 16}  # nearest point
    assert find(SPEC.replace(seq_len=50), TARGET, records).at == {"n": 64}
    assert find(SPEC.replace(seq_len=65), TARGET, records) is None  # outside what was tuned
    assert find(SPEC.replace(seq_len=20, causal=False), TARGET, records) is None


def test_compile_uses_the_record_and_says_so(tmp_path):
    write(tmp_path, record(latency=12.5))
    kernel, warned = compile_quietly(SPEC, tmp_path)
    assert not warned
    assert kernel.schedule.startswith("tuned record") and f"{FIRST.name}={OTHER[FIRST.name]}" in kernel.schedule
    assert "12.5 µs" in kernel.schedule and "test (local)" in kernel.schedule
    assert_matches_oracle(kernel)
    plain, _ = compile_quietly(SPEC, tmp_path, tuned=False)
    assert plain.schedule.startswith("default schedule") and "no tuning record" not in plain.schedule
    fresh, _ = compile_quietly(SPEC.replace(seq_len=25), tmp_path)
    assert fresh.schedule.endswith(f"no tuning record for this workload ({KEY})")


@pytest.mark.parametrize("knobs, reason", [
    ({**DEFAULTS, "retired_knob": 2}, "unknown schedule knob 'retired_knob'"),
    ({**DEFAULTS, FIRST.name: 7777}, f"{FIRST.name}=7777 is not one of"),
])
def test_stale_record_falls_back_to_the_default_schedule(tmp_path, knobs, reason):
    path = write(tmp_path, record(knobs=knobs))
    kernel, warned = compile_quietly(SPEC, tmp_path)
    assert kernel.schedule.startswith("default schedule") and "stale" in kernel.schedule
    assert any(str(path) in w and "no longer applies" in w and reason in w for w in warned), warned
    assert_matches_oracle(kernel)


def test_record_missing_a_new_knob_applies_with_its_default_and_warns(tmp_path):
    knobs = {k: v for k, v in OTHER.items() if k != cpu.KNOBS[-1].name}
    write(tmp_path, record(knobs=knobs))
    kernel, warned = compile_quietly(SPEC, tmp_path)
    assert kernel.schedule.startswith("tuned record")
    assert any("predates knob(s) " + cpu.KNOBS[-1].name in w for w in warned)


def test_cli_with_only_damaged_logs_warns_and_verifies_with_the_default(tmp_path, capsys):
    path = write(tmp_path, record())
    path.write_text(path.read_text()[:-30])  # truncated: the only record is gone
    code = main(["verify", "--seq", "24", "--d-model", "32", "--heads", "2", "--causal", "--no-projections",
                 "--log-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0 and "PASS" in out and "default schedule" in out
    assert f"tvmattn: warning: {path} is not a tvmattn tuning log" in err
    assert "Traceback" not in err


def test_knob_values_in_a_record_change_the_kernel(tmp_path):
    write(tmp_path, record())
    tuned, _ = compile_quietly(SPEC, tmp_path)
    default, _ = compile_quietly(SPEC, tmp_path, tuned=False)
    q, k, v = (np.random.default_rng(1).standard_normal((1, 2, 24, 16)).astype("float32") for _ in range(3))
    np.testing.assert_allclose(tuned(q, k, v), default(q, k, v), rtol=1e-4, atol=1e-5)
    assert tuned.source() != default.source()


def test_a_lucky_measurement_does_not_choose_the_knobs():
    def measured(knobs: dict, *latencies: float) -> list[Record]:
        return [Record(spec={}, at={}, target="llvm", schedule="matmul", knobs=knobs, latency_us=t) for t in latencies]

    default, lucky, once = {"gemm_rows": 4}, {"gemm_rows": 2}, {"gemm_rows": 8}
    records = measured(default, 100, 101, 99) + measured(lucky, 90, 110, 112) + measured(once, 95)
    assert chosen(records).knobs == default  # the median of the confirmed points; `once` is not one
    assert chosen(records).latency_us == 100
    assert chosen(measured(default, 100) + measured(once, 95)).knobs == once  # older logs: the fastest
