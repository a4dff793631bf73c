"""Building and measuring candidates: MetaSchedule's LocalBuilder, LocalRunner and RPCRunner, set up
for tvmattn.

- The build function runs tvmattn's own TIR passes (block skipping, polynomial exp) before
  `tvm.compile`, exactly as `tvmattn.compile` does, and never imports `tvm.s_tir.tensor_intrin`
  (MetaSchedule's default build does: about a minute per fresh worker, past its timeout).
- Artifacts are shared libraries linked in the build workers, not tarballs the runner would link
  one by one.
- Arguments are random, except those `arguments.TABLE` gives a ``measure_fill`` (the key padding's
  lengths, set to the full key length: a random int32 there would send key loops out of bounds).
- Local measurement runs in a worker process whose TVM thread pool uses every core of this process
  (TVM's runtime starts with one thread otherwise). RPC servers need ``TVM_NUM_THREADS`` set where
  they are started.
"""

from __future__ import annotations

import functools
import os
import socket
import tempfile
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import rpc
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, LocalBuilder
from tvm.s_tir.meta_schedule.builder.local_builder import _worker_func as _build_worker
from tvm.s_tir.meta_schedule.runner import (
    EvaluatorConfig,
    LocalRunner,
    RPCConfig,
    RPCRunner,
)
from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common
from tvm.s_tir.meta_schedule.utils import get_global_func_on_rpc_session
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind
from tvm.target import Target

from tvmattn.compiler import arguments
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import cpu_cores

RECYCLE_ROUNDS = 16
# Median of 5 repeats of at least 40 ms each: stable enough on a busy machine, ~0.3 s per candidate.
EVALUATOR = EvaluatorConfig(number=1, repeat=5, min_repeat_ms=40, enable_cpu_cache_flush=False)
BUILD_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 60.0
RANDOM_FILL = "tvm.contrib.random.random_fill_for_measure"


@dataclass(frozen=True)
class RemoteDevices:
    """An RPC tracker and the key its servers registered with."""

    host: str
    port: int
    key: str

    @classmethod
    def parse(cls, address: str, key: str | None) -> "RemoteDevices":
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise TvmAttnError(f"--rpc {address!r}: write the tracker's HOST:PORT, e.g. --rpc 127.0.0.1:9190")
        if not key:
            raise TvmAttnError("--rpc needs --device-key KEY: the key the RPC servers registered with")
        return cls(host, int(port), key)

    def servers(self) -> int:
        """Servers registered under the key (free or busy); a TvmAttnError when there is none."""
        hint = (f"start one with: TVM_NUM_THREADS=<cores> python -m tvm.exec.rpc_server "
                f"--tracker {self.host}:{self.port} --key {self.key}")
        try:
            # A plain connection first: TVM's client retries a missing tracker for a minute.
            socket.create_connection((self.host, self.port), timeout=10).close()
            summary = rpc.connect_tracker(self.host, self.port).summary()
        except Exception as err:  # connection refused, timeouts: TVM raises several types
            raise TvmAttnError(f"no RPC tracker at {self.host}:{self.port} ({str(err).splitlines()[0]}); "
                               f"start it with: python -m tvm.exec.rpc_tracker --host {self.host} "
                               f"--port {self.port}") from None
        count = sum(1 for s in summary.get("server_info", []) if s.get("key") == f"server:{self.key}")
        if count == 0:
            raise TvmAttnError(f"no RPC server registered with key {self.key!r} at {self.host}:{self.port}; {hint}")
        return count

    def describe(self) -> str:
        return f"rpc:{self.key}@{self.host}:{self.port}"


@derived_object
class PooledBuilder(LocalBuilder._cls):
    """MetaSchedule's LocalBuilder, but its worker processes outlive a round.

    LocalBuilder starts fresh workers for every round (against a slow leak in long-lived ones); each
    pays TVM's import, 3–7 s here, more than building a round's candidates. These workers are
    replaced every `RECYCLE_ROUNDS` rounds instead.
    """

    def __init__(self) -> None:
        super().__init__(max_workers=cpu_cores(), timeout_sec=BUILD_TIMEOUT_S, f_build=build_candidate,
                         f_export=export_shared_library)
        self._pool: PopenPoolExecutor | None = None
        self._rounds = 0

    def build(self, build_inputs: list[BuilderInput]) -> list[BuilderResult]:
        if self._pool is None or self._rounds % RECYCLE_ROUNDS == 0:
            self.close()
            self._pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=self.timeout_sec)
        self._rounds += 1
        jobs = [(self.f_build, self.f_export, b.mod, b.target, None) for b in build_inputs]
        results = []
        for outcome in self._pool.map_with_error_catching(lambda job: _build_worker(*job), jobs):
            if outcome.status == StatusKind.COMPLETE:
                results.append(BuilderResult(outcome.value, None))
            elif outcome.status == StatusKind.TIMEOUT:
                results.append(BuilderResult(None, f"build timed out after {self.timeout_sec:.0f} s"))
            else:
                results.append(BuilderResult(None, f"build failed: {outcome.value}"))
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def local_runner(spec: AttentionSpec) -> LocalRunner:
    return LocalRunner(timeout_sec=RUN_TIMEOUT_S, evaluator_config=EVALUATOR,
                       f_alloc_argument=functools.partial(alloc_local, _fills(spec)),
                       initializer=functools.partial(use_threads, cpu_cores()))


def rpc_runner(spec: AttentionSpec, remote: RemoteDevices) -> RPCRunner:
    """Measure on the servers behind an RPC tracker, one candidate per server at a time."""
    config = RPCConfig(tracker_host=remote.host, tracker_port=remote.port, tracker_key=remote.key,
                       session_timeout_sec=int(RUN_TIMEOUT_S))
    return RPCRunner(rpc_config=config, evaluator_config=EVALUATOR, max_workers=remote.servers(),
                     f_alloc_argument=functools.partial(alloc_remote, _fills(spec)))


# ---- functions that run in MetaSchedule's worker processes (pickled by reference) -----------------
def build_candidate(mod: tvm.IRModule, target: Target, _params) -> tvm.runtime.Executable:
    """`tvmattn.compile`'s steps after scheduling, for the spec the workload carries."""
    from tvmattn.compiler.build import lowering_passes, tvm_compile
    from tvmattn.compiler.tuning.space import spec_of

    executable = tvm_compile(lowering_passes(spec_of(mod), target)(mod), target)
    executable.tvmattn_target = target  # (for `export_shared_library`, which MetaSchedule hands only this)
    return executable


def export_shared_library(executable: tvm.runtime.Executable) -> str:
    """The candidate as a shared library the runner loads: linked by the target CPU's cross gcc where it
    is another architecture's (measured on that CPU over RPC), else by this machine's compiler."""
    from tvmattn.compiler.cross import emulate

    path = os.path.join(tempfile.mkdtemp(prefix="tvmattn-tune-"), "candidate.so")
    target = getattr(executable, "tvmattn_target", None)
    if target is None:
        executable.export_library(path)
    else:
        emulate.export_library(executable, target, path)
    return path


def use_threads(cores: int) -> None:
    """Runner worker start-up: size TVM's thread pool before it exists."""
    os.environ["TVM_NUM_THREADS"] = str(cores)


Fill = tuple[int, "int | tuple[int, int]"]  # an argument's index; its value, or where to read it (a size)


def alloc_local(fills: list[Fill], device, args_info, alloc_repeat: int) -> list:
    fill = tvm.get_global_func(RANDOM_FILL)
    return _with_fills(alloc_argument_common(fill, device, args_info, alloc_repeat), args_info, fills)


def alloc_remote(fills: list[Fill], session, device, args_info, alloc_repeat: int) -> list:
    fill = get_global_func_on_rpc_session(session, RANDOM_FILL, "the RPC server's TVM lacks random fill")
    return _with_fills(alloc_argument_common(fill, device, args_info, alloc_repeat), args_info, fills)


def _with_fills(repeated_args: list, args_info, fills: list[Fill]) -> list:
    for index, value in fills:
        if not isinstance(value, int):  # a symbolic size: read it from the shape of an input
            arg, axis = value
            value = int(args_info[arg][2][axis])
        for args in repeated_args:
            args[index].copyfrom(np.full(tuple(args[index].shape), value, dtype=args[index].dtype))
    return repeated_args


def _fills(spec: AttentionSpec) -> list[Fill]:
    """The arguments `arguments.TABLE` fills with one value, for any instance of ``spec`` (tasks share
    one runner)."""
    shapes = list(spec.input_shapes().values())
    out = []
    for index, row in enumerate(arguments.taken(spec)):
        if row.measure_fill is None:
            continue
        size = row.measure_fill(spec)
        if not isinstance(size, int):
            size = next((i, axis) for i, shape in enumerate(shapes) for axis, d in enumerate(shape) if d == size)
        out.append((index, size))
    return out
