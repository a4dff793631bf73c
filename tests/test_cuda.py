"""CUDA kernels without a GPU: the online-softmax template's numerics on the CPU (against the float64
oracle, over the foundation's sweep), and the scheduled CUDA kernels compiled for sm_80/sm_89/sm_90:
nvcc and ptxas accept them, no register spills, shared memory within the per-block limit, TVM's GPU
code verifier passes, and no n × n_kv buffer in global memory. Tests that launch kernels need a GPU.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi
from helpers import assert_matches_oracle, every_other_slow, serial
from hypothesis import given, settings
from strategies import cases, specs, tiles
from tvm.s_tir import SBlock, dlight

import tvmattn
from tvmattn import AttentionSpec, TvmAttnError
from tvmattn.compiler import build
from tvmattn.compiler.cuda import tools as cuda_tools
from tvmattn.compiler.flash import FlashTiles
from tvmattn.compiler.target import resolve_target
from tvmattn.compiler.te_attention import attention_te
from tvmattn.compiler.tuning import measure, space
from tvmattn.compiler.tuning.tuner import tune
from tvmattn.models.presets import PRESETS
from tvmattn.schedules.cuda import schedule_paged as cuda_schedule_paged

ROOT = Path(__file__).resolve().parents[1]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
needs_gpu = pytest.mark.skipif(not tvm.cuda(0).exist, reason="no CUDA device")


def core(**fields) -> AttentionSpec:
    return AttentionSpec(**{"batch": 1, "projections": False, **fields})


# ---- the template's numerics, run serially on the CPU ------------------------------------------------
# The same strategy as the CPU schedule's sweep (`test_attention_cpu`); the template returns the attention.

@settings(max_examples=6)  # (-m slow: 150 wider cases, below)
@given(cases(intermediate=False), tiles())
def test_template_matches_oracle(case, tiling):
    spec, sizes = case
    assert_matches_oracle(serial(spec, tiling), sizes)


@settings(max_examples=6)
@given(cases(dtype=("float16", "bfloat16"), intermediate=False), tiles())
def test_template_matches_oracle_half(case, tiling):
    spec, sizes = case
    assert_matches_oracle(serial(spec, tiling), sizes)


@pytest.mark.slow
@settings(max_examples=150)
@given(cases(intermediate=False, max_len=130, max_heads=8, max_head_dim=64),
       tiles(q_rows=(1, 16, 32, 64), kv_tile=(8, 16, 64), kv_splits=(1, 2, 3)))
def test_template_matches_oracle_wide(case, tiling):
    spec, sizes = case
    assert_matches_oracle(serial(spec, tiling), sizes)


@settings(max_examples=4)
@given(specs(symbolic=True, intermediate=False), tiles())
def test_template_serves_every_length(spec, tiling):
    kernel = serial(spec, tiling)
    for n in (1, 33, 100):
        assert_matches_oracle(kernel, {name: 2 if name == "B" else n + 5 * i
                                       for i, name in enumerate(spec.symbolic_dims)})


@pytest.mark.parametrize("fields", [
    {"attn_mask": "bool", "attn_mask_dims": "bhst"},
    {"attn_mask": "additive", "attn_mask_dims": "st", "softcap": 5.0},
    {"softcap": 2.0, "causal": True},
    {"sinks": True, "causal": True, "window": 20},
    {"alibi": "signed", "causal": True, "sinks": True, "softcap": 5.0},
    {"alibi": "symmetric", "key_padding": True, "causal_align": "bottom_right"},
], ids=["bool-mask", "additive-mask-softcap", "softcap-causal", "sinks-window", "alibi-sinks-softcap",
        "alibi-symmetric-padded"])
def test_template_with_onnx_masks(fields):
    spec = core(seq_len=45, kv_seq_len=70, num_heads=4, num_kv_heads=2, head_dim=16, **fields)
    assert_matches_oracle(serial(spec, FlashTiles(16, 32, 2)))


def test_template_rows_that_see_no_key_are_zero():
    spec = core(seq_len=20, kv_seq_len=30, num_heads=2, head_dim=8, key_padding=True)
    kernel = serial(spec, FlashTiles(16, 16, 2))
    q, k, v = (np.ones(shape, np.float32) for shape in list(spec.input_shapes().values())[:3])
    out = kernel(q, k, v, kv_lens=np.zeros(1, np.int32))
    assert np.all(out == 0)


# ---- CUDA kernels, compiled with nvcc -----------------------------------------------------------------

# (name, spec): every schedule kind — tensor cores (fp16/bf16), CUDA cores (fp32), split-K decode,
# GQA, cross-attention, both layouts, symbolic lengths, padding, windows and the full layer.
CONFIGS = {
    "gpt2-core-fp16-causal": core(seq_len=1024, num_heads=12, head_dim=64, causal=True, dtype="float16"),
    "d128-bf16-bshd": core(seq_len=2048, num_heads=8, head_dim=128, layout="BSHD", dtype="bfloat16"),
    "fp32-d64": core(seq_len=512, num_heads=8, head_dim=64),
    "gqa-fp16-window": core(seq_len=1024, num_heads=32, num_kv_heads=8, head_dim=128, causal=True,
                            window=256, dtype="float16"),
    "cross-symbolic-fp16": core(seq_len="n", kv_seq_len="n_kv", num_heads=8, head_dim=64, dtype="float16"),
    "padded-fp16": core(seq_len=300, num_heads=4, head_dim=64, key_padding=True, dtype="float16"),
    "gpt-oss-sinks-bf16-window": core(seq_len=1024, num_heads=16, num_kv_heads=2, head_dim=64, causal=True,
                                      window=128, dtype="bfloat16", sinks=True),
    "decode-4k": PRESETS["decode-4k"],
    "gpt2-small-layer": PRESETS["gpt2-small"],
    "bloom-alibi-fp16": core(seq_len=1024, num_heads=16, head_dim=64, causal=True, dtype="float16", alibi="signed"),
    "alibi-decode": core(batch=2, seq_len=1, kv_seq_len=4096, num_heads=32, head_dim=128, causal=True,
                         causal_align="bottom_right", alibi="symmetric"),
}
ARCHS = ("sm_80", "sm_90")


def scheduled(spec: AttentionSpec, arch: str) -> tuple[tvm.IRModule, tvm.target.Target]:
    target = resolve_target("cuda", arch)
    return build.schedule_attention(spec, target, tuned=False)[0], target


def quadratic_buffers(spec: AttentionSpec, fallback: bool = False) -> list[str]:
    """Global buffers whose size grows with n·n_kv: ``spec`` with symbolic lengths, lowered for sm_90
    (``fallback``: the tensor expression under dlight's fallback rules instead of tvmattn's schedule),
    each allocation sized at lengths 1024 and 2048 (4× the elements: quadratic)."""
    symbolic = spec.replace(seq_len="n" if spec.n_q != 1 else 1, kv_seq_len="n_kv")
    if fallback:
        target = resolve_target("cuda", "sm_90")
        with target:
            mod = dlight.gpu.Fallback().apply(attention_te(symbolic).prim_func(), target, False).mod
    else:
        mod, target = scheduled(symbolic, "sm_90")

    def elements(expr, length: int) -> int:
        analyzer = tvm.sym.Analyzer()
        for var in tvm.tirx.analysis.undefined_vars(expr):
            analyzer.bind(var, tvm.tirx.const(length, var.ty.dtype))
        return int(analyzer.simplify(expr))

    return [name for name, size in cuda_tools.global_allocations(build.lower(mod, target))
            if elements(size, 2048) > 2 * elements(size, 1024)]


QUICK_CONFIGS = ("gpt2-core-fp16-causal", "decode-4k", "gpt2-small-layer", "padded-fp16")  # -m slow: all
# (ptxas takes 12-40 s over gpt2-core-fp16-causal on 2 cores, 20x the others, ~50 s over BLOOM's fp16 for sm_80,
# 16-44 s for sm_90, and 12-19 s alone, 51 s beside another worker, over padded-fp16 for sm_80 (measured
# 2026-12-08): those builds run under -m slow; padded-fp16 for sm_90 (1.3 s) covers fp16 in the default run,
# gpt2-small-layer and decode-4k both architectures)
SLOW_BUILDS = {("gpt2-core-fp16-causal", "sm_80"), ("gpt2-core-fp16-causal", "sm_90"), ("bloom-alibi-fp16", "sm_80"),
               ("padded-fp16", "sm_80")}


@needs_nvcc
@pytest.mark.parametrize("name,arch", [
    pytest.param(n, arch, id=f"{n}-{arch}",
                 marks=[] if n in QUICK_CONFIGS and (n, arch) not in SLOW_BUILDS else [pytest.mark.slow])
    for n in CONFIGS for arch in ARCHS])
def test_default_kernels_compile_without_spills_within_shared_memory(name, arch):
    spec = CONFIGS[name]
    mod, target = scheduled(spec, arch)
    resources = cuda_tools.kernel_resources(mod, target)
    assert resources, "ptxas reported no kernel"
    limit = cuda_tools.SHARED_MEMORY_PER_BLOCK[arch]
    for r in resources:
        assert r.spill_bytes == 0, r.line()
        assert r.total_shared_bytes <= limit, f"{r.line()}: over {limit} B"
    assert cuda_tools.verify_kernels(build.lower(mod, target), arch) == []


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", [
    tvmattn.PagedSpec(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="float16", causal=True),
    tvmattn.PagedSpec(num_heads=8, head_dim=64, page_size=32, kv_layout="HND", q_len=2, dtype="bfloat16",
                      causal=True, alibi="symmetric"),
], ids=["fp16-nhd-gqa", "bf16-hnd-2q-alibi"])
def test_paged_kernels_compile_within_shared_memory(spec, arch):
    """The paged cache's CUDA kernel (the template reading K/V through the block table; its numerics:
    tests/test_paged.py): nvcc and ptxas take it, shared memory within the limit, the GPU verifier passes,
    no spills on sm_80 (sm_90's ptxas spills 8-12 bytes of the page arithmetic on some)."""
    target = resolve_target("cuda", arch)
    mod, _ = cuda_schedule_paged(spec, target)
    resources = cuda_tools.kernel_resources(mod, target)
    assert resources, "ptxas reported no kernel"
    for r in resources:
        assert r.total_shared_bytes <= cuda_tools.SHARED_MEMORY_PER_BLOCK[arch], r.line()
        assert r.spill_bytes == 0 or arch != "sm_80", r.line()
    assert cuda_tools.verify_kernels(build.lower(mod, target), arch) == []


def test_ragged_paged_queries_have_no_cuda_kernel():
    with pytest.raises(TvmAttnError, match="CUDA one for a fixed q_len"):
        tvmattn.compile(tvmattn.PagedSpec(num_heads=4, head_dim=32, q_len=None), "cuda", arch="sm_90")


@pytest.mark.parametrize("name", every_other_slow(CONFIGS))
def test_no_score_matrix_in_global_memory(name):
    assert quadratic_buffers(CONFIGS[name]) == []


@needs_nvcc
@pytest.mark.parametrize("spec", [CONFIGS["d128-bf16-bshd"], CONFIGS["gqa-fp16-window"]], ids=["bf16", "gqa"])
def test_sm89_defaults_fit_its_smaller_shared_memory(spec):
    mod, target = scheduled(spec, "sm_89")
    for r in cuda_tools.kernel_resources(mod, target):
        assert r.spill_bytes == 0 and r.total_shared_bytes <= cuda_tools.SHARED_MEMORY_PER_BLOCK["sm_89"], r.line()


def test_fallback_materialises_the_scores_and_the_check_sees_it():
    """The check above can fail: TVM's default GPU rules keep the score matrix in global memory."""
    assert quadratic_buffers(core(seq_len=256, num_heads=2, head_dim=64), fallback=True)


@pytest.mark.parametrize("name, tensor_cores, split_k, projections", [
    ("gpt2-core-fp16-causal", True, False, False),
    ("fp32-d64", False, False, False),
    ("decode-4k", False, True, False),
    ("gpt2-small-layer", False, False, True),
])
def test_schedule_kinds_follow_the_spec(name, tensor_cores, split_k, projections):
    """fp16 prefill on wmma tensor cores, fp32 on CUDA cores, one query over many keys split-K (with a
    combine of the splits), and a layer's projections as GEMMs staged through shared memory (dlight)."""
    mod, _ = scheduled(CONFIGS[name], "sm_90")
    blocks = set()
    tvm_ffi.structural_walk(mod["main"].body, [(SBlock, lambda b: blocks.add(b.name_hint))])
    assert ("mma_sync" in mod.script()) == tensor_cores
    assert ("split_combine" in blocks) == split_k
    assert ("x_reindex_shared" in blocks) == projections


def test_wmma_uses_async_copies_and_tensor_core_instructions():
    mod, target = scheduled(CONFIGS["gpt2-core-fp16-causal"], "sm_80")
    source = next(m.inspect_source() for m in build.tvm_compile(mod, target).mod.imports if m.kind == "cuda")
    assert "wmma::mma_sync" in source and "cp.async" in source
    assert "exp2" in source  # log2(e) folded into the scale


@pytest.mark.parametrize("knobs, message", [
    ({"q_rows": 16, "warps": 8, "kv_splits": 1}, "cannot be shared"),
    ({"stages": 2}, "stages=1"),
])
def test_bad_knobs_say_what_to_change(knobs, message):
    spec = core(seq_len=64, num_heads=2, head_dim=8, key_padding=bool("stages" in knobs))
    with pytest.raises(TvmAttnError, match=message):
        tvmattn.compile(spec, "cuda", knobs=knobs)


@pytest.mark.slow  # 22 s of nvcc; the default run compiles the QUICK_CONFIGS kernels with it
@needs_nvcc
def test_cli_writes_source_ptx_cubin_and_the_ptxas_report(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tvmattn.compiler.cli", "compile", "--preset", "gpt2-small",
                          "--seq", "256", "--no-projections", "--dtype", "float16", "--target", "cuda",
                          "--arch", "sm_80", "-o", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "0 B spilled" in out.stdout
    for suffix in ("cu", "ptx", "cubin"):
        assert (tmp_path / f"attention.{suffix}").stat().st_size > 0
    assert "wmma::mma_sync" in (tmp_path / "attention.cu").read_text()  # fp16: tensor cores


def test_tuning_candidates_build_for_cuda():
    """What `tvmattn tune --target cuda` measures on a GPU: knob points, including those that shape the
    template, scheduled as the search does and built by the tuner's build function."""
    spec = core(seq_len=200, num_heads=4, head_dim=64, causal=True, dtype="float16")
    target = resolve_target("cuda", "sm_80")
    func = space.workload(spec, target)
    # (q_rows, kv_tile, kv_splits, warps, stages), and whether wmma applies: 16 rows is the decode variant
    for (q_rows, kv_tile, kv_splits, warps, stages), wmma in (((32, 32, 1, 2, 2), True), ((64, 64, 1, 4, 1), True),
                                                              ((16, 16, 4, 1, 2), False)):
        values = dict(q_rows=q_rows, kv_tile=kv_tile, kv_splits=kv_splits, warps=warps, stages=stages)
        mod = space.candidate(func, spec, target, values).mod
        source = next(m.inspect_source() for m in measure.build_candidate(mod, target, None).mod.imports
                      if m.kind == "cuda")
        assert ("wmma::mma_sync" in source) == wmma, values
    (sampled,) = space.design_space(spec, target).generate_design_space(tvm.IRModule({"main": func}))
    assert sampled.get_sblock("flash") is not None  # MetaSchedule's design space schedules the template


def test_tuning_for_cuda_without_a_gpu_says_where_to_run(tmp_path):
    if tvm.cuda(0).exist:
        pytest.skip("this machine has a GPU")
    with pytest.raises(TvmAttnError, match="measures on a GPU"):
        tune(core(seq_len=64, num_heads=2, head_dim=16), "cuda", trials=2, log_dir=tmp_path)


# ---- on a GPU --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_kernels_on_the_gpu_match_the_oracle(name):
    spec = CONFIGS[name]
    kernel = tvmattn.compile(spec, "cuda", arch=f"sm_{tvm.cuda(0).compute_version.replace('.', '')}")
    assert_matches_oracle(kernel, {dim: 300 for dim in spec.symbolic_dims})


@pytest.mark.slow  # 12 s: it compiles every check the GPU run makes
def test_gpu_check_script_dry_run():
    """The prepared GPU check runs end to end on the CPU (LLVM kernels, tiny shapes)."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TFLOP/s" in out.stdout and "PASS" in out.stdout and "FAIL" not in out.stdout
