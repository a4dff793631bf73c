"""`CompiledAttention`: a built kernel with the calling convention of its spec.

    core   kernel(q, k, v, kv_lens=None, attn_mask=None)       -> o      (arrays in the spec's layout)
    layer  kernel(x, w_q, w_k, w_v, w_o, x_kv=None, kv_lens=None, attn_mask=None) -> out  (B, n, d)

NumPy in, NumPy out (arrays are converted to the spec's dtype; bfloat16 is ``ml_dtypes.bfloat16``).
`run` is the copy-free path on TVM tensors that are already on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import tvm
from tvm.runtime import Executable
from tvm.target import Target

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.spec import AttentionSpec


def numpy_dtype(dtype: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


@dataclass
class CompiledAttention:
    spec: AttentionSpec
    target: Target
    executable: Executable
    schedule: str  # what the build used, in words ("default schedule (q_tile=16 …)", "tuned record …")
    compile_seconds: float
    module: tvm.IRModule | None = None  # the scheduled module that was built (for inspection)

    # ---- calling ----------------------------------------------------------------------------------
    def __call__(self, *arrays: Any, x_kv: Any = None, kv_lens: Any = None, attn_mask: Any = None) -> np.ndarray:
        args, sizes = self._arguments(arrays, x_kv, kv_lens, attn_mask)
        dev = self.device
        tensors = [tvm.runtime.tensor(a, dev) for a in args.values()]
        out_shape = tuple(sizes[d] if isinstance(d, str) else d for d in self.spec.output_shape())
        out = tvm.runtime.empty(out_shape, self.spec.dtype, dev)
        self.run(*tensors, out)
        return out.numpy()

    def run(self, *tensors: tvm.runtime.Tensor) -> None:
        """Call the kernel on device tensors: the inputs in PrimFunc order, then the output."""
        self.executable(*tensors)

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
        self.executable.export_library(path)

    def source(self) -> str:
        """CUDA C for a cuda kernel, LLVM assembly for a CPU kernel."""
        if self.target.kind.name == "cuda":
            return next(m.inspect_source() for m in self.executable.mod.imports if m.kind == "cuda")
        return self.executable.mod.inspect_source("asm")

    # ---- argument checking ----------------------------------------------------------------------
    def _arguments(self, arrays: tuple, x_kv: Any, kv_lens: Any,
                   attn_mask: Any) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """The arrays in PrimFunc order, converted and shape-checked; and the symbolic sizes they bind."""
        spec = self.spec
        shapes = spec.input_shapes()
        positional = [n for n in shapes if n not in ("x_kv", "kv_lens", "attn_mask")]
        if len(arrays) != len(positional):
            raise TvmAttnError(f"the kernel takes {len(positional)} arrays ({', '.join(positional)}), "
                               f"got {len(arrays)}")
        given = dict(zip(positional, arrays))
        if spec.is_cross and spec.projections:
            if x_kv is None:
                raise TvmAttnError("this cross-attention layer needs x_kv=(B, n_kv, d), the keys' input")
            given["x_kv"] = x_kv
        elif x_kv is not None:
            raise TvmAttnError("x_kv is only for a cross-attention layer (a spec with kv_seq_len and projections)")
        if spec.key_padding:
            if kv_lens is None:
                raise TvmAttnError("this spec has key_padding: pass kv_lens=(B,) valid key counts")
            given["kv_lens"] = kv_lens
        elif kv_lens is not None:
            raise TvmAttnError("kv_lens given but the spec has no key_padding: build with key_padding=True")
        if spec.attn_mask is not None:
            if attn_mask is None:
                raise TvmAttnError(f"this spec has a {spec.attn_mask} attn_mask: pass attn_mask="
                                   f"{_pretty(spec.attn_mask_shape())}")
            given["attn_mask"] = attn_mask
        elif attn_mask is not None:
            raise TvmAttnError("attn_mask given but the spec has none: build with attn_mask='bool' or 'additive'")

        sizes: dict[str, int] = {}
        out: dict[str, np.ndarray] = {}
        for name, want in shapes.items():
            dtype = numpy_dtype(spec.input_dtype(name))
            arr = np.ascontiguousarray(np.asarray(given[name]).astype(dtype, copy=False))
            _bind_shape(name, arr.shape, want, sizes)
            out[name] = arr
        if spec.key_padding:
            n_kv = spec.n_kv if isinstance(spec.n_kv, int) else sizes[spec.n_kv]
            lens = out["kv_lens"]
            if lens.min(initial=0) < 0 or lens.max(initial=0) > n_kv:
                raise TvmAttnError(f"kv_lens must lie in [0, {n_kv}], got {lens.tolist()}")
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
