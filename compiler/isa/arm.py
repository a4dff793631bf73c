"""aarch64's vector instruction sets for the CPU kernels: NEON and SVE at a fixed length.

NEON: 32 registers of 128 bits (4 fp32 lanes), an FMA by element (``fmla v0.4s, v1.4s, v2.s[0]``)
that takes a query's broadcast score straight from a lane. Every aarch64 CPU has it.

SVE: scalable registers of 128 to 2048 bits. The kernels use a fixed length per CPU, not
vector-length-agnostic code: TVM 0.27 schedules fixed-width vectors (its scalable vectorisation
is not what `schedules.cpu` builds, and ``+sve`` alone emits none: apache/tvm#17456), and LLVM lowers
fixed-width vectors onto SVE's registers when told the length is at least N bits
(``-aarch64-sve-vector-bits-min``, set per CPU by `compiler.cross.cpus`). The code then runs on any
SVE CPU of that length or longer (the vectors are predicated to N bits), which is the CPU it names.
Only a length above NEON's 128 bits pays (Neoverse V1's 256): at 128 bits (Neoverse V2) SVE's
registers are NEON's, and the NEON record is used. Neoverse V1 has two full 256-bit FMA pipes, so
fp32 takes the larger register tiles (`Isa.full_width`), 8 vectors of queries a row: each broadcast
key (a load and a DUP: SVE has no FMA by element across 256 bits) is shared by 8 FMAs, not 2 (llvm-mca's
V1 model: QKᵀ 66 % → 89 % of the FMA peak at 64 queries, 80 % at 32; P·V 66 % → 80 %;
scripts/mca_predict.py). NEON's tiles keep 4 vectors a row (16 queries: its bfdot spills at more).
Both records take fp16 arithmetic where the CPU has FEAT_FP16 (`HALF`, `Isa.half_math`): fp16 P·V on
``fmla v.8h`` / ``z.h``, twice fp32's lanes.
"""

from __future__ import annotations

from tvm.target import Target

from tvmattn.compiler.isa.record import Isa

HALF = "fullfp16"  # FEAT_FP16, fp16 vector arithmetic (fmla v.8h, z.h): Cortex-A76, Neoverse, Apple M
SVE_BITS_OPTION = "-aarch64-sve-vector-bits-min"  # LLVM's option: SVE registers are at least this long


def sve_bits(target: Target) -> int:
    """The SVE register length ``target`` declares (``cl-opt``), 0 if none."""
    for option in target.attrs.get("cl-opt", ()):
        name, _, value = str(option).partition("=")
        if name.split(":")[0] == SVE_BITS_OPTION:
            return int(value)
    return 0


NEON = Isa("neon", "generic", bits=128, registers=32, arch="aarch64", requires=("neon",), half_feature=HALF)
SVE256 = Isa("sve256", "generic", bits=256, registers=32, arch="aarch64", requires=("sve",), full_width=True,
             query_vectors=8, half_feature=HALF,
             applies=lambda target: sve_bits(target) >= 256)
