"""How `ImportedModel.run` crosses between NumPy and the VM: what it reads decided once a model
(`Calling`), the inputs checked as ONNX Runtime checks them, the outputs handed back without a copy.
A one-token step of a small decoder is ~0.1 ms of compiled code and each Python line here ~1 µs: this
crossing took ~50 µs of such a step (5 inputs, 5 outputs) before it was decided once and kept to
what each call must do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import tvm
from tvm_ffi.container import _ffi_api as _containers

from tvmattn.compiler.errors import TvmAttnError, tvm_reason
from tvmattn.compiler.kernel import host_argument, host_array

# an element of the VM's tuple of outputs: the Array's own __getitem__ asks its length again each time
_ITEM = _containers.ArrayGetItem


@dataclass(frozen=True)
class Expected:
    """One graph input as `arguments` checks it."""

    name: str
    dtype: np.dtype
    declared: str  # the dtype as the model names it
    shape: tuple[int | str | None, ...]  # a size, a named (symbolic) size, or None: unknown
    static: tuple[int, ...] | None  # the shape where every size is given: one comparison checks it


@dataclass(frozen=True)
class Calling:
    """What every `run` reads, decided once a model."""

    foreign: bool  # another CPU's library: run emulated
    on_cpu: bool  # the arrays cross without a copy
    inputs: tuple[Expected, ...]
    into: tuple[int | None, ...]  # each output: the input it is written into in place, if any
    bf16: tuple[bool, ...]  # each output: bfloat16 (crosses DLPack as uint16)


def expected(name: str, dtype: np.dtype, declared: str, shape: tuple) -> Expected:
    static = tuple(shape) if all(isinstance(d, int) for d in shape) else None
    return Expected(name, dtype, declared, tuple(shape), static)


def arguments(inputs: Sequence[Expected], feed: Mapping[str, Any]) -> list[np.ndarray]:
    """``feed``'s arrays in the model's input order, each checked (dtype, shape, sizes shared between
    inputs) and as `host_tensor` takes it; a clear error naming the input otherwise."""
    if type(feed) is not dict and not isinstance(feed, Mapping):  # (the ABC's check costs a µs)
        raise TvmAttnError(f"run takes a mapping of input name → array, not {type(feed).__name__}: "
                           f"run({{{', '.join(repr(i.name) + ': …' for i in inputs)}}})")
    if len(feed) > len(inputs) or any(i.name not in feed for i in inputs):
        names = {i.name for i in inputs}
        unknown = sorted(set(feed) - names)
        if unknown:
            raise TvmAttnError(f"unknown input {unknown[0]!r}: the model's inputs are "
                               f"{', '.join(i.name for i in inputs)}")
        spec = next(i for i in inputs if i.name not in feed)
        raise TvmAttnError(f"missing input {spec.name!r} ({spec.declared}, shape {pretty(spec.shape)})")
    sizes: dict[str, int] = {}
    args = []
    for spec in inputs:
        arr = feed[spec.name]
        if type(arr) is not np.ndarray:
            try:
                arr = np.asarray(arr)
            except (TypeError, ValueError) as err:
                raise TvmAttnError(f"input {spec.name!r} is not an array ({err})") from None
        if arr.dtype != spec.dtype:  # as ONNX Runtime: a silent cast would hide a caller's mistake
            raise TvmAttnError(f"input {spec.name!r} is {arr.dtype}; the model takes {spec.declared}: pass "
                               f"it as .astype(np.{spec.dtype.name})")
        shape = arr.shape
        if shape != spec.static and (len(shape) != len(spec.shape) or any(
                w is not None and (w != g if isinstance(w, int) else sizes.setdefault(w, g) != g)
                for g, w in zip(shape, spec.shape))):
            raise TvmAttnError(f"input {spec.name!r} has shape {shape}; the model takes "
                               f"{pretty(spec.shape)}" + (f" with {sizes}" if sizes else ""))
        if 0 in shape:
            raise TvmAttnError(f"input {spec.name!r} has an empty dimension, shape {shape}: every size "
                               f"must be at least 1")
        try:
            args.append(host_argument(arr))
        except MemoryError:  # a broadcast view whose copy does not fit
            raise TvmAttnError(f"input {spec.name!r} of shape {shape} needs {_gib(arr.nbytes)} as a "
                               f"contiguous array, more than this machine can allocate") from None
    return args


def outputs(out: Any) -> list[tvm.runtime.Tensor | np.ndarray]:
    """The VM's result (one tensor, or a tuple of them) as a list; an output that is a shape (a graph
    output written by ONNX Shape, which TVM keeps a shape value) as NumPy int64, as ONNX declares it."""
    outs = [out] if isinstance(out, tvm.runtime.Tensor) else [_ITEM(out, i) for i in range(len(out))]
    return [o if isinstance(o, tvm.runtime.Tensor) else _int64(o) for o in outs]


def _int64(value: Any) -> np.ndarray:
    """A shape value (or a scalar) as ONNX's int64 array."""
    return np.asarray(tuple(value) if isinstance(value, tvm.runtime.ShapeTuple) else value, np.int64)


def host_outputs(outs: list[tvm.runtime.Tensor | np.ndarray], calling: Calling, args: list[np.ndarray],
                 tensors: list[tvm.runtime.Tensor]) -> list[np.ndarray]:
    """CPU outputs as NumPy without a copy (an LM head's logits at n = 1024 are 206 MB: 28 ms to copy),
    each array keeping the VM's buffer alive; an in-place output is its input's array. An output on an
    input's memory otherwise (an Identity, a Reshape of one) is copied, as ONNX Runtime's never is."""
    starts = [t.data_ptr() for t in tensors]
    spans = list(zip(starts, [start + a.nbytes for start, a in zip(starts, args)]))
    result = []
    for out, into, bf16 in zip(outs, calling.into, calling.bf16):
        if isinstance(out, np.ndarray):  # (`outputs`: a shape)
            result.append(out)
            continue
        start = out.data_ptr()
        if into is not None and start == starts[into]:
            result.append(args[into])
            continue
        try:
            view = host_array(out, bf16)
        except (BufferError, TypeError, ValueError, RuntimeError):  # dtypes DLPack cannot give NumPy
            view = out.numpy()
        for lo, hi in spans:
            if lo <= start < hi:
                view = view.copy()
                break
        result.append(view)
    return result


def run_failure(err: Exception, args: list[np.ndarray]) -> str:
    """What a failed run says to the user: the model's own check (an index out of range, a size that
    does not fit), or for an allocation failure how much memory the inputs alone hold and its two causes (a
    size computed from the inputs' that is negative, as for audio shorter than a convolution's window, asks
    the allocator for an impossible number of bytes)."""
    text = str(err).strip()
    if "bad_alloc" in text or isinstance(err, MemoryError):
        return (f"the model could not allocate a tensor (its inputs alone hold {_gib(sum(a.nbytes for a in args))}): "
                f"inputs shorter than the model takes (a convolution's window) give a negative size; otherwise "
                f"use smaller inputs or a machine with more memory")
    return f"the model rejected its inputs: {tvm_reason(err)}"


def pretty(shape: tuple) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB"
