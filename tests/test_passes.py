"""tvmattn's TIR passes: masked key tiles are skipped (loops tightened), exp and exp2 are vectorisable polynomials."""

import math
import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from helpers import assert_matches_oracle, compiled

from tvmattn import AttentionSpec, schedules
from tvmattn.compiler import passes
from tvmattn.compiler.build import lower, schedule_attention, tvm_compile
from tvmattn.compiler.target import has_feature, resolve_target, vector_lanes

CPU = resolve_target("cpu")


def _scheduled(spec):
    sch, _ = schedules.schedule(spec, CPU)
    return sch.mod


def _loop_extents(mod):
    found = []
    tvm_ffi.structural_walk(mod["main"].body, [(tvm.tirx.For, lambda f: found.append(f.extent))])
    return found


def test_causal_key_loops_depend_on_the_query_tile():
    spec = AttentionSpec(seq_len=64, num_heads=1, head_dim=16, causal=True, projections=False)
    before = _scheduled(spec)
    after = passes.skip_masked_key_tiles(spec)(before)
    constant = lambda es: sum(isinstance(e, tvm.tirx.IntImm) for e in es)  # noqa: E731
    # every key loop (scores with row_max, probs with row_sum, pv) became an expression of the query tile
    assert constant(_loop_extents(after)) <= constant(_loop_extents(before)) - 3
    assert "T.min" in after.script()


def test_no_mask_no_change():
    spec = AttentionSpec(seq_len=32, num_heads=1, head_dim=16, projections=False)
    mod = _scheduled(spec)
    tvm.ir.assert_structural_equal(passes.skip_masked_key_tiles(spec)(mod), mod)


def test_symbolic_key_length_is_guarded_not_resized():
    spec = AttentionSpec(seq_len="n", num_heads=1, head_dim=16, causal=True, projections=False)
    after = passes.skip_masked_key_tiles(spec)(_scheduled(spec))
    assert "sees_keys" in after.script()


def test_tile_buffers_never_hold_the_score_matrix():
    """Per task the scores live in a q_tile × n_kv tile, not the n × n_kv matrix (4 MiB here)."""
    spec = AttentionSpec(seq_len=1024, num_heads=2, head_dim=64, causal=True, projections=False)
    mod, _ = schedule_attention(spec, CPU)
    lowered = lower(mod, CPU).script()
    sizes = [int(line.split("((")[1].split(",")[0].rstrip(")"))
             for line in lowered.splitlines() if "T.alloc_buffer((" in line]
    assert sizes and max(sizes) <= 64 * 1024  # a tile of at most 64 queries × 1024 keys
    assert max(sizes) < 1024 * 1024


def test_polynomial_exp_accuracy():
    x = tvm.te.placeholder((4096,), "float32", "x")
    y = tvm.te.compute(x.shape, lambda i: tvm.tirx.exp(x[i]), name="y")
    mod = passes.polynomial_math()(tvm.IRModule({"main": tvm.te.create_prim_func([x, y])}))
    assert "T.exp(" not in mod.script()
    f = tvm.compile(mod, CPU)
    xs = np.linspace(-87, 0, 4096).astype(np.float32)
    out = tvm.runtime.empty((4096,), "float32", tvm.cpu())
    f(tvm.runtime.tensor(xs), out)
    exact = np.exp(xs.astype(np.float64))
    assert (np.abs(out.numpy() - exact) / exact).max() < 1e-6


def test_polynomial_log_keeps_relative_position_buckets():
    """T5's and DeBERTa's relative-position buckets truncate or round up a ratio of logs: one ulp off at
    a boundary moves a position to the next bucket. The polynomial log must give the buckets the
    correctly rounded fp32 log gives, at every distance up to 8192."""
    ratios = np.concatenate([np.arange(1, 8193, dtype=np.float32) / np.float32(mid) for mid in (8, 16, 64, 128, 256)])
    x = tvm.te.placeholder((len(ratios),), "float32", "x")
    y = tvm.te.compute(x.shape, lambda i: tvm.tirx.log(x[i]), name="y")
    mod = passes.polynomial_math()(tvm.IRModule({"main": tvm.te.create_prim_func([x, y])}))
    assert "T.log(" not in mod.script()
    out = tvm.runtime.empty((len(ratios),), "float32", tvm.cpu())
    tvm.compile(mod, CPU)(tvm.runtime.tensor(ratios), out)
    exact = np.log(ratios.astype(np.float64)).astype(np.float32)
    assert (np.abs(out.numpy() - exact) <= np.spacing(np.abs(exact))).all()  # within an ulp of it
    t5 = lambda log: (log / np.float32(math.log(16)) * np.float32(8)).astype(np.int64)  # noqa: E731 (max 128, 8 exact)
    deberta = lambda log: np.ceil(log / np.float32(math.log(511 / 128)) * np.float32(127))  # noqa: E731 (256 buckets)
    for buckets in (t5, deberta):
        assert np.array_equal(buckets(out.numpy()), buckets(exact))


def test_erf_of_a_quotient_multiplies_and_other_quotients_divide():
    """GELU's erf(x / √2) multiplies x by 1/√2 (within an ulp: erf stays within 4e-7 of float64), and a
    quotient outside erf stays a division, exactly fp32's: T5's position buckets truncate log(r) / log(16)
    · 8, and r = 16 must give 8, not 7 (one ulp under 1 would)."""
    x = tvm.te.placeholder((4096,), "float32", "x")
    root2, log16 = np.float32(1.4142135381698608), np.float32(math.log(16))
    y = tvm.te.compute(x.shape, lambda i: tvm.tirx.erf(x[i] / tvm.tirx.const(float(root2), "float32")), name="y")
    w = tvm.te.compute(x.shape, lambda i: tvm.tirx.log(x[i]), name="w")
    z = tvm.te.compute(x.shape, lambda i: tvm.tirx.log(x[i]) / tvm.tirx.const(float(log16), "float32"), name="z")
    mod = passes.polynomial_math()(tvm.IRModule({"main": tvm.te.create_prim_func([x, y, w, z])}))
    xs = np.concatenate([np.linspace(-6, 6, 4000), 2.0 ** np.arange(1, 97) / 2 ** 48]).astype(np.float32)
    out = [tvm.runtime.empty((4096,), "float32", tvm.cpu()) for _ in range(3)]
    tvm.compile(mod, CPU)(tvm.runtime.tensor(xs), *out)
    erf, logs, quotients = (o.numpy() for o in out)
    assert np.abs(erf - np.vectorize(math.erf)(xs.astype(np.float64) / np.float64(root2))).max() < 4e-7
    positive = xs > 0
    assert np.array_equal(quotients[positive], logs[positive] / log16)  # fp32's division, bit for bit
    assert (quotients[xs == 16] * np.float32(8)).astype(np.int64).tolist() == [8]


AVX512 = resolve_target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
AVX2 = resolve_target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
EXP2_SPECIAL = np.array([-np.inf, np.inf, np.nan, -1e30, 1e30, -200.0, 200.0, 0.0], np.float32)
MATHS = {"exp": (tvm.tirx.exp, np.exp), "log": (tvm.tirx.log, np.log), "tanh": (tvm.tirx.tanh, np.tanh),
         "sigmoid": (tvm.tirx.sigmoid, lambda v: 1 / (1 + np.exp(-v))), "erf": (tvm.tirx.erf, np.vectorize(math.erf))}


@pytest.mark.parametrize("name", list(MATHS))
def test_polynomial_math_keeps_the_vector_width(name):
    """A loop vectorised by 16 stays 16 lanes wide through `polynomial_math` (a NaN test TVM cannot
    vectorise would run it lane by lane, and LLVM would re-vectorise it by 8 on a CPU preferring 256-bit
    vectors), and keeps NaN, ±inf and the function's values (float64 NumPy, 2e-6)."""
    tir_fn, np_fn = MATHS[name]
    x = tvm.te.placeholder((1024,), "float32", "x")
    y = tvm.te.compute(x.shape, lambda i: tir_fn(x[i]), name="y")
    sch = tvm.s_tir.Schedule(tvm.te.create_prim_func([x, y]))
    sch.vectorize(sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 16])[1])
    lib = tvm_compile(passes.polynomial_math()(sch.mod), AVX512)
    ll = lib.mod.inspect_source("ll")
    assert "<16 x float>" in ll and "<8 x float>" not in ll and "<4 x float>" not in ll
    if not has_feature(CPU, "avx512f"):
        pytest.skip("this CPU cannot run AVX-512")
    xs = np.linspace(0.01 if name == "log" else -12, 12, 1024).astype(np.float32)
    xs[:3] = np.nan, np.inf, 0.5 if name == "log" else -np.inf
    out = tvm.runtime.empty((1024,), "float32", tvm.cpu())
    lib["main"](tvm.runtime.tensor(xs), out)
    with np.errstate(over="ignore"):
        want = np_fn(xs.astype(np.float64))
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("target", [AVX512, AVX2], ids=["avx512", "avx2"])
@pytest.mark.parametrize("lanes", [16, 8, 1])
@pytest.mark.parametrize("coefficients,limit", [(passes.EXP2_P, 5e-7), (passes.EXP2_P_BF16, 1e-4)])  # bf16
def test_exp2_accuracy(target, lanes, coefficients, limit):  # kernels: under bf16's rounding (2e-3)
    """`passes.vector_exp2` through the CPU pipeline, on vectors of ``lanes`` (16 with AVX-512: the
    vreduceps/vscalefps form, its instructions in the assembly; else the polynomial with a clamp and a
    NaN select): the relative error over [-126, 126], and -inf → 0, +inf → +inf, NaN → NaN, huge
    arguments to 0 and +inf."""
    n = 4096
    x = tvm.te.placeholder((n,), "float32", "x")
    y = tvm.te.compute(x.shape, lambda i: tvm.tirx.exp2(x[i]), name="y")
    sch = tvm.s_tir.Schedule(tvm.te.create_prim_func([x, y]))
    if lanes > 1:
        sch.vectorize(sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, lanes])[1])
    mod = passes.polynomial_math(coefficients)(sch.mod)
    lib = tvm_compile(mod, target)
    assert ("vscalefps" in lib.mod.inspect_source("asm")) == (target is AVX512 and lanes == 16)
    if not has_feature(CPU, "avx512f" if target is AVX512 else "avx2"):
        pytest.skip(f"this CPU cannot run {target}")
    xs = np.linspace(-126, 126, n).astype(np.float32)
    xs[:len(EXP2_SPECIAL)] = EXP2_SPECIAL
    out = tvm.runtime.empty((n,), "float32", tvm.cpu())
    lib["main"](tvm.runtime.tensor(xs), out)
    got = out.numpy()
    special = got[:len(EXP2_SPECIAL)]
    np.testing.assert_array_equal(special[[0, 1, 3, 4, 5, 6]], [0, np.inf, 0, np.inf, 0, np.inf])
    assert np.isnan(special[2]) and abs(special[7] - 1) < limit
    exact = np.exp2(xs[len(EXP2_SPECIAL):].astype(np.float64))
    assert (np.abs(got[len(EXP2_SPECIAL):] - exact) / exact).max() < limit


@pytest.mark.parametrize("field", [dict(causal=True), dict(window=5), dict(key_padding=True)])
def test_skipping_keeps_results(field):
    """Each mask kind with the pass on equals the oracle (the pass is on in every build)."""
    spec = AttentionSpec(batch=2, seq_len=77, num_heads=2, head_dim=16, projections=False, **field)
    assert_matches_oracle(compiled(spec))


# ---- symbolic lengths: tails padded or peeled, guards tightened after compaction -----------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv", [None, "m"])
def test_symbolic_kernel_matches_oracle_at_tail_lengths(causal, kv):
    """One symbolic kernel at n = 1, below a tile, at a tile and off it (query and key tails)."""
    spec = AttentionSpec(seq_len="n", kv_seq_len=kv, num_heads=2, head_dim=64, causal=causal, projections=False)
    kernel = compiled(spec)
    for n in (1, 5, 16, 17, 33, 100):
        sizes = {"n": n, "m": n + 7} if kv else {"n": n}
        assert_matches_oracle(kernel, sizes)


def test_symbolic_micro_kernels_have_no_per_lane_predicates():
    """The query-tail predicate is gone from the tile's stages (they vectorise) and the causal key
    loops are counted loops again (no `sees_keys` branch left after compaction)."""
    spec = AttentionSpec(seq_len="n", num_heads=2, head_dim=64, causal=True, projections=False)
    mod, _ = schedule_attention(spec, CPU)
    lowered = lower(mod, CPU).script()
    assert "sees_keys" not in lowered
    lanes, knobs = vector_lanes(CPU), schedules.default_knobs(spec, CPU)  # the QKᵀ register tile stays in registers:
    vectors = knobs["q_tile"] // lanes * knobs["qk_keys"]  # (q_tile queries in vectors × qk_keys keys)
    assert f'alloc_local(({vectors},), "float32x{lanes}")' in lowered
    tile_loops = [line for line in lowered.splitlines() if "_s in " in line]  # scalarised vector loops
    assert not tile_loops  # (probs' exp2 too: `passes.vector_exp2` expands it after vectorisation)


def test_decode_with_a_symbolic_cache_builds_and_matches_oracle():
    spec = AttentionSpec(seq_len=1, kv_seq_len="m", num_heads=8, head_dim=64, projections=False,
                         causal=True, causal_align="bottom_right")
    kernel = compiled(spec)
    for m in (1, 15, 16, 17, 100):
        assert_matches_oracle(kernel, {"m": m})


def test_symbolic_window_and_padding_build():
    """Guards whose bounds read kv_lens or a window's floordiv still build and match."""
    spec = AttentionSpec(batch=2, seq_len="n", num_heads=3, num_kv_heads=1, head_dim=16, causal=True,
                         causal_align="bottom_right", window=36, key_padding=True, layout="BSHD",
                         projections=False)
    assert_matches_oracle(compiled(spec), {"n": 37})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_symbolic_per_query_mask_at_tail_lengths(dtype):
    """A (b, h, s, t) mask's tile of a symbolic kernel: its rows past n read row n - 1
    (`pad_query_tiles`), whole vectors of padded keys read unclamped (`unclamp_whole_vectors`)."""
    spec = AttentionSpec(batch="b", seq_len="n", kv_seq_len="m", num_heads=2, head_dim=32, projections=False,
                         layout="BSHD", dtype=dtype, attn_mask="additive", attn_mask_dims="bhst")
    kernel = compiled(spec)
    for n, m in ((1, 1), (5, 37), (16, 16), (37, 50), (64, 33)):
        assert_matches_oracle(kernel, {"b": 2, "n": n, "m": m})


def test_a_mask_tile_copy_keeps_no_query_test():
    """The symbolic fp32 mask tile is copied a vector of queries at a time, with no per-row test."""
    spec = AttentionSpec(seq_len="n", num_heads=2, head_dim=32, projections=False, attn_mask="additive",
                         attn_mask_dims="bhst")
    mod, _ = schedule_attention(spec, CPU)
    copies = []
    visit = lambda realize, loops: copies.append((realize, list(loops))) if realize.block.name_hint.startswith(  # noqa: E731
        "attn_mask") else None
    passes.visit_blocks(mod["main"].body, visit)
    assert copies
    for realize, loops in copies:
        assert isinstance(realize.predicate, tvm.tirx.IntImm) and realize.predicate.value == 1
        assert loops[-1].kind == tvm.tirx.ForKind.VECTORIZED


def _clamped_copy() -> tvm.IRModule:
    """B (n padded to whole vectors of 16) = A[min(v, n - 1)], a vector at a time."""
    n = tvm.tirx.Var("n", "int32")
    a = tvm.te.placeholder((n,), "float32", "A")
    b = tvm.te.compute(((n + 15) // 16 * 16,), lambda v: a[tvm.tirx.min(v, n - 1)], name="B")
    sch = tvm.s_tir.Schedule(tvm.te.create_prim_func([a, b]))
    sch.vectorize(sch.split(sch.get_loops(sch.get_sblock("B"))[0], [None, 16])[1])
    return sch.mod


def test_whole_vectors_read_unclamped():
    """`unclamp_whole_vectors` on a padded copy: the whole vectors read A[v] (no min), the last one
    still clamps, and the copy equals NumPy's at lengths on and off a vector."""
    mod = passes.unclamp_whole_vectors()(_clamped_copy())
    lines = mod["main"].script().splitlines()
    loads = [line.split("=", 1)[1].strip() for line in lines if "B[v" in line and "] = " in line]
    assert len(loads) == 2 and sum("T.min" in x for x in loads) == 1  # the whole vectors' copy, the last one's
    run = tvm_compile(mod, CPU)
    for n in (1, 15, 16, 37):
        a = np.arange(n, dtype="float32")
        b = tvm.runtime.tensor(np.zeros(-(-n // 16) * 16, "float32"))
        run["main"](tvm.runtime.tensor(a), b)
        np.testing.assert_array_equal(b.numpy(), a[np.minimum(np.arange(b.shape[0]), n - 1)])


ONE_LAUNCH = [AttentionSpec(batch=2, seq_len=40, num_heads=4, d_model=64, causal=True, dtype="float16"),
              AttentionSpec(batch=2, seq_len="n", num_heads=4, num_kv_heads=2, d_model=64, dtype="bfloat16"),
              AttentionSpec(batch=2, seq_len=64, num_heads=4, head_dim=32, projections=False, dtype="bfloat16")]


@pytest.mark.parametrize("spec", ONE_LAUNCH, ids=["fp16-layer", "bf16-symbolic-gqa-layer", "bf16-core"])
def test_consecutive_parallel_loops_start_in_one_launch(spec):
    """`passes.one_parallel_launch`: a kernel of several parallel passes (a layer's projections and
    attention; V's pair panel, then the query tiles) starts TVM's thread pool once (one parallel
    lambda in its LLVM IR, where each pass was one), and the barriers between the passes keep the
    result right whatever the number of threads (each pass splits its loop over all of them)."""
    kernel = compiled(spec)
    ll = kernel.executable.mod.inspect_source("ll")
    assert len(re.findall(r"^define .*@__tvm_parallel_lambda", ll, flags=re.M)) == 1
    config_threadpool = tvm.get_global_func("runtime.config_threadpool")
    try:
        for threads in (1, 3, 2):  # (3 on this 2-core machine: the barrier waits for a descheduled thread)
            config_threadpool(1, threads)
            assert_matches_oracle(kernel, {name: 37 for name in spec.symbolic_dims})
    finally:
        config_threadpool(1, 0)  # (0: the default again, TVM_NUM_THREADS or the cores)
