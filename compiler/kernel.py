"""`CompiledAttention`: a built kernel with the calling convention of its spec.

    core   kernel(q, k, v, **extras)                 -> o    (arrays in the spec's layout)
    layer  kernel(x, w_q, w_k, w_v, w_o, **extras)   -> out  (B, n, d)

the extras being the keyword rows of `arguments.TABLE` the spec takes.

NumPy in, NumPy out (arrays are converted to the spec's dtype; bfloat16 is ``ml_dtypes.bfloat16``).
On a CPU kernel, C-contiguous arrays of the right dtype cross by DLPack without a copy, at any
element offset (the kernels declare their arguments aligned to one element:
`passes.element_aligned_arguments`); others are converted once. The kernel writes its result in place
into a NumPy array (``out=`` reuses one). `run` is the copy-free path on TVM tensors already on the device.
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime import Executable
from tvm.target import Target

from tvmattn.compiler import arguments, concurrency
from tvmattn.compiler.arguments import numpy_dtype
from tvmattn.compiler.cross import emulate
from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import is_foreign

# Tensor._create_view's own function: the method spends ~8 µs a call building its Shape in Python,
# a small kernel's whole budget for four arguments
_CREATE_VIEW = tvm.get_global_func("runtime.TVMTensorCreateView")
_BFLOAT16 = tvm_ffi.dtype("bfloat16")
_UINT16 = tvm_ffi.dtype("uint16")
_NUMPY_BF16 = numpy_dtype("bfloat16")
_NUMPY_U16 = np.dtype(np.uint16)


def host_tensor(arr: np.ndarray) -> tvm.runtime.Tensor:
    """A TVM tensor on ``arr``'s memory (no copy); ``arr`` must be C-contiguous and element-aligned."""
    if arr.dtype == _NUMPY_BF16:  # DLPack in NumPy has no bfloat16: cross as uint16, view back
        return _CREATE_VIEW(tvm_ffi.from_dlpack(arr.view(_NUMPY_U16)), arr.shape, _BFLOAT16, 0)
    return tvm_ffi.from_dlpack(arr)


def host_array(tensor: tvm.runtime.Tensor, bf16: bool | None = None) -> np.ndarray:
    """A CPU ``tensor`` as NumPy without a copy (`host_tensor`'s inverse: bfloat16 crosses as uint16);
    the array keeps the tensor's memory alive. ``bf16``: whether it is bfloat16, where the caller knows
    (reading the tensor's dtype costs more than the rest)."""
    if tensor.dtype == _BFLOAT16 if bf16 is None else bf16:
        return np.from_dlpack(_CREATE_VIEW(tensor, tensor.shape, _UINT16, 0)).view(_NUMPY_BF16)
    return np.from_dlpack(tensor)


def host_argument(arr: np.ndarray) -> np.ndarray:
    """``arr`` as ``host_tensor`` takes it: C-contiguous, element-aligned and writeable (DLPack cannot
    export a read-only array). A copy only when it is not all three already."""
    flags = arr.flags
    if flags.c_contiguous and flags.aligned and flags.writeable:
        return arr
    return np.require(arr, requirements="CAW")  # not ascontiguousarray: that makes a 0-d array 1-D


@dataclass
class CompiledAttention:
    spec: AttentionSpec
    target: Target
    executable: Executable
    schedule: str  # what the build used, in words ("default schedule (q_tile=16 …)", "tuned record …")
    compile_seconds: float
    module: tvm.IRModule | None = None  # the scheduled module that was built (for inspection)
    thread_pool: str = "tvm"  # CPU: "tvm", or "openmp" (this process's, torch's: `compiler.openmp`)

    # ---- calling ----------------------------------------------------------------------------------
    def __call__(self, *arrays: Any, out: np.ndarray | None = None, **extras: Any) -> np.ndarray:
        """The kernel on NumPy arrays, ``extras`` by name (`arguments.TABLE`); the result is ``out``
        (written in place) or a new array."""
        args, sizes = self._arguments(arrays, extras)
        out_shape = tuple(sizes[d] if isinstance(d, str) else d for d in self._output_dims)
        result = self._output(out, out_shape)
        if self._foreign:  # another CPU's code: run under qemu-user (`cross.emulate`)
            emulate.warn_once(f"{self.spec.describe()} for {self.target.attrs.get('mcpu')}")
            emulate.run(self._harness, self.target, list(args.values()), result)
            return result
        if self._on_cuda:  # host arrays must be copied to the GPU and back
            dev = self.device
            dev_out = tvm.runtime.empty(out_shape, self.spec.dtype, dev)
            self.run(*[tvm.runtime.tensor(a, dev) for a in args.values()], dev_out)
            result[...] = dev_out.numpy()
            return result
        self.run(*[host_tensor(a) for a in args.values()], host_tensor(result))
        return result

    def run(self, *tensors: Any) -> None:
        """Call the kernel on device tensors (TVM tensors, or any DLPack tensor such as a torch tensor,
        compact; CPU: aligned to an element, CUDA: to 64 bytes): the inputs in PrimFunc order, then the
        output."""
        if self._foreign:
            raise TvmAttnError(f"this kernel is for {self.target.attrs.get('mtriple')}: call it on NumPy arrays "
                               "(kernel(q, k, v) runs it under qemu-user) or export_library it for that CPU")
        self._call(*tensors)

    @functools.cached_property
    def _main(self) -> tvm_ffi.Function:
        # Executable.__call__ looks the function up on every call (~2 µs); the kernel path keeps it.
        return self.executable.jit()["main"]

    @functools.cached_property
    def _call(self) -> Callable[..., None]:
        """`_main` as this kernel's thread pool needs it called (safe after a fork: `concurrency`)."""
        if self._on_cuda:
            return self._main
        launch = concurrency.run_on_openmp if self.thread_pool == "openmp" else concurrency.run_on_tvm_pool
        return functools.partial(launch, self._main)

    # what a call checks against, worked out once (a call's own overhead is a few µs)
    @functools.cached_property
    def _signature(self) -> dict[str, tuple[tuple, np.dtype]]:
        """Each argument's shape (symbolic sizes as names) and NumPy dtype, in PrimFunc order."""
        shapes = self.spec.input_shapes()
        return {name: (shape, numpy_dtype(self.spec.input_dtype(name))) for name, shape in shapes.items()}

    @functools.cached_property
    def _output_dims(self) -> tuple:
        return self.spec.output_shape()

    @functools.cached_property
    def _on_cuda(self) -> bool:
        return self.target.kind.name == "cuda"

    @functools.cached_property
    def _foreign(self) -> bool:
        return is_foreign(self.target)

    @property
    def _harness(self) -> Path:
        """This kernel linked into the emulation harness (built on the first emulated call)."""
        return Path(concurrency.once(self, "_harness_dir", self._new_harness).name) / "harness"

    def _new_harness(self) -> tempfile.TemporaryDirectory:
        directory = tempfile.TemporaryDirectory(prefix="tvmattn-harness-")  # removed with the kernel
        emulate.build_harness(self.executable, self.target, Path(directory.name))
        return directory

    def _output(self, out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
        dtype = numpy_dtype(self.spec.dtype)
        if out is None:
            return np.empty(shape, dtype)
        if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != dtype \
                or not (out.flags.c_contiguous and out.flags.aligned and out.flags.writeable):
            got = f"{type(out).__name__} {getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}".strip()
            raise TvmAttnError(f"out= must be a writeable C-contiguous NumPy array of shape {shape} and dtype "
                               f"{dtype}, got {got}: allocate it with numpy.empty({shape}, {dtype.name!r})")
        return out

    @property
    def device(self) -> tvm.runtime.Device:
        if self.target.kind.name == "cuda":
            dev = tvm.cuda(0)
            if not dev.exist:
                raise TvmAttnError("no CUDA device on this machine: the kernel is compiled, run it where a "
                                   "GPU is (export_library) or read its source")
            return dev
        return tvm.cpu(0)

    def input_names(self) -> list[str]:
        return list(self.spec.input_shapes())

    # ---- artefacts ------------------------------------------------------------------------------
    def export_library(self, path: str) -> None:
        """A shared library of the kernel (another CPU's: linked by its cross gcc, `cross.toolchain`)."""
        if self.thread_pool == "openmp" and not self._foreign:
            raise TvmAttnError("this kernel starts its parallel loops through a launcher compiled into this "
                               "process (thread_pool='openmp'): export one built with tvmattn.compile(spec)")
        emulate.export_library(self.executable, self.target, path)

    def source(self) -> str:
        """CUDA C for a cuda kernel, LLVM assembly for a CPU kernel."""
        if self.target.kind.name == "cuda":
            return next(m.inspect_source() for m in self.executable.mod.imports if m.kind == "cuda")
        return self.executable.mod.inspect_source("asm")

    # ---- argument checking ----------------------------------------------------------------------
    def _arguments(self, arrays: tuple, extras: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """The arrays in PrimFunc order, converted and shape-checked; and the symbolic sizes they bind."""
        given = arguments.arrange(self.spec, arrays, extras)
        sizes: dict[str, int] = {}
        out: dict[str, np.ndarray] = {}
        for name, (want, dtype) in self._signature.items():
            arr = given[name]
            if not (type(arr) is np.ndarray and arr.dtype == dtype):
                arr = np.asarray(arr).astype(dtype, copy=False)
            arr = host_argument(arr)
            _bind_shape(name, arr.shape, want, sizes)
            out[name] = arr
        for row in arguments.taken(self.spec):
            if row.check is not None:
                row.check(self.spec, out[row.name], sizes)
        return out, sizes


def _bind_shape(name: str, got: tuple[int, ...], want: tuple, sizes: dict[str, int]) -> None:
    """Check ``got`` against ``want`` (ints and symbolic names), recording what each name is bound to."""
    if len(got) != len(want) or any(
            (w != g) if isinstance(w, int) else (sizes.setdefault(w, g) != g) for g, w in zip(got, want)):
        raise TvmAttnError(f"{name} has shape {tuple(got)}; this spec expects {_pretty(want)}"
                           + (f" with {', '.join(f'{k}={v}' for k, v in sizes.items())}" if sizes else ""))
    if any(g == 0 for g in got):
        raise TvmAttnError(f"{name} has an empty dimension {tuple(got)}: sizes must be positive")


def _pretty(shape: tuple) -> str:
    return "(" + ", ".join(str(w) for w in shape) + ")"
