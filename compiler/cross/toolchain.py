"""The programs a foreign CPU's kernels need here: its cross gcc (to link) and qemu-user (to run), each
missing one a single line saying which Debian package installs it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tvmattn.compiler.errors import TvmAttnError

# architecture → (program, Debian package)
GCC = {"aarch64": ("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu"),
       "riscv64": ("riscv64-linux-gnu-gcc", "gcc-riscv64-linux-gnu")}
# the C library the static harness links (Debian's cross gcc only recommends it)
LIBC = {"aarch64": "libc6-dev-arm64-cross", "riscv64": "libc6-dev-riscv64-cross"}
# where qemu-user finds a dynamically linked program's loader and C/C++ libraries (Debian's cross packages)
SYSROOT = {"aarch64": ("/usr/aarch64-linux-gnu", "libstdc++6-arm64-cross"),
           "riscv64": ("/usr/riscv64-linux-gnu", "libstdc++6-riscv64-cross")}
QEMU = {"aarch64": ("qemu-aarch64-static", "qemu-user-static"),
        "riscv64": ("qemu-riscv64-static", "qemu-user-static")}
MCA = ("llvm-mca", "llvm")


def program(name: str, package: str, purpose: str) -> str:
    """The path of ``name`` on PATH, or a `TvmAttnError` naming the package that installs it."""
    path = shutil.which(name)
    if path is None:
        raise TvmAttnError(f"{name} not found on PATH: it is needed to {purpose}; install it with "
                           f"`apt-get install {package}` (Debian, Ubuntu)")
    return path


def cross_gcc(arch: str) -> str:
    return program(*GCC[arch], f"link kernels for {arch}")


def qemu(arch: str) -> str:
    return program(*QEMU[arch], f"run {arch} kernels on this machine")


def sysroot(arch: str) -> str:
    """The directory qemu-user reads ``arch``'s shared libraries from (libstdc++ for TVM's runtime)."""
    root, package = SYSROOT[arch]
    if not (Path(root) / "lib" / "libstdc++.so.6").is_file():
        raise TvmAttnError(f"{root} has no libstdc++.so.6 for TVM's {arch} runtime to run with: install it with "
                           f"`apt-get install {package}` (Debian, Ubuntu)")
    return root


def link(arch: str, args: list[str], what: str) -> None:
    """``arch``'s cross gcc on ``args`` (building ``what``); a failure as one line."""
    gcc = cross_gcc(arch)
    done = subprocess.run([gcc, *args], capture_output=True, text=True)
    if done.returncode != 0 and ".h: No such file" in done.stderr:
        raise TvmAttnError(f"{Path(gcc).name} has no C library headers to build {what} with: install them with "
                           f"`apt-get install {LIBC[arch]}` (Debian, Ubuntu)")
    if done.returncode != 0:
        raise TvmAttnError(f"{Path(gcc).name} could not link {what}: "
                           f"{(done.stderr.strip().splitlines() or ['no message'])[-1]}")
