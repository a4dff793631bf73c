"""Kernels for aarch64 (NEON, SVE-256) and RISC-V (RVV): cross-compiled, run under qemu-user against
the float64 oracle, their assembly on the target's vector FMAs, and one line for a missing tool."""

import concurrent.futures
import logging
import os
import re
import shutil

import numpy as np
import pytest
from helpers import every_other_slow

import tvmattn
from tvmattn import schedules
from tvmattn.compiler.cli import main
from tvmattn.compiler.cross import cpus
from tvmattn.compiler.cross.toolchain import GCC, LIBC, QEMU
from tvmattn.compiler.onnx.export import export_onnx
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.target import isa_of, resolve_target
from tvmattn.compiler.tuning import measure, space
from tvmattn.compiler.tuning.tuner import tune
from tvmattn.compiler.verify import check, sizes_to_check

TOOLS = [tool for arch in cpus.ARCHES for tool in (GCC[arch][0], QEMU[arch][0])]
MISSING = [tool for tool in TOOLS if shutil.which(tool) is None] + [
    LIBC[arch] for arch in cpus.ARCHES if not os.path.exists(f"/usr/{arch}-linux-gnu/include/stdio.h")]
needs_tools = pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not installed (.ci/run installs them)")

# one CPU per vector instruction set: NEON, SVE at 256 bits, RVV at VLEN 256
CPUS = [("aarch64", "aarch64"), ("aarch64", "neoverse-v1"), ("riscv64", "spacemit-x60")]
SMALL = dict(batch=1, seq_len=24, num_heads=4, head_dim=16, projections=False)
AXES = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window=8),
    "key padding": dict(key_padding=True),
    "additive mask": dict(attn_mask="additive"),
    "gqa": dict(num_kv_heads=2),
    "softcap": dict(softcap=30.0),
    "decode": dict(seq_len=1, kv_seq_len=40),
    "symbolic": dict(seq_len="n", causal=True),
    "layer": dict(projections=True, d_model=64, head_dim=None, causal=True),
    "bf16": dict(dtype="bfloat16", head_dim=32),
}
WIDE = {  # the slow sweep's: every axis above and these, on every named CPU
    **AXES, "plain": {}, "bshd": dict(layout="BSHD"), "fp16": dict(dtype="float16", head_dim=32),
    "alibi": dict(alibi="signed", causal=True), "sinks": dict(sinks=True), "decode symbolic": dict(
        seq_len=1, kv_seq_len="m"), "bf16 layer": dict(dtype="bfloat16", projections=True, d_model=64, head_dim=None),
    "fp16 gqa decode": dict(dtype="float16", seq_len=1, kv_seq_len=33, num_kv_heads=1, head_dim=32),
}


def assert_emulated_matches_oracle(arch: str, mcpu: str, **fields) -> None:
    """The kernel of ``SMALL`` with ``fields`` for ``mcpu``, run under qemu at its symbolic lengths (13,
    29), against the float64 oracle within the dtype's tolerance."""
    spec = AttentionSpec(**{**SMALL, **fields})
    kernel = tvmattn.compile(spec, arch, mcpu=mcpu, tuned=False)
    for sizes in sizes_to_check(spec, {"n": 13, "m": 29} if spec.symbolic_dims else None):
        result = check(kernel, sizes)
        assert result.ok, f"{result.line()} on {mcpu} for {spec.describe()} [{kernel.schedule}]"


@needs_tools
@pytest.mark.parametrize("arch,mcpu", CPUS, ids=[m for _, m in CPUS])
@pytest.mark.parametrize("axis", list(AXES))
def test_emulated_kernel_matches_oracle(arch, mcpu, axis):
    assert_emulated_matches_oracle(arch, mcpu, **AXES[axis])


BF16 = dict(dtype="bfloat16", head_dim=32)
BFDOT_AXES = {"causal": dict(causal=True), "symbolic": dict(seq_len="n"), "gqa ragged": dict(
    num_kv_heads=1, seq_len=21, kv_seq_len=19), "layer": dict(projections=True, d_model=64, head_dim=None)}


@needs_tools
@pytest.mark.parametrize("axis,mcpu", every_other_slow(list(BFDOT_AXES), ["neoverse-v2", "neoverse-v1"]))
def test_emulated_bfdot_kernel_matches_oracle(axis, mcpu):
    """bf16 on bfdot, NEON's (Neoverse V2) and SVE-256's (V1): QKᵀ, P·V and a layer's projections on the
    dot products."""
    assert_emulated_matches_oracle("aarch64", mcpu, **{**BF16, **BFDOT_AXES[axis]})


FP16 = dict(dtype="float16", seq_len=32, head_dim=32)  # keys in whole blocks (32; 16 masked): P·V on fp16 FMAs
HALF_AXES = {"plain": {}, "causal": dict(causal=True), "gqa bshd": dict(num_kv_heads=2, layout="BSHD"),
             "window": dict(causal=True, window=8), "key padding": dict(key_padding=True),
             "additive mask": dict(attn_mask="additive"), "rows in tiles": dict(seq_len=21, kv_seq_len=64),
             "symbolic queries": dict(seq_len="n", kv_seq_len=64),
             "layer": dict(projections=True, d_model=64, head_dim=None, causal=True)}


@needs_tools
@pytest.mark.parametrize("axis,mcpu", every_other_slow(list(HALF_AXES), ["neoverse-v2", "neoverse-v1"]))
def test_emulated_fp16_pv_on_fp16_fmas_matches_oracle(axis, mcpu):
    """fp16 P·V on FEAT_FP16's FMAs, NEON's (Neoverse V2) and SVE-256's (V1), summed in fp16 over blocks
    of 32 keys (16 where masked), the blocks in fp32."""
    assert_emulated_matches_oracle("aarch64", mcpu, **{**FP16, **HALF_AXES[axis]})


@needs_tools
def test_emulated_fp16_pv_sums_blocks_of_keys_in_fp32():
    """fp16 sums over 4096 equal weights of V = 1 would stop at 2048 (2048 + 1 rounds to 2048 in fp16)
    and return 0.5; blocks of 32 keys added in fp32 return 1."""
    spec = AttentionSpec(batch=1, seq_len=16, kv_seq_len=4096, num_heads=1, head_dim=16, projections=False,
                         dtype="float16")
    kernel = tvmattn.compile(spec, "aarch64", mcpu="neoverse-v2", tuned=False)
    assert "P·V on fp16 FMAs" in kernel.schedule
    k = np.random.default_rng(0).standard_normal((1, 1, 4096, 16)).astype(np.float16)
    ones = np.ones((1, 1, 4096, 16), np.float16)
    result = check(kernel, inputs={"q": np.zeros((1, 1, 16, 16), np.float16), "k": k, "v": ones})
    assert result.max_abs <= 1e-3, result.line()


@pytest.mark.parametrize("mcpu,pv_fma", [("neoverse-v2", r"\tfmla\tv\d+\.8h"),
                                         ("neoverse-v1", r"\tfmla\tz\d+\.h|\tfmad\tz\d+\.h")])
def test_fp16_pv_runs_on_fp16_fmas_qk_on_fp32(mcpu, pv_fma):
    """P·V on fp16 FMAs where the CPU has FEAT_FP16; QKᵀ on fp32 FMAs (fp32 sums: an error in a logit is
    one in exp's argument); the generic aarch64 (no FEAT_FP16) widens both."""
    spec = AttentionSpec(**{**SMALL, **FP16})
    asm = tvmattn.compile(spec, "aarch64", mcpu=mcpu, tuned=False).source()
    assert len(re.findall(pv_fma, asm)) >= 8
    assert len(re.findall(VECTOR_FMA[isa_of(resolve_target("aarch64", mcpu=mcpu)).name], asm)) >= 8
    assert not re.findall(r"\tfmla\tv\d+\.8h|\tfmla\tz\d+\.h", tvmattn.compile(spec, "aarch64", tuned=False).source())


@pytest.mark.slow
@needs_tools
@pytest.mark.parametrize("mcpu", list(cpus.CPUS))
@pytest.mark.parametrize("axis", list(WIDE))
def test_emulated_sweep(mcpu, axis):
    assert_emulated_matches_oracle(cpus.CPUS[mcpu].arch, mcpu, **WIDE[axis])


# the vector FMA each instruction set's kernels must use, and the scalar one that must not carry a loop
NEON_FMA, ARM_SCALAR_FMA = r"\tfmla\tv\d+\.4s", r"\tfmadd\ts\d+"
SVE_FMA = r"\tfmla\tz\d+\.s|\tfmad\tz\d+\.s"
VECTOR_FMA = {"neon": NEON_FMA, "neon-bf16": NEON_FMA, "sve256": SVE_FMA, "sve256-bf16": SVE_FMA,
              "rvv256": r"\tvfmacc\.v[fv]|\tvfmadd\.v[fv]"}
SCALAR_FMA = {**dict.fromkeys(("neon", "neon-bf16", "sve256", "sve256-bf16"), ARM_SCALAR_FMA),
              "rvv256": r"\tfmadd\.s\t"}


@pytest.mark.parametrize("arch,mcpu", CPUS, ids=[m for _, m in CPUS])
def test_assembly_is_on_vector_fmas(arch, mcpu):
    """QKᵀ and P·V on the target's vector FMAs (SVE's on z-registers: the fixed 256-bit length reached
    LLVM), none on scalar ones."""
    spec = AttentionSpec(**{**SMALL, "head_dim": 32, "causal": True})
    kernel = tvmattn.compile(spec, arch, mcpu=mcpu, tuned=False)
    isa = isa_of(kernel.target).name
    asm = kernel.source()
    assert len(re.findall(VECTOR_FMA[isa], asm)) >= 16, f"{isa}: too few vector FMAs in\n{asm[:2000]}"
    assert not re.findall(SCALAR_FMA[isa], asm), f"{isa}: a scalar FMA"


def test_rvv256_runs_on_register_groups_of_two():
    """RVV-256's kernels on groups of two registers (LMUL 2: 16 fp32 lanes an instruction), P·V's loop
    two keys a step (llvm-mca's X280 model: 82 % and 85 % of its m2 FMA peak, from 65-70 % on single
    registers)."""
    spec = AttentionSpec(**{**SMALL, "head_dim": 64, "seq_len": 96})
    asm = tvmattn.compile(spec, "riscv64", mcpu="spacemit-x60", tuned=False).source()
    assert re.search(r"\tvset\w+\t\w+, \w+, e32, m2,", asm)
    assert len(re.findall(r"\tvfmacc\.vf\t", asm)) >= 24


@needs_tools
@pytest.mark.parametrize("fields", [dict(seq_len=100, causal=True, window=8), dict(seq_len=100, key_padding=True)],
                         ids=["window", "key padding"])
def test_emulated_rvv256_key_steps_meet_skipped_tiles(fields):
    """P·V's keys two a step where the hidden ones are skipped: a query tile's first visible key is odd
    (48-query tiles, a window of 8) or a sequence's last is (odd key lengths), and every key stage then
    computes whole steps (`KEY_STEP`), so P·V never reads a weight no stage wrote."""
    assert_emulated_matches_oracle("riscv64", "spacemit-x60", **fields)


def test_neon_bfdot_takes_its_pair_by_element():
    """NEON's bfdot reads the broadcast pair by element from a 32-bit load (``ldr s``), not a load-and-
    replicate (``ld1r``: on Neoverse V2 a vector-pipe µop beside every four bfdots, 69-74 % of their peak
    by llvm-mca), in the kernel's products and a layer's projections."""
    for spec in (AttentionSpec(**{**SMALL, **BF16, "seq_len": 32}), AttentionSpec(**{**BF16, "seq_len": 64,
                                                                                      "num_heads": 2, "d_model": 64})):
        asm = tvmattn.compile(spec, "aarch64", mcpu="neoverse-v2", tuned=False).source()
        assert len(re.findall(r"\tbfdot\tv\d+\.4s, v\d+\.8h, v\d+\.2h\[0\]", asm)) >= 16
        assert "\tld1r\t" not in asm


@pytest.mark.parametrize("mcpu,bfdot", [("neoverse-v2", r"\tbfdot\tv\d+\.4s"), ("neoverse-v1", r"\tbfdot\tz\d+\.s")])
def test_bf16_runs_on_bfdot_where_the_cpu_has_it(mcpu, bfdot):
    """NEON's bfdot on 128-bit CPUs, SVE's on z-registers at 256 bits (Neoverse V1), not widened to fp32 FMAs."""
    spec = AttentionSpec(**{**SMALL, **BF16, "seq_len": 32})
    kernel = tvmattn.compile(spec, "aarch64", mcpu=mcpu, tuned=False)
    assert "QKᵀ and P·V on bf16 dot products (bfdot)" in kernel.schedule
    assert len(re.findall(bfdot, kernel.source())) >= 16
    assert "bfdot" not in tvmattn.compile(spec, "aarch64", mcpu="cortex-a76", tuned=False).source()  # no FEAT_BF16


@needs_tools
@pytest.mark.parametrize("mcpu", ["neoverse-v2", "neoverse-v1"])
def test_emulated_bf16_activation_products(mcpu, tmp_path):
    """A bf16 import's activation × activation product (`matmul_bf16`: B's pairs of rows interleaved in
    the kernel) on NEON's and SVE's bfdot, under qemu, against float64 (exact bf16 products)."""
    import ml_dtypes
    import tvm
    from test_onnx_bf16 import bf16_products, i64, schedule

    from tvmattn.compiler import build
    from tvmattn.compiler.cross import emulate

    target = resolve_target("aarch64", None, mcpu)
    rule, mod = schedule(bf16_products(3, i64(48), 64, 80), target)
    assert rule == "matmul-bf16"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 48, 64)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((3, 64, 80)).astype(ml_dtypes.bfloat16)
    out = np.zeros((3, 48, 80), np.float32)
    harness = emulate.build_harness(tvm.compile(mod, target, tir_pipeline=build.CPU_PIPELINE), target, tmp_path)
    emulate.run(harness, target, [x, b], out)
    want = x.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()


def test_cpu_names_choose_records():
    assert [isa_of(resolve_target(a, mcpu=m)).name for a, m in
            [("aarch64", None), ("aarch64", "neoverse-v1"), ("aarch64", "neoverse-v2"), ("aarch64", "apple-m2"),
             ("riscv64", None), ("riscv64", "spacemit-x60")]] == ["neon", "sve256-bf16", "neon-bf16", "neon-bf16",
                                                                  "rvv128", "rvv256"]
    assert cpus.CPUS["neoverse-v1"].qemu_cpu() == "max,sve256=on"
    assert "vlen=256" in cpus.CPUS["spacemit-x60"].qemu_cpu()


def test_unknown_cpu_is_one_line_listing_the_known():
    with pytest.raises(tvmattn.TvmAttnError, match=r"unknown aarch64 CPU 'm9': use one of aarch64, .*neoverse-v1"):
        tvmattn.compile(AttentionSpec(**SMALL), "aarch64", mcpu="m9")
    with pytest.raises(tvmattn.TvmAttnError, match="--mcpu neoverse-v1 names a CPU of aarch64 or riscv64"):
        tvmattn.compile(AttentionSpec(**SMALL), "cpu", mcpu="neoverse-v1")


@needs_tools
def test_emulated_call_says_so_once(caplog):
    kernel = tvmattn.compile(AttentionSpec(**{**SMALL, "num_heads": 3}), "riscv64", tuned=False)
    with caplog.at_level(logging.WARNING, logger="tvmattn.cross"):
        check(kernel)
        check(kernel, seed=1)
    assert sum("qemu-user emulation" in r.message for r in caplog.records) == 1


@needs_tools
def test_emulated_kernel_runs_from_threads():
    """First calls from three threads at once: the harness is built once (TVM's export of one executable
    from two threads at once aborted the process), each call its own emulated process."""
    kernel = tvmattn.compile(AttentionSpec(**{**SMALL, "num_heads": 5}), "aarch64", tuned=False)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert all(r.ok for r in pool.map(lambda seed: check(kernel, seed=seed), range(3)))


@needs_tools
def test_export_library_is_the_targets_elf(tmp_path):
    kernel = tvmattn.compile(AttentionSpec(**SMALL), "aarch64", mcpu="neoverse-v1", tuned=False)
    kernel.export_library(str(tmp_path / "attention.so"))
    header = (tmp_path / "attention.so").read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64


def test_missing_tools_are_one_line_naming_the_package(tmp_path, monkeypatch):
    kernel = tvmattn.compile(AttentionSpec(**SMALL), "riscv64", tuned=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(tvmattn.TvmAttnError, match=r"riscv64-linux-gnu-gcc not found on PATH: .*"
                                                   r"apt-get install gcc-riscv64-linux-gnu"):
        kernel.export_library(str(tmp_path / "attention.so"))
    gcc = shutil.which(GCC["riscv64"][0], path=os.defpath + ":/usr/bin")
    if gcc is None:
        pytest.skip("no riscv64 cross gcc to link the harness with")
    os.symlink(gcc, tmp_path / GCC["riscv64"][0])
    with pytest.raises(tvmattn.TvmAttnError, match=r"qemu-riscv64-static not found on PATH: .*"
                                                   r"apt-get install qemu-user-static"):
        check(kernel)


@needs_tools
def test_imported_model_is_a_library_for_that_cpu(tmp_path):
    """A whole model for aarch64: an aarch64 ELF, for TVM's runtime there (run here: `test_cross_models`)."""
    model, _ = export_onnx(AttentionSpec(batch=1, seq_len=16, num_heads=2, d_model=64), 23, 0)
    imported = tvmattn.import_onnx(model, "aarch64", mcpu="neoverse-v2")
    imported.export_library(str(tmp_path / "model.so"))
    header = (tmp_path / "model.so").read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64


@needs_tools
@pytest.mark.parametrize("arch,mcpu,machine", [("aarch64", "neoverse-v2", 183), ("riscv64", "spacemit-x60", 243)])
def test_tuning_candidates_for_another_cpu_are_cross_linked(arch, mcpu, machine):
    """What `tvmattn tune --target aarch64 --rpc …` uploads to the servers: the candidate built and linked
    here by the CPU's cross gcc (an ELF shared library of its machine: e_machine 183 AArch64, 243 RISC-V)."""
    spec, target = AttentionSpec(**SMALL), resolve_target(arch, None, mcpu)
    func = space.workload(spec, target)
    mod = space.candidate(func, spec, target, schedules.default_knobs(spec, target)).mod
    path = measure.export_shared_library(measure.build_candidate(mod, target, None))
    header = open(path, "rb").read(20)
    assert header[:4] == b"\x7fELF" and header[16] == 3 and int.from_bytes(header[18:20], "little") == machine


def test_tuning_another_cpu_measures_there_over_rpc(tmp_path, capsys):
    """Emulation times nothing: without --rpc, one line saying how to measure on that CPU."""
    with pytest.raises(tvmattn.TvmAttnError, match=r"measure there over RPC \(--rpc HOST:PORT --device-key KEY"):
        tune(AttentionSpec(**SMALL), resolve_target("aarch64", None, "neoverse-v2"), trials=2, log_dir=tmp_path)
    assert main(["tune", "--target", "aarch64", "--mcpu", "neoverse-v2", "--seq", "24", "--trials", "2",
                 "--log-dir", str(tmp_path)]) != 0
    assert "--rpc HOST:PORT --device-key KEY" in capsys.readouterr().err
