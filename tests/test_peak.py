"""The peak loop `tvmattn bench` divides by: the instruction the kernels use, every one of them run."""

import re

import pytest
from helpers import runs_here
from tvm.target import Target

from tvmattn.compiler.peak import ACCUMULATORS, DEPTH, STEP, STEPS, peak_loop


@pytest.mark.parametrize("mcpu,lanes,has_dot", [("znver5", 16, True), ("znver4", 16, True),
                                                ("skylake-avx512", 16, False), ("znver3", 8, False)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_peak_loop_runs_the_kernels_instruction_on_full_registers(mcpu, lanes, has_dot, dtype):
    target = Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    loop = peak_loop(target, dtype, 2)
    dots = dtype == "bfloat16" and has_dot
    asm = loop.module.mod.inspect_source("asm")
    register = {16: "zmm", 8: "ymm"}[lanes]
    fmas = re.findall(rf"vfmadd\d+ps\s[^\n]*%{register}", asm)
    chains = ACCUMULATORS[lanes]
    if dots:
        assert asm.count("vdpbf16ps") == chains * DEPTH and not fmas
    else:
        assert len(fmas) == chains * DEPTH and "vdpbf16ps" not in asm
    instruction = "vdpbf16ps" if dots else "vfmadd"
    body = asm[asm.index(instruction):asm.rindex(instruction)]  # the loop
    assert "(%rsp)" not in body  # every chain in a register: nothing spilled
    assert loop.flops == 2 * STEPS * DEPTH * chains * lanes * (4 if dots else 2)
    if runs_here(target):  # each chain added exactly STEP per product: every instruction ran
        loop.run()
        assert (loop.out == STEPS * DEPTH * STEP * (2 if dots else 1)).all()
