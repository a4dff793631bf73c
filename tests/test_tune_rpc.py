"""Distributed measurement on loopback: TVM's RPC tracker and two servers started here, a small tuning
run measured through them, the records written locally. Everything is bounded and torn down."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest
from tvm import rpc

from tvmattn.compiler.cli import main
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.target import resolve_target, target_key
from tvmattn.compiler.tuning.measure import RemoteDevices
from tvmattn.compiler.tuning.records import read_dirs

pytest.importorskip("tornado", reason="TVM's RPC tracker needs tornado (pip install tornado)")

HOST = "127.0.0.1"
DEVICE_KEY = "tvmattn-loopback"
START_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """End a tracker or server and the session workers it started (they outlive a killed server)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_for(condition, procs: list[subprocess.Popen], failure: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        assert all(p.poll() is None for p in procs), f"{failure}: a process exited"
        assert time.monotonic() < deadline, f"{failure} in {START_TIMEOUT_S} s"
        time.sleep(0.3)


def _listening(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=1).close()
        return True
    except OSError:
        return False


def _servers(port: int) -> int:
    try:
        return RemoteDevices(HOST, port, DEVICE_KEY).servers()
    except TvmAttnError:
        return 0  # none registered yet


@pytest.fixture(scope="module")
def bare_tracker():
    """An RPC tracker with no server; yields its port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", HOST, "--port", str(port),
                             "--port-end", str(port + 1)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _listening(port), [proc], "the RPC tracker did not start")
        yield port
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def tracker(bare_tracker):
    """The tracker with two CPU servers registered under DEVICE_KEY; yields the tracker's port."""
    port, procs = bare_tracker, []
    try:
        # Servers that find no tracker retry only after a pause: start them once it listens.
        for server_port in (free_port(), free_port()):  # one measuring thread each: two share two cores
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"{HOST}:{port}", "--key", DEVICE_KEY,
                 "--host", HOST, "--port", str(server_port), "--port-end", str(server_port + 100)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "TVM_NUM_THREADS": "1"}))
        wait_for(lambda: _servers(port) == 2, procs, "the RPC servers did not register with the tracker")
        yield port
    finally:
        for proc in reversed(procs):
            stop(proc)


@pytest.mark.slow  # an RPC tracker, two servers and a tuning run (~37 s)
def test_tuning_measures_on_rpc_servers_and_writes_locally(tracker, tmp_path, capsys):
    code = main(["tune", "--seq", "32", "--d-model", "32", "--heads", "2", "--causal", "--no-projections",
                 "--trials", "4", "--rpc", f"{HOST}:{tracker}", "--device-key", DEVICE_KEY, "--log-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    records = read_dirs([tmp_path], target_key(resolve_target("cpu")))
    assert len(records) == 4 and all(r.ok for r in records), [r.error for r in records]
    assert {r.measured_on for r in records} == {f"rpc:{DEVICE_KEY}@{HOST}:{tracker}"}
    assert "4 trial(s) this run" in out


def test_rpc_without_servers_or_tracker_says_how_to_start_them(bare_tracker):
    with pytest.raises(TvmAttnError, match="no RPC server registered with key 'nobody'.*rpc_server"):
        RemoteDevices(HOST, bare_tracker, "nobody").servers()
    with pytest.raises(TvmAttnError, match="no RPC tracker at .*rpc_tracker"):
        RemoteDevices(HOST, free_port(), DEVICE_KEY).servers()
    assert "queue_info" in rpc.connect_tracker(HOST, bare_tracker).summary()  # the tracker is still serving
