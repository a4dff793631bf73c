"""The programs a foreign CPU's kernels need here: its cross gcc (to link) and qemu-user (to run), each
missing one a single line saying which Debian package installs it."""

from __future__ import annotations

import shutil

from tvmattn.compiler.errors import TvmAttnError

# architecture → (program, Debian package)
GCC = {"aarch64": ("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu"),
       "riscv64": ("riscv64-linux-gnu-gcc", "gcc-riscv64-linux-gnu")}
# the C library the static harness links (Debian's cross gcc only recommends it)
LIBC = {"aarch64": "libc6-dev-arm64-cross", "riscv64": "libc6-dev-riscv64-cross"}
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
