"""Test helpers: one compile per (spec, target, knobs) or (spec, tiles) for the whole session, and the
one comparison of a kernel with the float64 oracle."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import tvm_ffi
from tvm.s_tir import SBlock
from tvm.target import Target

import tvmattn
from tvmattn.compiler.build import build_serial
from tvmattn.compiler.flash import FlashTiles
from tvmattn.compiler.isa.x86_amx import AMX_TILES
from tvmattn.compiler.isa.x86_bf16 import BF16_DOT
from tvmattn.compiler.kernel import CompiledAttention
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import AMX_FEATURES, CPUINFO_FEATURES, has_feature, host_target
from tvmattn.compiler.verify import check

HOST = host_target()
# This CPU with AMX's features off, and AVX512-FP16's: the AVX512-BF16 kernels a CPU without them (Zen 4) runs,
# runnable here
_OFF = (*AMX_FEATURES, "avx512fp16")
NO_AMX = Target({"kind": "llvm", "mcpu": str(HOST.attrs["mcpu"]), "num-cores": int(HOST.attrs["num-cores"]),
                 "mattr": [str(f) for f in HOST.attrs.get("mattr", ()) if str(f)[1:] not in _OFF]
                 + [f"-{f}" for f in _OFF]})


def every_other_slow(*axes, ids=None) -> list:
    """Parametrize one list of cases, or the product of several axes, with every second case under
    ``-m slow`` (a product's in a checkerboard, so that each value of each axis stays in the default
    run): the default run keeps a spread of the cases, the slow run all of them. (The test command
    must finish in 10 minutes on 2 cores.)"""
    cases = [(c if isinstance(c, tuple) else (c,), n) for n, c in enumerate(axes[0])] if len(axes) == 1 else \
        [(tuple(v for _, v in case), sum(n for n, _ in case)) for case in itertools.product(*map(enumerate, axes))]
    ids = list(ids) if ids is not None else [None] * len(cases)
    return [pytest.param(*c, id=i, marks=[pytest.mark.slow] if n % 2 else []) for (c, n), i in zip(cases, ids)]


def runs_here(target: Target) -> bool:
    """Whether this CPU has every feature ``target``'s code may use (an AVX-512 kernel on Zen 3 faults)."""
    return all(has_feature(HOST, f) for f in CPUINFO_FEATURES.values() if has_feature(target, f))


@functools.lru_cache(maxsize=64)
def compiled(spec: AttentionSpec, target: str | Target = "cpu", knobs: tuple = ()) -> CompiledAttention:
    return tvmattn.compile(spec, target, knobs=dict(knobs) or None)


@functools.lru_cache(maxsize=64)
def serial(spec: AttentionSpec, tiles: FlashTiles) -> CompiledAttention:
    """The online-softmax template of ``spec``, compiled serially for this CPU (the CUDA numerics)."""
    return build_serial(spec, tiles)


def assert_matches_oracle(kernel: CompiledAttention, sizes: dict[str, int] | None = None, seed: int = 0,
                          **inputs: np.ndarray) -> None:
    """Run ``kernel`` on seeded random arguments (``inputs`` replace those of their names) at ``sizes``
    (its symbolic lengths) and compare with `tvmattn.reference` within the dtype's tolerance."""
    result = check(kernel, sizes, seed, inputs)
    assert result.ok, f"{result.line()} for {kernel.spec!r} [{kernel.schedule}]"


# the update blocks of the products a 16-bit instruction may compute, by the product's name
PRODUCTS = {"scores": "QKᵀ", "pv": "P·V", "q_proj_acc": "W_Q", "k_proj_acc": "W_K", "v_proj_acc": "W_V",
            "out_acc": "W_O"}


def products_on(kernel: CompiledAttention, instruction: str) -> set[str]:
    """The products (QKᵀ, P·V, W_Q, …) of ``kernel``'s scheduled TIR that ``instruction`` computes:
    "dot" (the bf16 dot product's function) or "tiles" (AMX's tile product), read from the update
    blocks the schedule tensorized."""
    call = {"dot": BF16_DOT.function, "tiles": AMX_TILES.instruction}[instruction]
    found = set()

    def on_block(block: SBlock, visitor) -> None:
        stage = block.name_hint.removesuffix("_update_o")
        if stage in PRODUCTS and block.name_hint != stage and call in block.body.script():
            found.add(PRODUCTS[stage])
        visitor.default_visit(block)

    tvm_ffi.structural_visit(kernel.module["main"].body, [(SBlock, on_block)])
    return found


def block_names(kernel: CompiledAttention) -> set[str]:
    """The names of the blocks of ``kernel``'s scheduled TIR."""
    names = set()

    def on_block(block: SBlock, visitor) -> None:
        names.add(block.name_hint)
        visitor.default_visit(block)

    tvm_ffi.structural_visit(kernel.module["main"].body, [(SBlock, on_block)])
    return names
