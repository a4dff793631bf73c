"""`Isa`: what the CPU kernels use of one instruction set, as a value that rules and passes read.

A record says how wide a vector register is and how many there are (the register tiles' size),
which 16-bit dot-product instruction and which tile registers exist (with the tensor intrinsics
that emit them and the LLVM IR they link), which lowering passes its kernels need after scheduling,
and how fp32 ``exp2`` is lowered on one of its vectors. `tvmattn.compiler.target.isa_of` chooses the
record of a target once; an instruction set is one record (`x86_avx`, `x86_bf16`, `x86_amx`, `arm`,
`riscv`), and nothing outside the records names its instructions or features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import tvm
from tvm.ir.expr import Expr as PrimExpr
from tvm.target import Target, codegen


@dataclass(frozen=True)
class Dot:
    """A dot product of 16-bit pairs into fp32 lanes: ``C[i] += A[2i]·B[2i] + A[2i+1]·B[2i+1]``."""

    instruction: str  # its mnemonic, for descriptions
    lanes: int  # fp32 accumulators per instruction
    pair: int  # products per lane: the reduction's steps side by side in a panel
    intrinsic: str  # C[i] += B[i, k]·A[k] (QKᵀ: the query panel, a key's pair broadcast)
    pair_first: str  # C[i] += A[k]·B[i, k] (P·V and the projections: a pair of x broadcast, W's panel)
    pairs: Callable[..., str]  # (source dtype, width, heads_between, part) → the intrinsic packing a panel
    function: str  # what the intrinsics call: it reads the packed operands as their bits
    llvm: str  # LLVM IR of ``function``, linked into the kernel's module


@dataclass(frozen=True)
class Narrow:
    """fp32 vectors rounded to bf16 (to nearest even) by the instruction set's conversion: the LLVM
    function for each lane count, (lanes, name), defined in ``llvm`` (`passes.narrow_bf16`)."""

    functions: tuple[tuple[int, str], ...]
    llvm: str


@dataclass(frozen=True)
class Tiles:
    """Tile registers of 16-bit products: a ``block`` × ``block`` fp32 accumulator, ``step`` of the
    reduction per product."""

    name: str  # the tiles' name, for descriptions
    instruction: str  # the product's mnemonic, for descriptions
    rows: int  # rows of one tile register
    block: int  # rows and columns of an accumulator block
    step: int  # 16-bit elements of the reduction per tile row
    dot: Callable[..., str]  # (heads_between, gemm, parts) → the product intrinsic
    zero: Callable[..., str]  # (gemm) → the accumulator's init intrinsic
    store: str  # the accumulator's store intrinsic
    transposed_values: Callable[..., str]  # (heads_between) → V's 16-bit rows packed as the product's A
    configure: Callable  # (sch, loop): each iteration of ``loop`` configures the tiles
    load: str  # the tile load the intrinsics call: it reads the packed operands as their bits
    llvm: str  # LLVM IR the intrinsics call (the dot product's too: P's pairs are rounded by it)


@dataclass(frozen=True)
class Isa:
    """One CPU instruction set as the kernels use it."""

    name: str
    family: str  # the CPU rules that take it (`schedules.RULES["llvm"]`)
    bits: int  # of a vector register (RVV: of a register group, `riscv`)
    registers: int  # vector registers (groups): the register tiles must fit them
    arch: str = ""  # the LLVM architecture (mtriple's first part) it is for: x86_64, aarch64, riscv64; "": any
    requires: tuple[str, ...] = ()  # LLVM features a target must have for this record
    full_width: bool = False  # a vector FMA retires in one pass (not two halves): fp32 takes larger tiles
    full_width_cpus: tuple[str, ...] = ()  # LLVM CPU names (mcpu) whose FMAs are full width
    query_vectors: int = 4  # vectors of queries a row of a wide register tile spans, below AVX-512's 16 lanes
    tile_knobs: tuple[tuple[str, int], ...] = ()  # the core's knob defaults where the record's tiles are its own
    key_step: int = 1  # keys a step of P·V's loop on fp32 FMAs (unrolled: fewer loop instructions per FMA)
    # an fp16 V converted per vector in P·V, not widened once: with 16 registers and x86's F16C the
    # conversion, shared by a tile's rows, costs less than the copy (measured on Zen 3)
    converts_v: bool = False
    half_feature: str = ""  # the LLVM feature of fp16 vector arithmetic on these registers, if any
    half_math: bool = False  # the target has it (`target.isa_of`): fp16 P·V on fp16 FMAs
    dot: Dot | None = None  # the 16-bit dot product, if any
    narrow: Narrow | None = None  # fp32 → bf16 in one instruction, if any
    tiles: Tiles | None = None  # tile registers, if any
    passes: tuple[tvm.transform.Pass, ...] = ()  # lowering passes its kernels need after scheduling
    exp2: Callable[[PrimExpr, tuple[float, ...]], PrimExpr] | None = field(default=None, compare=False)
    # what else a target must declare for this record, beyond features (SVE's register length: `arm.sve_bits`)
    applies: Callable[[Target], bool] | None = field(default=None, compare=False)

    def fits(self, target: Target, arch: str) -> bool:
        """Whether ``target`` (of LLVM architecture ``arch``) can take this record."""
        return (self.arch in ("", arch) and all(has_feature(target, f) for f in self.requires)
                and (self.applies is None or self.applies(target)))

    @property
    def lanes(self) -> int:
        """fp32 lanes of a vector register."""
        return self.bits // 32

    @property
    def packed_readers(self) -> tuple[str, ...]:
        """The calls that read packed 16-bit operands as the bits they hold (`passes.keep_operands_16bit`)."""
        return ((self.dot.function,) if self.dot else ()) + ((self.tiles.load,) if self.tiles else ())

    def vector_lanes(self, dtype: str = "float32") -> int:
        """Lanes of ``dtype`` in a vector register."""
        return self.bits // tvm.DataType(dtype).bits


# Any other LLVM CPU: 128-bit vectors (SSE, NEON's width), 16 of them, fp32 FMAs only
GENERIC = Isa("generic", "generic", bits=128, registers=16, converts_v=True)


def has_feature(target: Target, feature: str) -> bool:
    """Whether LLVM says ``target``'s CPU (``mcpu``, ``mattr``) has ``feature`` (LLVM's name for it)."""
    try:
        return bool(codegen.llvm_cpu_has_features(feature, target))
    except Exception:  # an LLVM without that query: assume the baseline
        return False
