"""Kernels built with ``thread_pool="openmp"`` run their parallel loops on the process's OpenMP
threads (torch's), as many as ``torch.set_num_threads`` says; and such a kernel is not exported."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

torch = pytest.importorskip("torch")  # it loads the OpenMP runtime

import tvmattn  # noqa: E402
from tvmattn.compiler import openmp  # noqa: E402
from tvmattn.compiler.build import tvm_compile  # noqa: E402
from tvmattn.compiler.target import host_target  # noqa: E402
from tvmattn.compiler.verify import TOLERANCE, errors, random_inputs  # noqa: E402

pytestmark = pytest.mark.skipif(not openmp.available(), reason="torch's build has no GNU OpenMP entry points")
TASKS = 4


@T.prim_func
def which_thread(out: T.Buffer((TASKS,), "int32")):
    for i in T.parallel(TASKS):  # a team of TASKS threads: one iteration per task
        out[i] = T.call_extern("int32", "omp_get_thread_num")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("thread_pool, team", [("openmp", TASKS), ("openmp", 1), ("tvm", TASKS)])
def test_tasks_run_on_the_openmp_team_torch_sets(threads, thread_pool, team):
    threads(team)
    kernel = tvm_compile(tvm.IRModule({"main": which_thread}), host_target(), thread_pool).jit()
    out = tvm.runtime.tensor(np.full(TASKS, -1, np.int32))
    kernel["main"](out)
    # TVM's own workers are not OpenMP threads: omp_get_thread_num() is 0 on every one of them
    want = list(range(TASKS)) if thread_pool == "openmp" and team == TASKS else [0] * TASKS
    assert sorted(out.numpy().tolist()) == want


def test_an_openmp_kernel_matches_the_oracle_and_is_not_exported(threads, tmp_path):
    threads(2)
    spec = tvmattn.AttentionSpec(batch="b", seq_len="n", num_heads=4, num_kv_heads=2, head_dim=16,
                                 projections=False, causal=True)
    kernel = tvmattn.compile(spec, thread_pool="openmp")
    arrays = random_inputs(spec, {"b": 2, "n": 37})
    assert errors(kernel(*arrays.values()), tvmattn.reference(spec, *arrays.values()))[1] <= TOLERANCE["float32"]
    with pytest.raises(tvmattn.TvmAttnError, match="export one built with tvmattn.compile"):
        kernel.export_library(str(tmp_path / "kernel.so"))


def test_a_thread_pool_that_does_not_exist_is_refused():
    with pytest.raises(tvmattn.TvmAttnError, match="thread_pool='omp'"):
        tvmattn.compile(tvmattn.AttentionSpec(head_dim=16, projections=False), thread_pool="omp")
