"""A foreign CPU's kernel, exported and run here: linked by its cross gcc (`export_library`) and, to be
checked, statically into the C harness (`harness.c`) run under qemu-user with the CPU's vector length
(`run`). Arrays cross as files; the harness calls the kernel through TVM-FFI's C calling convention.
A whole model's library runs the same way on TVM's own runtime for that CPU (`run_model`, `runtime`)."""

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

from tvmattn.compiler import concurrency
from tvmattn.compiler.arguments import numpy_dtype
from tvmattn.compiler.cross import cpus, runtime, toolchain
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.target import is_foreign

HARNESS = Path(__file__).with_name("harness.c")
# DLPack's type codes (the programs' DLTensors): int, uint, float, bfloat, bool
_CODES = {"i": 0, "u": 1, "f": 2, "bfloat16": 4, "b": 6}
_NAMES = {0: "int", 1: "uint", 2: "float", 4: "bfloat"}
_EMULATION_SECONDS = 600  # one emulated call at most (qemu runs a small kernel in seconds)
log = logging.getLogger("tvmattn.cross")


def arch_of(target: Target) -> str:
    arch = str(target.attrs.get("mtriple", "")).split("-")[0]
    if arch not in cpus.ARCHES:
        raise TvmAttnError(f"target {target} is not one of {', '.join(cpus.ARCHES)}: nothing to cross-compile")
    return arch


def export_library(executable: Executable, target: Target, path: str | Path) -> None:
    """``executable`` as a shared library for ``target``'s CPU: linked by its cross gcc for another CPU,
    by this machine's compiler otherwise; one export at a time (`concurrency.one_at_a_time`)."""
    if not is_foreign(target):
        concurrency.one_at_a_time(executable.export_library, str(path))
        return
    compiler = cc.cross_compiler(toolchain.cross_gcc(arch_of(target)))
    concurrency.one_at_a_time(functools.partial(executable.export_library, fcompile=compiler), str(path))


def build_harness(executable: Executable, target: Target, directory: Path) -> Path:
    """The harness linked statically with ``executable``'s kernel, as ``directory``/harness."""
    kernel, harness = directory / "kernel.o", directory / "harness"
    executable.mod.write_to_file(str(kernel))
    toolchain.link(arch_of(target), ["-O2", "-static", "-pthread", "-o", str(harness), str(HARNESS), str(kernel), "-lm",
                                     *(f"-I{p}" for p in tvm_ffi.libinfo.include_paths())],
                   "the kernel into the emulation harness")
    return harness


def _dl_type(dtype: np.dtype) -> tuple[int, int]:
    if dtype.name == "bfloat16":
        return _CODES["bfloat16"], 16
    return _CODES[dtype.kind], dtype.itemsize * 8


def _numpy_type(code: int, bits: int) -> np.dtype:
    return numpy_dtype("bool" if code == _CODES["b"] else f"{_NAMES[code]}{bits}")


def _spec(arr: np.ndarray, path: Path, scalar: str, write: bool = True) -> str:
    """``arr`` (written into ``path``) as the programs' argument CODE:BITS:D0,D1,...:FILE (``scalar``: a 0-d shape)"""
    if write:
        np.ascontiguousarray(arr).tofile(path)
    code, bits = _dl_type(arr.dtype)
    return f"{code}:{bits}:{','.join(str(d) for d in arr.shape) or scalar}:{path}"


def _emulate(command: list[str], arch: str, what: str) -> str:
    """``command`` (qemu-user and its program) to its end; its stdout, or a failure as one line."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_EMULATION_SECONDS)
    except subprocess.TimeoutExpired:
        raise TvmAttnError(f"the emulated {what} ran past {_EMULATION_SECONDS} s under qemu: "
                           "use smaller shapes") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise TvmAttnError(f"the {arch} {what} failed under qemu ({' '.join(command[:3])}): {why}")
    return done.stdout


def _qemu_cpu(target: Target) -> str:
    cpu = cpus.cpu_of(target)
    return (cpu or cpus.cpu(arch_of(target))).qemu_cpu()


def run(harness: Path, target: Target, inputs: Sequence[np.ndarray], out: np.ndarray) -> None:
    """``harness`` on ``inputs`` under qemu-user as ``target``'s CPU; the kernel's output into ``out``."""
    arch = arch_of(target)
    with tempfile.TemporaryDirectory(prefix="tvmattn-emulate-") as tmp:
        specs = [_spec(arr, Path(tmp) / f"arg{i}.bin", "1") for i, arr in enumerate(inputs)]
        specs.append(_spec(out, Path(tmp) / "out.bin", "1", write=False))
        _emulate([toolchain.qemu(arch), "-cpu", _qemu_cpu(target), str(harness), *specs], arch, "kernel")
        out[...] = np.fromfile(Path(tmp) / "out.bin", dtype=out.dtype).reshape(out.shape)


def run_model(library: Path, target: Target, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """A whole model's ``library`` (exported for ``target``) on ``inputs``, run by TVM's own runtime for that
    CPU under qemu-user (`runtime`, `model_driver.c`): its outputs."""
    arch = arch_of(target)
    program = runtime.driver(arch)
    with tempfile.TemporaryDirectory(prefix="tvmattn-emulate-") as tmp:
        specs = [_spec(arr, Path(tmp) / f"in{i}.bin", "-") for i, arr in enumerate(inputs)]
        command = [toolchain.qemu(arch), "-L", toolchain.sysroot(arch), "-cpu", _qemu_cpu(target),
                   str(program), str(library), tmp, *specs]
        outs = []
        for line in _emulate(command, arch, "model").splitlines():  # "i CODE:BITS:D0,D1,..."
            i, (code, bits, dims) = int(line.split()[0]), line.split()[1].split(":")
            shape = () if dims == "-" else tuple(int(d) for d in dims.split(","))
            outs.append(np.fromfile(Path(tmp) / f"out{i}.bin", dtype=_numpy_type(int(code), int(bits))).reshape(shape))
        return outs


@functools.lru_cache(maxsize=None)
def warn_once(what: str, kind: str = "kernel") -> None:
    """Say once per kernel (or model) that its calls run emulated (they take seconds, not microseconds)."""
    log.warning("%s: this %s is for another CPU; each call runs it under qemu-user emulation (slow)", what, kind)

