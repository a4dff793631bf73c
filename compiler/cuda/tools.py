"""CUDA kernels checked on a machine without a GPU: nvcc and ptxas (PTX, cubin, registers, spills),
and the lowered TIR (dynamic shared memory, global allocations, TVM's GPU code verifier)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Expr as PrimExpr
from tvm.s_tir.analysis import calculate_allocated_bytes, verify_gpu_code
from tvm.target import Target

from tvmattn.compiler.cuda.pipeline import compile_cuda, lower_cuda
from tvmattn.compiler.errors import TvmAttnError

_PTXAS_FUNC = re.compile(r"Compiling entry function '(\w+)'")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


# Shared memory one thread block may use (static + dynamic, with the opt-in attribute TVM sets).
SHARED_MEMORY_PER_BLOCK = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024}


@dataclass
class KernelResources:
    name: str
    registers: int
    shared_bytes: int  # static, as ptxas reports it
    spill_bytes: int
    dynamic_shared_bytes: int = 0  # allocated at launch (shared.dyn); ptxas does not see it

    @property
    def total_shared_bytes(self) -> int:
        return self.shared_bytes + self.dynamic_shared_bytes

    def line(self) -> str:
        dynamic = f" + {self.dynamic_shared_bytes} B dynamic" if self.dynamic_shared_bytes else ""
        return (f"{self.name}: {self.registers} registers, {self.shared_bytes} B shared memory{dynamic}, "
                f"{self.spill_bytes} B spilled")


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def compile_cubin(source: str, arch: str) -> tuple[bytes, list[KernelResources]]:
    """nvcc -cubin with ``ptxas -v``: the cubin and what each kernel uses."""
    cubin, log = _nvcc(source, arch, "cubin", "-Xptxas", "-v")
    return cubin, parse_ptxas(log)


def compile_ptx(source: str, arch: str) -> str:
    """nvcc -ptx: the PTX text."""
    return _nvcc(source, arch, "ptx")[0].decode()


def _nvcc(source: str, arch: str, output: str, *flags: str) -> tuple[bytes, str]:
    """nvcc -``output`` (cubin or ptx) of ``source`` for ``arch``: the file's bytes and nvcc's log."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise TvmAttnError("nvcc not found: install the CUDA toolkit to compile CUDA kernels to PTX/cubin")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "kernel.cu", Path(tmp) / f"kernel.{output}"
        src.write_text(source)
        proc = subprocess.run([nvcc, f"-{output}", f"-arch={arch}", "-O3", *flags, "-o", str(out), str(src)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise TvmAttnError(f"nvcc failed for {arch}: {_first_error(proc.stderr)}")
        return out.read_bytes(), proc.stderr


def kernel_resources(mod: tvm.IRModule, target: Target) -> list[KernelResources]:
    """Every kernel of a scheduled module: ptxas's registers, static shared memory and spills for the
    target's arch, with the dynamic shared memory TVM launches it with."""
    arch = str(target.attrs.get("arch", "sm_90"))
    source = next(m.inspect_source() for m in compile_cuda(mod, target).mod.imports if m.kind == "cuda")
    return with_dynamic_shared(compile_cubin(source, arch)[1], mod, target)


def with_dynamic_shared(resources: list[KernelResources], mod: tvm.IRModule, target: Target) -> list[KernelResources]:
    """``resources`` (ptxas's, of ``mod``'s kernels) with the dynamic shared memory each is launched with."""
    dynamic = {name: scopes.get("shared.dyn", 0) for name, scopes in calculate_allocated_bytes(
        device_functions(lower_cuda(mod, target))).items()}
    for r in resources:
        r.dynamic_shared_bytes = int(dynamic.get(r.name, 0))
    return resources


def device_functions(lowered: tvm.IRModule) -> tvm.IRModule:
    """The kernels of a lowered module (the functions that run on the GPU)."""
    return tvm.IRModule({gv: f for gv, f in lowered.functions.items()
                         if str(f.attrs.get("target", "")).startswith("cuda") or
                         f.attrs.get("calling_conv") == 2})


def verify_kernels(lowered: tvm.IRModule, arch: str) -> list[str]:
    """Kernels that fail TVM's GPU code verifier (threads, shared memory, vector width) for ``arch``."""
    limits = {"max_shared_memory_per_block": SHARED_MEMORY_PER_BLOCK.get(arch, 48 * 1024),
              "max_threads_per_block": 1024, "max_thread_x": 1024, "max_thread_y": 1024, "max_thread_z": 64,
              "max_vector_bytes": 16}
    return [gv.name_hint for gv, f in device_functions(lowered).functions.items()
            if not verify_gpu_code(_with_sizes(f, 4096), limits)]


def _with_sizes(kernel: tirx.PrimFunc, size: int) -> tirx.PrimFunc:
    """``kernel`` with its integer parameters (symbolic sizes) fixed: the verifier wants constant
    launch extents, and no limit it checks depends on them."""
    return kernel.specialize({p: tirx.const(size, p.ty.dtype) for p in kernel.params
                               if isinstance(p.ty, tvm.ir.PrimType) and "int" in str(p.ty.dtype)})


def global_allocations(lowered: tvm.IRModule) -> list[tuple[str, PrimExpr]]:
    """(name, elements) of every buffer a lowered module allocates in global memory."""
    found: list[tuple[str, PrimExpr]] = []

    def on_alloc(node: tirx.AllocBuffer, visitor) -> None:
        buf = node.buffer.ty
        if buf.storage_scope in ("", "global"):
            elements = tirx.const(1, "int64")
            for extent in buf.shape:
                elements = elements * extent
            found.append((node.buffer.name, tvm.sym.Analyzer().simplify(elements)))
        visitor.default_visit(node)

    for func in lowered.functions.values():
        tvm_ffi.structural_visit(func.body, [(tirx.AllocBuffer, on_alloc)])
    return found


def _first_error(log: str) -> str:
    """The line that says what failed (ptxas prints its info lines around it)."""
    lines = log.strip().splitlines() or ["(no output)"]
    return next((line for line in lines if "error" in line.lower()), lines[-1])


def parse_ptxas(log: str) -> list[KernelResources]:
    """Per-kernel registers, shared memory and spills from ``ptxas -v`` output."""
    kernels: list[KernelResources] = []
    for line in log.splitlines():
        if m := _PTXAS_FUNC.search(line):
            kernels.append(KernelResources(m.group(1), 0, 0, 0))
        elif kernels and (m := _PTXAS_USED.search(line)):
            smem = _PTXAS_SMEM.search(line)
            kernels[-1].registers = int(m.group(1))
            kernels[-1].shared_bytes = int(smem.group(1)) if smem else 0
        elif kernels and (m := _PTXAS_SPILL.search(line)):
            kernels[-1].spill_bytes = int(m.group(1)) + int(m.group(2))
    return kernels
