"""TVM's own runtime for another CPU, to run a whole imported model under qemu-user: ``libtvm_runtime.so``
(the Relax VM) and ``libtvm_ffi.so`` from PyPI's aarch64 wheels of the apache-tvm and apache-tvm-ffi
versions installed here, fetched once with pip into the cache, and the C driver (`model_driver.c`) linked
with them by the CPU's cross gcc. ``$TVMATTN_RUNTIME_<ARCH>`` names a directory holding the two libraries
instead (offline, or a runtime built for a CPU PyPI has no wheel for: riscv64)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tvm_ffi

from tvmattn.compiler.cross import toolchain
from tvmattn.compiler.errors import TvmAttnError

DRIVER = Path(__file__).with_name("model_driver.c")
# the wheel's platform tag per architecture (PyPI has TVM's aarch64 wheels, no riscv64 ones)
PLATFORMS = {"aarch64": "manylinux_2_28_aarch64"}
# package → the library its wheel holds
LIBRARIES = {"apache-tvm": "tvm/lib/libtvm_runtime.so", "apache-tvm-ffi": "tvm_ffi/lib/libtvm_ffi.so"}


def variable(arch: str) -> str:
    return f"TVMATTN_RUNTIME_{arch.upper()}"


def directory(arch: str) -> Path:
    """A directory holding ``arch``'s ``libtvm_runtime.so`` and ``libtvm_ffi.so`` (fetched on first use)."""
    named = os.environ.get(variable(arch))
    if named:
        missing = [Path(lib).name for lib in LIBRARIES.values() if not (Path(named) / Path(lib).name).is_file()]
        if missing:
            raise TvmAttnError(f"${variable(arch)} is {named}, which lacks {' and '.join(missing)}")
        return Path(named)
    if arch not in PLATFORMS:
        raise TvmAttnError(f"TVM publishes no {arch} wheel of its runtime to run a whole model with: build "
                           f"libtvm_runtime.so and libtvm_ffi.so for {arch} and name their directory in "
                           f"${variable(arch)}")
    versions = {package: importlib.metadata.version(package) for package in LIBRARIES}
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tvmattn" / "runtimes"
    where = home / "-".join([arch, *(f"{p}{v}" for p, v in versions.items())])
    if not all((where / Path(lib).name).is_file() for lib in LIBRARIES.values()):
        _fetch(arch, versions, where)
    return where


def _fetch(arch: str, versions: dict[str, str], where: Path) -> None:
    """The two libraries out of the wheels pip downloads (each moved in whole: concurrent fetches are safe)."""
    where.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   "--platform", PLATFORMS[arch], "--python-version", f"{sys.version_info[0]}.{sys.version_info[1]}",
                   "--dest", tmp, *(f"{p}=={v}" for p, v in versions.items())]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            wanted = " ".join(f"{p}=={v}" for p, v in versions.items())
            raise TvmAttnError(f"could not download TVM's {arch} runtime ({wanted}): {why}. Download the wheels "
                               f"elsewhere, unzip {' and '.join(LIBRARIES.values())} into one directory and name it in "
                               f"${variable(arch)}")
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                for lib in set(LIBRARIES.values()) & set(archive.namelist()):
                    part = Path(tmp) / Path(lib).name
                    part.write_bytes(archive.read(lib))
                    os.replace(part, where / part.name)


def driver(arch: str) -> Path:
    """`model_driver.c` linked for ``arch`` with its runtime, in that directory (built once per source text)."""
    where = directory(arch)
    digest = hashlib.sha256(DRIVER.read_bytes() + DRIVER.with_name("arrays.h").read_bytes()).hexdigest()[:12]
    program = where / f"model_driver-{digest}"
    if program.is_file():
        return program
    with tempfile.TemporaryDirectory(dir=where) as tmp:  # (linked whole, then moved in: concurrent builds are safe)
        part = Path(tmp) / program.name
        toolchain.link(arch, ["-O2", "-o", str(part), str(DRIVER), *(f"-I{p}" for p in tvm_ffi.libinfo.include_paths()),
                              f"-L{where}", "-Wl,--no-as-needed", "-ltvm_runtime", "-ltvm_ffi", "-Wl,-rpath,$ORIGIN"],
                       f"the model driver with TVM's {arch} runtime in {where}")
        os.replace(part, program)
    return program
