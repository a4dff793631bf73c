"""A foreign CPU's kernel, exported and run here: linked by its cross gcc (`export_library`) and, to be
checked, statically into the C harness (`harness.c`) run under qemu-user with the CPU's vector length
(`run`). Arrays cross as files; the harness calls the kernel through TVM-FFI's C calling convention."""

from __future__ import annotations

import functools
import logging
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import tvm_ffi
from tvm.runtime import Executable
from tvm.support import cc
from tvm.target import Target

from tvmattn.compiler.cross import cpus, toolchain
from tvmattn.compiler.errors import TvmAttnError

HARNESS = Path(__file__).with_name("harness.c")
# DLPack's type codes (the harness's DLTensors): int, uint, float, bfloat
_CODES = {"i": 0, "u": 1, "f": 2, "bfloat16": 4}
_EMULATION_SECONDS = 600  # one emulated call at most (qemu runs a small kernel in seconds)
log = logging.getLogger("tvmattn.cross")


def arch_of(target: Target) -> str:
    arch = str(target.attrs.get("mtriple", "")).split("-")[0]
    if arch not in cpus.ARCHES:
        raise TvmAttnError(f"target {target} is not one of {', '.join(cpus.ARCHES)}: nothing to cross-compile")
    return arch


def export_library(executable: Executable, target: Target, path: str | Path) -> None:
    """``executable`` as a shared library for ``target``'s CPU, linked by its cross gcc."""
    gcc = toolchain.cross_gcc(arch_of(target))
    executable.export_library(str(path), fcompile=cc.cross_compiler(gcc))


def build_harness(executable: Executable, target: Target, directory: Path) -> Path:
    """The harness linked statically with ``executable``'s kernel, as ``directory``/harness."""
    gcc = toolchain.cross_gcc(arch_of(target))
    kernel, harness = directory / "kernel.o", directory / "harness"
    executable.mod.write_to_file(str(kernel))
    command = [gcc, "-O2", "-static", "-pthread", "-o", str(harness), str(HARNESS), str(kernel), "-lm",
               *(f"-I{p}" for p in tvm_ffi.libinfo.include_paths())]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 and ".h: No such file" in done.stderr:
        raise TvmAttnError(f"{Path(gcc).name} has no C library headers to build the emulation harness with: "
                           f"install them with `apt-get install {toolchain.LIBC[arch_of(target)]}` (Debian, Ubuntu)")
    if done.returncode != 0:
        raise TvmAttnError(f"{Path(gcc).name} could not link the kernel into the emulation harness: "
                           f"{(done.stderr.strip().splitlines() or ['no message'])[-1]}")
    return harness


def _dl_type(dtype: np.dtype) -> tuple[int, int]:
    if dtype.name == "bfloat16":
        return _CODES["bfloat16"], 16
    return _CODES[dtype.kind], dtype.itemsize * 8


def run(harness: Path, target: Target, inputs: Sequence[np.ndarray], out: np.ndarray) -> None:
    """``harness`` on ``inputs`` under qemu-user as ``target``'s CPU; the kernel's output into ``out``."""
    arch = arch_of(target)
    cpu = cpus.cpu_of(target)
    qemu_cpu = cpu.qemu_cpu() if cpu is not None else cpus.cpu(arch).qemu_cpu()
    with tempfile.TemporaryDirectory(prefix="tvmattn-emulate-") as tmp:
        specs = []
        for i, arr in enumerate([*inputs, out]):
            path = Path(tmp) / f"arg{i}.bin"
            if i < len(inputs):
                np.ascontiguousarray(arr).tofile(path)
            code, bits = _dl_type(arr.dtype)
            specs.append(f"{code}:{bits}:{','.join(str(d) for d in arr.shape) or '1'}:{path}")
        command = [toolchain.qemu(arch), "-cpu", qemu_cpu, str(harness), *specs]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=_EMULATION_SECONDS)
        except subprocess.TimeoutExpired:
            raise TvmAttnError(f"the emulated kernel ran past {_EMULATION_SECONDS} s under qemu: "
                               "use smaller shapes") from None
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise TvmAttnError(f"the {arch} kernel failed under qemu ({' '.join(command[:3])}): {why}")
        out[...] = np.fromfile(specs[-1].split(":", 3)[3], dtype=out.dtype).reshape(out.shape)


@functools.lru_cache(maxsize=None)
def warn_once(what: str) -> None:
    """Say once per kind of kernel that its calls run emulated (they take seconds, not microseconds)."""
    log.warning("%s: this kernel is for another CPU; each call runs it under qemu-user emulation (slow)", what)

