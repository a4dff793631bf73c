"""nvcc and ptxas for CUDA kernels built on a machine without a GPU: PTX, cubin, resource usage."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import TvmAttnError

_PTXAS_FUNC = re.compile(r"Compiling entry function '(\w+)'")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass
class KernelResources:
    name: str
    registers: int
    shared_bytes: int
    spill_bytes: int

    def line(self) -> str:
        return (f"{self.name}: {self.registers} registers, {self.shared_bytes} B shared memory, "
                f"{self.spill_bytes} B spilled")


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def compile_cubin(source: str, arch: str) -> tuple[bytes, list[KernelResources]]:
    """nvcc -cubin with ``ptxas -v``: the cubin and what each kernel uses."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise TvmAttnError("nvcc not found: install the CUDA toolkit to compile CUDA kernels to PTX/cubin")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        src.write_text(source)
        proc = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-O3", "-Xptxas", "-v", "-o", str(cubin), str(src)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise TvmAttnError(f"nvcc failed for {arch}: {_first_error(proc.stderr)}")
        return cubin.read_bytes(), parse_ptxas(proc.stderr)


def compile_ptx(source: str, arch: str) -> str:
    """nvcc -ptx: the PTX text."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise TvmAttnError("nvcc not found: install the CUDA toolkit to compile CUDA kernels to PTX/cubin")
    with tempfile.TemporaryDirectory() as tmp:
        src, ptx = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.ptx"
        src.write_text(source)
        proc = subprocess.run([nvcc, "-ptx", f"-arch={arch}", "-O3", "-o", str(ptx), str(src)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise TvmAttnError(f"nvcc failed for {arch}: {_first_error(proc.stderr)}")
        return ptx.read_text()


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
