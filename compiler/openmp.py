"""CPU kernels whose parallel loops run on the process's OpenMP threads: PyTorch's.

TVM's generated code starts every parallel loop through a function pointer of its module,
``__TVMBackendParallelLaunch``, which TVM's runtime points at TVM's own thread pool. Beside torch
that makes two pools on the same cores, and each steals from the other: torch's OpenMP workers spin
for a while after every op (libgomp reads its wait policy once, when torch is loaded), TVM's after
every kernel. Inside a Llama layer a (1, 16, 1024, 64) causal attention took 21 ms where it takes
13.5 ms alone, and torch's next GEMM slowed as much.

A kernel built with `install_pass` instead points that launcher, on entry, at `GOMP_parallel`: its
tasks run on torch's (already spinning) workers, as many as ``torch.set_num_threads`` says, and
TVM's pool is never started. The launcher is compiled once per process (`launcher_address`), and its
address is written into each kernel: such a kernel is valid in this process only (it cannot be
exported).

The launcher, as TVM calls it (``FTVMParallelLaunch``), and the task each OpenMP thread runs:

    int launch(int (*lambda)(int task_id, TVMParallelGroupEnv* env, void* cdata), void* cdata, int n):
        job = {lambda, cdata, failed = 0}
        GOMP_parallel(task, &job, n, 0)            # n = 0: the OpenMP default team (torch's threads)
        return job.failed

    void task(job):                                # on each thread of the team
        env = {sync_handle = NULL, num_task = omp_get_num_threads()}
        if job.lambda(omp_get_thread_num(), &env, job.cdata) != 0: job.failed = -1
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import tvm
from tvm import tirx
from tvm.ir import PrimType, StringImm

from tvmattn.compiler.errors import TvmAttnError

PACKED = 1  # TVM's CallingConv::kCPackedFunc: the function is already lowered, MakePackedAPI leaves it
_LOADED: list = []  # the launcher's module

# Inline helpers for the two functions above (TVM links imported IR as always-inline copies, so a
# function whose address is taken must be a PrimFunc of the module; these are their bodies).
_HELPERS_IR = r"""
%tvmattn.env = type { ptr, i32 }        ; TVMParallelGroupEnv {sync_handle, num_task}
%tvmattn.job = type { ptr, ptr, i32 }   ; {lambda, cdata, failed}
declare void @GOMP_parallel(ptr, ptr, i32, i32)
declare i32 @omp_get_thread_num()
declare i32 @omp_get_num_threads()
declare i32 @tvmattn_omp_launch(ptr, ptr, i32)
declare i32 @tvmattn_omp_task(ptr)

define i64 @tvmattn_launcher_address() {
  ret i64 ptrtoint (ptr @tvmattn_omp_launch to i64)
}

define i32 @tvmattn_gomp_launch(ptr %lambda, ptr %cdata, i32 %num_task) {
  %job = alloca %tvmattn.job
  store ptr %lambda, ptr %job
  %cdata.p = getelementptr inbounds %tvmattn.job, ptr %job, i32 0, i32 1
  store ptr %cdata, ptr %cdata.p
  %failed.p = getelementptr inbounds %tvmattn.job, ptr %job, i32 0, i32 2
  store i32 0, ptr %failed.p
  call void @GOMP_parallel(ptr @tvmattn_omp_task, ptr %job, i32 %num_task, i32 0)
  %failed = load i32, ptr %failed.p
  ret i32 %failed
}

define i32 @tvmattn_gomp_task(ptr %job) {
  %lambda = load ptr, ptr %job
  %cdata.p = getelementptr inbounds %tvmattn.job, ptr %job, i32 0, i32 1
  %cdata = load ptr, ptr %cdata.p
  %id = call i32 @omp_get_thread_num()
  %n = call i32 @omp_get_num_threads()
  %env = alloca %tvmattn.env
  store ptr null, ptr %env
  %n.p = getelementptr inbounds %tvmattn.env, ptr %env, i32 0, i32 1
  store i32 %n, ptr %n.p
  %status = call i32 %lambda(i32 %id, ptr %env, ptr %cdata)
  %bad = icmp ne i32 %status, 0
  br i1 %bad, label %fail, label %done
fail:
  %failed.p = getelementptr inbounds %tvmattn.job, ptr %job, i32 0, i32 2
  store atomic i32 -1, ptr %failed.p monotonic, align 4
  br label %done
done:
  ret i32 0
}
"""

_INSTALL_IR = r"""
@__TVMBackendParallelLaunch = external global ptr
define i32 @tvmattn_launch_on_openmp() {
  store ptr inttoptr (i64 %d to ptr), ptr @__TVMBackendParallelLaunch
  ret i32 0
}
"""


def available() -> bool:
    """Whether an OpenMP runtime with GNU's entry points is loaded (torch's libgomp, or Intel's)."""
    try:
        ctypes.CDLL(None).GOMP_parallel  # noqa: B018 (a lookup: AttributeError when absent)
    except AttributeError:
        return False
    return True


@functools.cache
def launcher_address() -> int:
    """The address of the launcher, compiled on first use (once per process)."""
    if not available():
        raise TvmAttnError("no OpenMP runtime is loaded in this process (GOMP_parallel not found): "
                           "import torch first, or build the kernel with TVM's own thread pool")
    target = tvm.target.Target("llvm")
    lam, cdata, num_task, job = (tirx.Var(n, t) for n, t in
                                 (("lambda", "handle"), ("cdata", "handle"), ("num_task", "int32"), ("job", "handle")))
    ok = tirx.call_extern("int32", "tvmattn_gomp_launch", lam, cdata, num_task) == 0
    zero = tirx.Return(tirx.IntImm("int32", 0))
    launch = tirx.SeqStmt([tirx.AssertStmt(ok, StringImm("RuntimeError"), [StringImm("a parallel task failed")]),
                           zero])
    # GOMP_parallel calls the task as void(void*): the int it returns (the x86-64 ABI's rax) is ignored
    task = tirx.SeqStmt([tirx.Evaluate(tirx.call_extern("int32", "tvmattn_gomp_task", job)), zero])
    out = tirx.decl_buffer((1,), "int64", "out")
    address = tirx.AttrStmt(StringImm("openmp"), "pragma_import_llvm", StringImm(_HELPERS_IR),
                            tirx.BufferStore(out, tirx.call_extern("int64", "tvmattn_launcher_address"), [0]))

    def lowered(name: str, params: list, body) -> tirx.PrimFunc:
        return tirx.PrimFunc(params, body, PrimType("int32")).with_attrs(
            {"global_symbol": name, "calling_conv": PACKED, "target": target})

    module = tvm.IRModule({"tvmattn_omp_launch": lowered("tvmattn_omp_launch", [lam, cdata, num_task], launch),
                           "tvmattn_omp_task": lowered("tvmattn_omp_task", [job], task),
                           "address": tirx.PrimFunc([out], address).with_attrs(
                               {"global_symbol": "address", "target": target})})
    lib = tvm.compile(module, target).jit()
    _LOADED.append(lib)  # kernels point at its code: it stays loaded
    result = tvm.runtime.tensor(np.zeros(1, np.int64))
    lib["address"](result)
    return int(result.numpy()[0])


def install_pass() -> tvm.transform.Pass:
    """For the end of the CPU pipeline (after MakePackedAPI): each entry function first points its
    module's parallel launcher at `launcher_address`."""
    install_ir = _INSTALL_IR % launcher_address()

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.LaunchOnOpenMP")
    def transform(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
        if func.attrs is None or "global_symbol" not in func.attrs:
            return func
        body = tirx.SeqStmt([tirx.Evaluate(tirx.call_extern("int32", "tvmattn_launch_on_openmp")), func.body])
        return func.with_body(tirx.AttrStmt(StringImm("openmp"), "pragma_import_llvm", StringImm(install_ir), body))

    return transform
