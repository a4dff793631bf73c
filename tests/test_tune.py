"""`tvmattn tune` end to end on tiny attentions: records written and then used by compile, Ctrl-C
and resume, concurrent tuners, symbolic specs, the progress display and bad input."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import tvm
from helpers import assert_matches_oracle
from tvm.runtime.module import num_threads
from tvm.s_tir import Schedule

import tvmattn
from tvmattn.compiler.cli import main
from tvmattn.compiler.target import cpu_cores, resolve_target, target_key
from tvmattn.compiler.tuning import measure, space
from tvmattn.compiler.tuning.progress import Progress
from tvmattn.compiler.tuning.records import chosen, read_dirs, read_file
from tvmattn.compiler.tuning.space import _sampled, workload
from tvmattn.compiler.tuning.tuner import _StopRequest
from tvmattn.compiler.verify import sizes_to_check
from tvmattn.schedules import cpu

KEY = target_key(resolve_target("cpu"))
TINY = ["--seq", "32", "--d-model", "32", "--heads", "2", "--causal", "--no-projections"]


def tvmattn_cli(*argv: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tvmattn.compiler.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"tvmattn did not finish in {timeout} s:\n{out}\n{err}")
    return proc.returncode, out, err


def records_in(directory: Path) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a damaged line is a failure here
        return read_dirs([directory], KEY)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A 4-trial tuning of a tiny causal core attention, as a user runs it."""
    directory = tmp_path_factory.mktemp("logs")
    start = time.monotonic()
    code, out, err = finish(tvmattn_cli("tune", *TINY, "--trials", "4", "--log-dir", str(directory)))
    assert code == 0, err
    return directory, out, err, time.monotonic() - start


@pytest.mark.slow  # the 4-trial tuning run they share takes ~60 s on 2 cores (test_tune_model tunes by default)
def test_tune_writes_records_and_reports(tuned):
    directory, out, err, _ = tuned
    records = records_in(directory)
    assert len(records) == 4 + 6 and all(r.ok and r.gflops for r in records)
    assert len({r.ir_hash for r in records[:4]}) == 4  # four different kernels, none searched twice
    assert {r.target for r in records} == {KEY} and all("local" in r.measured_on for r in records)
    assert "4 trial(s) this run (+ 6 confirming the fastest)" in out and "best:" in out and "default:" in out
    assert "tune: 4/4 trials" in err and "GFLOP/s" in err and "elapsed" in err  # plain progress lines


@pytest.mark.slow  # the 4-trial tuning run they share takes ~60 s on 2 cores (test_tune_model tunes by default)
def test_tune_measures_the_default_and_the_fastest_again_alternately(tuned, tmp_path, monkeypatch):
    """After the search, the default (the first trial) and the two fastest others are measured twice
    more, in turns; a compile builds the confirmed point of lowest median (`records.chosen`)."""
    directory, _, _, _ = tuned
    monkeypatch.setenv("TVMATTN_TUNING_LOGS", str(tmp_path))  # only these records: not other tests' in the user dir
    records = records_in(directory)
    trials, again = records[:4], records[4:]
    default = trials[0].knob_key
    fastest = [r.knob_key for r in sorted(trials[1:], key=lambda r: r.latency_us)[:2]]
    assert [r.knob_key for r in again] == [default, *fastest] * 2
    medians = {k: sorted(r.latency_us for r in records if r.knob_key == k)[1] for k in (default, *fastest)}
    pick = min(medians, key=medians.get)
    kernel = tvmattn.compile(tvmattn.AttentionSpec(seq_len=32, d_model=32, num_heads=2, causal=True,
                                                   projections=False), log_dirs=[directory])
    assert f"{medians[pick]:.1f} µs" in kernel.schedule
    assert all(f"{k}={v}" in kernel.schedule for k, v in pick if k in ("q_tile", "qk_keys", "pv_rows"))


@pytest.mark.slow  # the 4-trial tuning run they share takes ~60 s on 2 cores (test_tune_model tunes by default)
def test_compile_uses_the_tuned_record_quickly_and_matches_the_oracle(tuned, capsys):
    directory, _, _, tuning_seconds = tuned
    best = chosen(records_in(directory))
    assert main(["verify", *TINY, "--log-dir", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "schedule: tuned record" in out and f"{best.latency_us:.1f} µs" in out and "PASS" in out
    spec = tvmattn.AttentionSpec(seq_len=32, d_model=32, num_heads=2, causal=True, projections=False)
    kernel = tvmattn.compile(spec, log_dirs=[directory])
    assert kernel.compile_seconds < tuning_seconds / 4
    assert_matches_oracle(kernel)


@pytest.mark.slow  # the 4-trial tuning run they share takes ~60 s on 2 cores (test_tune_model tunes by default)
def test_a_rerun_with_the_same_budget_measures_nothing(tuned, capsys):
    directory, _, _, _ = tuned
    before = len(records_in(directory))
    assert main(["tune", *TINY, "--trials", "4", "--log-dir", str(directory)]) == 0
    assert "0 trial(s) this run in" in capsys.readouterr().out  # (and no confirmation)
    assert len(records_in(directory)) == before


@pytest.mark.slow  # a real tuning run interrupted and resumed (~37 s)
def test_sigint_keeps_the_records_and_a_rerun_resumes(tmp_path):
    argv = ["tune", "--seq", "48", "--d-model", "32", "--heads", "2", "--no-projections", "--trials", "16",
            "--log-dir", str(tmp_path)]
    proc = tvmattn_cli(*argv)
    deadline = time.monotonic() + 240
    while len(read_dirs([tmp_path], KEY)) < 8:  # the first round of 8 is on disk
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc)
    assert code == 130, err
    assert "stopping after the round in flight" in err and "run the same command again" in err
    kept = records_in(tmp_path)
    assert 8 <= len(kept) <= 16 and all(r.ok for r in kept)  # (stopped before confirming anything)

    code, out, err = finish(tvmattn_cli(*argv))
    assert code == 0, err
    assert f"{16 - len(kept)} trial(s) this run (+ 6 confirming" in out
    final = records_in(tmp_path)[:16]
    assert len({r.ir_hash for r in final}) == 16 and len({r.knob_key for r in final}) == 16


def test_a_second_ctrl_c_stops_at_once():
    stop = _StopRequest()
    with stop:
        stop._on_interrupt(signal.SIGINT, None)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            stop._on_interrupt(signal.SIGINT, None)
    assert signal.getsignal(signal.SIGINT) is not stop._on_interrupt


@pytest.mark.slow  # two tuners at once, ~25 s: the default suite keeps under its 10 minutes
def test_concurrent_tuners_on_one_log_keep_every_record(tmp_path, capsys):
    """A symbolic spec at two points: two processes append to the same file at the same time."""
    base = ["tune", "--seq", "n", "--d-model", "32", "--heads", "2", "--causal", "--no-projections",
            "--trials", "3", "--log-dir", str(tmp_path)]
    procs = [tvmattn_cli(*base, "--at", f"n={n}") for n in (16, 40)]
    for proc in procs:
        code, _, err = finish(proc)
        assert code == 0, err
    (log,) = (tmp_path / KEY).iterdir()
    records = read_file(log)  # 3 trials at each point, each measured twice more (all three are finalists)
    assert len(records) == 18 and sorted({r.at["n"] for r in records}) == [16, 40]
    assert all(len({r.knob_key for r in records if r.at["n"] == n}) == 3 for n in (16, 40))

    # The symbolic kernel uses the largest point; lengths in between use the nearest point.
    assert main(["verify", *base[1:9], "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tuned record" in out and "at n=40" in out and out.count("PASS") == len(sizes_to_check(
        tvmattn.AttentionSpec(seq_len="n", d_model=32, num_heads=2, causal=True, projections=False)))
    spec = tvmattn.AttentionSpec(seq_len=20, d_model=32, num_heads=2, causal=True, projections=False)
    near = tvmattn.compile(spec, log_dirs=[tmp_path])
    assert "at n=16" in near.schedule
    assert_matches_oracle(near)
    assert "no tuning record" in tvmattn.compile(spec.replace(seq_len=41), log_dirs=[tmp_path]).schedule


@pytest.mark.parametrize("spec", [
    tvmattn.AttentionSpec(seq_len=40, d_model=32, num_heads=2, causal=True, projections=False),
    tvmattn.AttentionSpec(seq_len=24, d_model=64, num_heads=4, num_kv_heads=2),
    tvmattn.AttentionSpec(seq_len=1, kv_seq_len=64, num_heads=4, head_dim=32, causal=True,
                          causal_align="bottom_right", projections=False),
])
def test_metaschedule_design_space_samples_every_declared_knob(spec):
    """The ScheduleFn space MetaSchedule generates: the schedule must accept sampled knobs."""
    target = resolve_target("cpu")
    for seed in (1, 2, 3):
        sch = Schedule(workload(spec, target), seed=seed)
        _sampled(spec, target, sch)
        samples = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
        assert len(samples) == len(cpu.KNOBS)


@pytest.mark.parametrize("spec, target", [
    # fp16 projections on fp32 FMAs: x widened once for the ones that read it (a consumer list)
    (tvmattn.AttentionSpec(batch=2, seq_len=32, kv_seq_len=48, d_model=64, num_heads=4, dtype="float16"),
     {"kind": "llvm", "mcpu": "znver3", "num-cores": 2}),
    # a per-query mask, packed per tile for the row max and the weights
    (tvmattn.AttentionSpec(seq_len=40, num_heads=2, head_dim=16, projections=False, attn_mask="bool"), "cpu"),
], ids=["fp16-layer", "per-query-mask"])
def test_design_space_traces_print_as_metaschedule_logs_them(spec, target):
    """MetaSchedule's task scheduler logs every design space's simplified trace before tuning starts;
    a trace that cannot be printed stopped `tvmattn tune` with an internal error (fp16 layers)."""
    target = resolve_target(target)
    (sampled,) = space.design_space(spec, target).generate_design_space(tvm.IRModule({"main": workload(spec, target)}))
    sampled.trace.simplified(remove_postproc=True).as_python()
    assert "T.parallel" in sampled.mod.script()  # (the scheduled module)


def test_local_runner_measures_with_every_core(monkeypatch):
    monkeypatch.setenv("TVM_NUM_THREADS", "1")  # what the tuning process itself was started with
    runner = measure.local_runner(tvmattn.AttentionSpec(seq_len=8, d_model=8, num_heads=1))
    try:
        assert runner.pool.submit(num_threads).result() == cpu_cores()  # TVM's pool in the runner's worker
    finally:
        runner.pool.shutdown()


def test_progress_bar_and_plain_lines():
    live = io.StringIO()
    bar = Progress(8, stream=live, live=True)
    bar.advance(3, 312.0, 55.1)
    bar.close()
    text = live.getvalue()
    assert "\r[" in text and "3/8 trials" in text and "best 312.0 µs (55.1 GFLOP/s)" in text
    assert "elapsed" in text and "left" in text
    plain = io.StringIO()
    bar = Progress(8, stream=plain, live=False)
    bar.advance(8, None, None)
    bar.close()
    assert plain.getvalue().startswith("tune: 8/8 trials, no measurement yet") and "\r" not in plain.getvalue()


@pytest.mark.parametrize("argv, message", [
    (["--seq", "n", "--d-model", "32", "--heads", "2"], "a symbolic spec is tuned at representative sizes"),
    (["--d-model", "32", "--heads", "2", "--at", "n=64"], "--at is for symbolic sizes"),
    (["--seq", "n", "--d-model", "32", "--heads", "2", "--at", "m=64"], "give a size for each of n"),
    (["--d-model", "32", "--heads", "2", "--trials", "0"], "give a positive number"),
    (["--d-model", "32", "--heads", "2", "--device-key", "x"], "--device-key is for --rpc"),
    (["--d-model", "32", "--heads", "2", "--rpc", "nohost", "--device-key", "x"], "write the tracker's HOST:PORT"),
    (["--d-model", "32", "--heads", "2", "--rpc", "127.0.0.1:9"], "--rpc needs --device-key"),
])
def test_tune_bad_input_is_one_line(capsys, tmp_path, argv, message):
    assert main(["tune", *argv, "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tvmattn: error: ") and message in err and err.count("\n") == 1
