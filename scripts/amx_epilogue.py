"""The C measurements behind the README's AMX paragraphs, on this machine's first core: where a tile
GEMM's epilogue runs (`c/amx_epilogue.c`: after each block, interleaved with the next block's products as
`passes.interleave_tile_epilogues` does, or whole after them) and the bf16 dot product's rate against
the FMA's (`c/dot_rates.c`). Needs gcc; the first needs AMX (Sapphire Rapids and later), the second
AVX512-BF16.

    python scripts/amx_epilogue.py [--row-blocks 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tvmattn.compiler.isa.x86_host import cpuinfo_flags  # noqa: E402

HERE = Path(__file__).parent / "c"


def _run(source: str, flags: list[str], args: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "a.out")
        subprocess.run(["gcc", "-O2", "-march=native", *flags, str(HERE / source), "-o", exe], check=True)
        subprocess.run(["taskset", "-c", "0", exe, *args], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row-blocks", type=int, default=8, help="blocks of 32 rows (M = 32 × this, at most 8)")
    a = p.parse_args()
    flags = cpuinfo_flags() or frozenset()
    if "avx512_bf16" in flags:
        _run("dot_rates.c", [], [])
    else:
        print("no AVX512-BF16 here: the dot product's rate is left out")
    if {"amx_tile", "amx_bf16"} <= flags:
        _run("amx_epilogue.c", ["-mamx-tile", "-mamx-bf16"], [str(min(a.row_blocks, 8))])
    else:
        print("no AMX here: the epilogue placements are left out")


if __name__ == "__main__":
    main()
