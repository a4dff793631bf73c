"""The host target: LLVM's name for the CPU corrected by the features the CPU reports."""

import platform

import pytest

from tvmattn.compiler.target import (
    CPUINFO_FEATURES,
    has_feature,
    host_target,
    isa_of,
    mattr_for,
    resolve_target,
    target_key,
    vector_lanes,
)

# /proc/cpuinfo's flags in a KVM guest on Sapphire Rapids, which reports CPU model 167: LLVM names it
# "rocketlake" (no AVX512-BF16, AVX512-FP16, AMX)
SPR_GUEST = set("""fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2
ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni
pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand
hypervisor lahf_lm abm 3dnowprefetch cpuid_fault fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm
avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec
xgetbv1 xsaves avx_vnni avx512_bf16 arat avx512vbmi umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni
avx512_bitalg avx512_vpopcntdq rdpid cldemote movdiri movdir64b fsrm serialize tsxldtrk amx_bf16 avx512_fp16
amx_tile amx_int8 arch_capabilities""".split())


def test_a_cpu_named_older_than_it_is_gets_its_features():
    assert mattr_for("rocketlake", SPR_GUEST) == ("+amx-bf16", "+amx-int8", "+amx-tile", "+avx512bf16",
                                                  "+avx512fp16", "+avxvnni")
    assert mattr_for("sapphirerapids", SPR_GUEST) == ()


def test_features_a_vm_hides_are_turned_off():
    """A guest that reports a Skylake-X model but hides AVX-512 must not get AVX-512 code (SIGILL)."""
    flags = {f for f in SPR_GUEST if not f.startswith("avx512") and not f.startswith("amx")}
    mattr = mattr_for("skylake-avx512", flags)
    assert [f for f in mattr if f.startswith("-")] == ["-avx512bw", "-avx512cd", "-avx512dq", "-avx512f", "-avx512vl"]
    assert vector_lanes(resolve_target({"kind": "llvm", "mcpu": "skylake-avx512", "mattr": list(mattr)})) == 8


@pytest.mark.parametrize("mcpu,mattr,record,lanes,registers,full_width", [
    ("znver3", [], "avx2", 8, 16, False),
    ("skylake-avx512", [], "avx512", 16, 32, False),
    ("znver4", [], "avx512-bf16", 16, 32, False),
    ("sapphirerapids", [], "amx", 16, 32, False),
    ("sapphirerapids", ["-amx-tile", "-amx-bf16"], "avx512-bf16", 16, 32, False),
    ("znver5", [], "avx512-bf16", 16, 32, True),  # full-width AVX-512 FMAs
    ("x86-64", [], "generic", 4, 16, False),
])
def test_each_cpu_takes_the_record_of_its_instruction_set(mcpu, mattr, record, lanes, registers, full_width):
    """One record per instruction set, chosen from the target's features: its lanes and registers
    size the register tiles, its dot product and tiles are the 16-bit products the kernels may use."""
    isa = isa_of(resolve_target({"kind": "llvm", "mcpu": mcpu, "mattr": mattr}))
    assert (isa.name, isa.lanes, isa.registers, isa.full_width) == (record, lanes, registers, full_width)
    assert (isa.dot is not None, isa.tiles is not None) == (record in ("avx512-bf16", "amx"), record == "amx")
    assert (isa.exp2 is not None) == (isa.bits == 512)
    assert isa_of(resolve_target("cuda")) is None


def test_tuning_records_are_keyed_by_the_corrected_target():
    plain = resolve_target({"kind": "llvm", "mcpu": "rocketlake"})
    corrected = resolve_target({"kind": "llvm", "mcpu": "rocketlake", "mattr": ["+avx512bf16"]})
    assert target_key(plain) == "llvm-rocketlake"
    assert target_key(corrected) == "llvm-rocketlake+avx512bf16"


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="reads /proc/cpuinfo")
def test_the_host_target_has_exactly_the_features_this_cpu_reports():
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    target = host_target()
    for name, feature in CPUINFO_FEATURES.items():
        if not feature.startswith("amx"):  # (AMX also needs the OS's permission)
            assert has_feature(target, feature) == (name in flags), feature
