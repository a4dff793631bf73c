"""bf16 and fp16 CPU kernels on their fast paths, against the float64 oracle: bf16 QKᵀ and P·V on
AMX tiles (tdpbf16ps) and on AVX512-BF16 dot products (vdpbf16ps) over every spec axis the paths
take, and the instructions in the generated code exactly when the target has the feature. The
vdpbf16ps kernels are built for this CPU with AMX off (`helpers.NO_AMX`: what a Zen 4 runs)."""

import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import HOST, NO_AMX, assert_matches_oracle, block_names, compiled, every_other_slow, products_on, runs_here
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import specs

import tvmattn
from tvmattn import AttentionSpec
from tvmattn.compiler.target import isa_of, resolve_target
from tvmattn.compiler.verify import check
from tvmattn.schedules.cpu.plan import padded_widths, plan_of

HOST_HAS_BF16_DOT = isa_of(HOST).dot is not None
HOST_HAS_AMX = isa_of(HOST).tiles is not None
needs_bf16_dot = pytest.mark.skipif(not HOST_HAS_BF16_DOT, reason="this CPU has no AVX512-BF16")
needs_amx = pytest.mark.skipif(not HOST_HAS_AMX, reason="this CPU has no AMX-BF16 (or Linux does not grant it)")


@st.composite
def dot_specs(draw, symbolic: bool = False) -> AttentionSpec:
    """A bf16 spec whose QKᵀ and P·V can take the dot products (`CpuPlan.qk_pairs`, `pv_pairs`): whole query and key
    tiles, head widths in whole vectors; every other axis drawn."""
    spec = draw(specs(dtype="bfloat16", symbolic=False, intermediate=False, max_len=80))
    d = draw(st.sampled_from((16, 32, 64)))
    seq = draw(st.sampled_from((16, 32, 48, 64)))  # whole query tiles
    kv_seq = draw(st.one_of(st.none(), st.integers(4, 20).map(lambda x: 4 * x)))  # whole key tiles
    return spec.replace(head_dim=d, v_head_dim=draw(st.sampled_from((None, 16, 32))), seq_len=seq,
                        kv_seq_len=kv_seq, d_model=spec.h * d,
                        window=None if spec.window is None else draw(st.integers(1, seq // 2)))


@needs_bf16_dot
@settings(max_examples=5, deadline=None)
@given(dot_specs())
def test_bf16_dot_products_match_the_oracle(spec):
    kernel = compiled(spec, NO_AMX)
    assert products_on(kernel, "dot"), kernel.schedule
    assert_matches_oracle(kernel)


@needs_bf16_dot
@settings(max_examples=5, deadline=None)
@given(specs(dtype="bfloat16", symbolic=False, intermediate=False), st.integers(17, 220), st.data())
def test_ragged_static_lengths_run_on_the_bf16_dot_products(spec, n, data):
    """Static lengths with no whole query tile (a ViT's 197 tokens) run padded to blocks of 16 on the
    dot products, the padded rows and keys hidden."""
    n_kv = data.draw(st.one_of(st.none(), st.integers(17, 220)))
    if n % 16 == 0 and (n_kv is None or n_kv % 16 == 0):
        n += 1
    d = data.draw(st.sampled_from((32, 64)))
    spec = spec.replace(head_dim=d, v_head_dim=None, seq_len=n, kv_seq_len=n_kv, d_model=spec.h * d, window=None)
    kernel = compiled(spec, NO_AMX)
    assert {"QKᵀ", "P·V"} <= products_on(kernel, "dot"), kernel.schedule
    assert_matches_oracle(kernel)


@needs_bf16_dot
@settings(max_examples=5, deadline=None)
@given(specs(dtype="bfloat16", symbolic=True, intermediate=False), st.data())
def test_symbolic_lengths_run_on_the_bf16_dot_products(spec, data):
    """One symbolic kernel, core or full layer, on the dot products (its lengths run in whole blocks
    of 16, the rows and keys past the end read the last again and are hidden), at lengths inside and
    past a block."""
    spec = spec.replace(head_dim=data.draw(st.sampled_from((16, 32, 64))), v_head_dim=None)
    kernel = compiled(spec, NO_AMX)
    assert {"QKᵀ", "P·V"} <= products_on(kernel, "dot"), kernel.schedule
    for i, n in enumerate(data.draw(st.lists(st.integers(1, 70), min_size=2, max_size=3))):
        assert_matches_oracle(kernel, {name: 2 if name == "B" else n + 5 * j
                                       for j, name in enumerate(spec.symbolic_dims)}, seed=i)


@needs_bf16_dot
@pytest.mark.parametrize("kind,dims", every_other_slow(["bool", "additive"], ["bhst", "bst", "bt", "s"]))
def test_symbolic_lengths_with_an_attn_mask_on_the_bf16_dot_products(kind, dims):
    """Masks along queries and keys (packed per tile from their padded stage, mask_rows), along keys
    only (read in place at a clamped key), along queries only."""
    spec = AttentionSpec(batch="B", seq_len="n", kv_seq_len="m", num_heads=2, head_dim=32, attn_mask=kind,
                         attn_mask_dims=dims, projections=False, dtype="bfloat16")
    kernel = compiled(spec, NO_AMX)
    assert products_on(kernel, "dot") == {"QKᵀ", "P·V"}, kernel.schedule
    for seed, sizes in enumerate(({"B": 2, "n": 21, "m": 40}, {"B": 1, "n": 1, "m": 9}, {"B": 1, "n": 64, "m": 64})):
        assert_matches_oracle(kernel, sizes, seed=seed)


@needs_bf16_dot
@pytest.mark.parametrize("causal,window,key_padding", [(True, None, False), (True, 7, False), (False, 9, True),
                                                       (True, None, True)])
def test_bf16_dot_products_skip_hidden_key_tiles(causal, window, key_padding):
    """Key tiles the mask hides are skipped in pairs of keys: an odd window edge or key length must
    still give the hidden key of a pair weight 0."""
    spec = AttentionSpec(batch=2, seq_len=96, num_heads=2, head_dim=32, causal=causal, window=window,
                         key_padding=key_padding, projections=False, dtype="bfloat16")
    kernel = compiled(spec, NO_AMX, knobs=(("q_tile", 32),))
    assert "P·V" in products_on(kernel, "dot"), kernel.schedule
    for seed in range(3):
        assert_matches_oracle(kernel, seed=seed)


@st.composite
def amx_specs(draw, symbolic: bool = False) -> AttentionSpec:
    """A bf16 core spec whose QKᵀ and P·V take AMX's tiles (`CpuPlan.on_tiles`): head widths in whole
    tiles; lengths whole blocks of 32 or padded to them (other static ones, and symbolic ones);
    every other axis drawn."""
    spec = draw(specs(dtype="bfloat16", symbolic=symbolic, intermediate=False, projections=False, max_len=100))
    d = draw(st.sampled_from((32, 64, 128)))
    spec = spec.replace(head_dim=d, v_head_dim=draw(st.sampled_from((None, 32, 64))), d_model=spec.h * d)
    if symbolic or spec.n_q == 1 or draw(st.booleans()):  # (one query: the decode kernel, no tiles)
        return spec.replace(seq_len=max(spec.n_q, 2) if isinstance(spec.n_q, int) else spec.n_q)
    seq = draw(st.sampled_from((32, 64, 96)))  # whole blocks
    kv_seq = draw(st.one_of(st.none(), st.sampled_from((32, 64, 160))))
    window = None if spec.window is None else draw(st.integers(1, 40))
    return spec.replace(seq_len=seq, kv_seq_len=kv_seq, window=window)


@needs_amx
@settings(max_examples=6, deadline=None)  # (-m slow: the other AMX sweeps, 27–55 s each on 2 cores)
@given(amx_specs())
def test_amx_tiles_match_the_oracle(spec):
    kernel = compiled(spec)
    assert products_on(kernel, "tiles"), kernel.schedule
    assert_matches_oracle(kernel)


@pytest.mark.slow  # an AMX sweep of 27–55 s on 2 cores; quick AMX cases and the sweep above run by default
@needs_amx
@settings(max_examples=8, deadline=None)
@given(amx_specs(symbolic=True), st.data())
def test_symbolic_lengths_run_on_amx_tiles(spec, data):
    """One symbolic kernel on AMX's tiles (its lengths padded to whole blocks of 32, the rows and keys
    past the end reading the last again and hidden), at lengths inside and past a block."""
    kernel = compiled(spec)
    assert products_on(kernel, "tiles"), kernel.schedule
    for i, n in enumerate(data.draw(st.lists(st.integers(1, 100), min_size=2, max_size=3))):
        assert_matches_oracle(kernel, {name: 2 if name == "B" else n + 5 * j
                                       for j, name in enumerate(spec.symbolic_dims)}, seed=i)


@pytest.mark.slow  # an AMX sweep of 27–55 s on 2 cores; quick AMX cases and the sweep above run by default
@needs_amx
@settings(max_examples=14, deadline=None)
@given(specs(dtype=("bfloat16", "float16"), projections=True, max_len=80), st.data())
def test_layers_on_amx_tiles_match_the_oracle(spec, data):
    """Full layers, static, padded or symbolic, with their projections (model widths in whole blocks
    of 32) and their core on AMX's tiles; fp16's in bf16 parts (its core where its queries see 128 keys
    or more: any that has 256 keys and no window)."""
    d = data.draw(st.sampled_from((32, 64)))
    spec = spec.replace(head_dim=d, v_head_dim=data.draw(st.sampled_from((None, 32))), d_model=32 * spec.h,
                        seq_len=max(spec.n_q, 16) if isinstance(spec.n_q, int) else spec.n_q)
    if spec.dtype == "float16" and not spec.symbolic_dims and data.draw(st.booleans()):  # its core on the tiles too
        spec = spec.replace(kv_seq_len=data.draw(st.sampled_from((256, 300))), window=None)
    kernel = compiled(spec)
    if spec.dtype == "bfloat16" or spec.symbolic_dims or (spec.n_kv >= 256 and spec.window is None):
        assert {"QKᵀ", "P·V"} <= products_on(kernel, "tiles"), kernel.schedule
    assert "W_O" in products_on(kernel, "tiles"), kernel.schedule
    for seed, n in enumerate((16, 45) if spec.symbolic_dims else (None,)):
        assert_matches_oracle(kernel, {name: 2 if name == "B" else n for name in spec.symbolic_dims}, seed=seed)


SPEC = AttentionSpec(batch=1, seq_len=64, num_heads=2, head_dim=64, projections=False, dtype="bfloat16")


@pytest.mark.parametrize("n,d_k,d_v,dots", [
    (128, 40, 40, set()),  # P·V cannot take them (d_v no whole vector): QKᵀ widened with it
    (128, 64, 40, set()),
    ("n", 64, 40, set()),  # symbolic: QKᵀ alone on them over padded keys did not build; unpadded there
    ("n", 40, 40, set()),
    (100, 64, 40, set()),  # ragged static lengths
    (100, 40, 40, set()),
    (128, 48, 48, {"QKᵀ", "P·V"}),
    ("n", 48, 48, {"QKᵀ", "P·V"}),
])
def test_qk_takes_the_dot_products_with_pv(n, d_k, d_v, dots):
    """QKᵀ alone on the dot products with P·V widened ran 1.06–1.17× slower than both widened, from
    (1, 8, 128, 40) to (1, 8, 4096, 40) and at 72 (AVX512-BF16, one process), and over symbolic (padded)
    keys failed to build: QKᵀ takes them with P·V."""
    spec = AttentionSpec(batch=1, seq_len=n, num_heads=2, head_dim=d_k, v_head_dim=d_v, projections=False,
                         dtype="bfloat16")
    kernel = compiled(spec, NO_AMX)
    assert products_on(kernel, "dot") == dots, kernel.schedule
    if runs_here(NO_AMX):
        assert_matches_oracle(kernel, {"n": 37} if n == "n" else None)


@pytest.mark.parametrize("mcpu,has_dot,has_tiles", [("znver4", True, False), ("sapphirerapids", True, True),
                                                    ("znver3", False, False), ("skylake-avx512", False, False)])
def test_bf16_instructions_exactly_where_the_target_has_them(mcpu, has_dot, has_tiles):
    """AMX's tile products where the CPU has them (each task configures the tiles and releases them),
    else AVX512-BF16's dot products, else fp32 FMAs; P rounded to bf16 pairs for P·V on either."""
    target = resolve_target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    kernel = tvmattn.compile(SPEC, target, knobs={})
    plan = plan_of(SPEC, target)
    assert (plan.qk_pairs and plan.pv_pairs) == has_dot and plan.on_tiles == has_tiles
    asm = kernel.source()
    assert ("vdpbf16ps" in asm) == (has_dot and not has_tiles)
    assert all((op in asm) == has_tiles for op in ("tdpbf16ps", "tileloadd", "tilestored", "ldtilecfg", "tilerelease"))
    assert ("vcvtne2ps2bf16" in asm) == has_dot
    assert bool(products_on(kernel, "dot")) == (has_dot and not has_tiles)
    assert bool(products_on(kernel, "tiles")) == has_tiles
    if runs_here(kernel.target):
        assert_matches_oracle(kernel)


# A process that never imported tvmattn, so nobody asked Linux for AMX's state but the kernel itself
FRESH_PROCESS = """
import sys, numpy as np, ml_dtypes, tvm
q, k, v, ref = (np.load(f"{sys.argv[2]}/{n}.npy") for n in ("q", "k", "v", "ref"))
args = [tvm.runtime.tensor(x.astype(ml_dtypes.bfloat16)) for x in (q, k, v)]
out = tvm.runtime.tensor(np.zeros(ref.shape, ml_dtypes.bfloat16))
tvm.runtime.load_module(sys.argv[1])["main"](*args, out)
err = np.abs(out.numpy().astype(np.float64) - ref).max() / np.abs(ref).max()
print(err)
sys.exit(0 if err < 5e-2 else 1)
"""


@needs_amx
def test_an_exported_amx_kernel_asks_for_the_tiles_itself(tmp_path):
    """Linux faults the first tile instruction of a process that did not ask for AMX's state: the
    exported library asks itself (once per process), so it runs wherever TVM's runtime loads it."""
    spec = AttentionSpec(batch=1, seq_len=96, num_heads=2, head_dim=32, causal=True, projections=False,
                         dtype="bfloat16")
    kernel = compiled(spec)
    assert products_on(kernel, "tiles")
    kernel.export_library(str(tmp_path / "attention.so"))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 96, 32)).astype(np.float32) for _ in range(3))
    import ml_dtypes
    q, k, v = (x.astype(ml_dtypes.bfloat16).astype(np.float64) for x in (q, k, v))  # the values the kernel sees
    for name, x in dict(q=q, k=k, v=v, ref=tvmattn.reference(spec, q, k, v)).items():
        np.save(tmp_path / f"{name}.npy", x)
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(tmp_path / "attention.so"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("kv_seq_len,causal,tiles", every_other_slow([(128, False, True), (64, False, False),
                                                                       (256, True, True), (128, True, False),
                                                                       ("m", True, True)]))
def test_fp16_takes_the_tiles_from_128_keys_a_query_sees(kv_seq_len, causal, tiles):
    """fp16 on tile products in bf16 parts where the target has AMX and a query sees enough keys to
    pay for the parts (`plan.PARTS_MIN_KEYS`: about half of them where causal), else widened to fp32
    FMAs."""
    spec = AttentionSpec(batch=1, seq_len=kv_seq_len if causal and kv_seq_len != "m" else 64, kv_seq_len=kv_seq_len,
                         num_heads=2, head_dim=64, causal=causal, projections=False, dtype="float16")
    target = resolve_target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
    kernel = tvmattn.compile(spec, target)
    assert plan_of(spec, target).fp16_parts == tiles
    assert ("tdpbf16ps" in kernel.source()) == tiles and bool(products_on(kernel, "tiles")) == tiles


@pytest.mark.parametrize("mcpu,dtype,n,d_k,d_v,padded", [
    ("sapphirerapids", "bfloat16", 256, 80, 80, (96, 96)),  # Phi-2, ViT-H
    ("sapphirerapids", "float16", 256, 40, 40, (64, 64)),  # Stable Diffusion; fp16 in bf16 parts
    ("sapphirerapids", "bfloat16", 256, 64, 80, (64, 96)),  # d_v alone
    ("sapphirerapids", "bfloat16", "n", 112, 112, (128, 128)),  # symbolic lengths, in whole blocks
    ("sapphirerapids", "bfloat16", 256, 64, 64, None),  # on the tiles as it is
    ("sapphirerapids", "bfloat16", 1, 80, 80, None),  # a decode step takes no tile products
    ("sapphirerapids", "float32", 256, 80, 80, None),
    ("znver4", "bfloat16", 256, 80, 80, None),  # no tiles, and whole vectors for the dot products
    ("znver4", "bfloat16", 256, 40, 40, (40, 48)),  # no tiles: d_v to whole vectors for P·V's dot products
    ("znver4", "bfloat16", 256, 72, 72, (72, 80)),
    ("znver4", "bfloat16", "n", 40, 40, (48, 48)),  # symbolic keys: d_k in whole vectors too
    ("znver4", "bfloat16", 1, 40, 40, None),  # a decode step's dot products run along d_k
    ("znver4", "float16", 256, 40, 40, None),  # no fp16 dot products
    ("znver3", "bfloat16", 256, 40, 40, None),  # no bf16 dot products
])
def test_head_widths_padded_for_the_tiles_or_dot_products(mcpu, dtype, n, d_k, d_v, padded):
    """`plan.padded_widths`: the head widths rounded up to the tiles' step and block where that alone
    puts the kernel on them, else to the dot products' pairs and vectors where that puts more of its
    products on them; the scale stays the unpadded width's."""
    target = resolve_target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    spec = AttentionSpec(batch=1, seq_len=n, kv_seq_len=256 if n != "n" else n, num_heads=2, head_dim=d_k,
                         v_head_dim=d_v, projections=False, dtype=dtype)
    got = padded_widths(spec, target)
    assert (None if got is None else (got.d_k, got.d_v)) == padded
    if got is not None:
        now, then = plan_of(spec, target), plan_of(got, target)
        assert then.on_tiles if "sapphire" in mcpu else (then.qk_pairs and then.pv_pairs and not now.pv_pairs)
        assert got.softmax_scale == spec.softmax_scale and got.replace(head_dim=d_k, v_head_dim=d_v, scale=None) == spec


def test_one_query_keeps_its_dot_products_along_the_head():
    """A decode step is no tile product: padded to 32 queries it would compute 31 rows for nothing."""
    spec = AttentionSpec(batch=2, seq_len=1, kv_seq_len=256, num_heads=8, head_dim=64, projections=False,
                         dtype="bfloat16")
    kernel = tvmattn.compile(spec, {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
    assert not products_on(kernel, "tiles") and "tdpbf16ps" not in kernel.source()


def test_amx_needs_whole_blocks_of_32():
    """d_k = 16 (half a tile row) and a query tile of 16 keep the AVX512-BF16 dot products."""
    target = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}
    for kernel in (tvmattn.compile(SPEC.replace(head_dim=16), target),
                   tvmattn.compile(SPEC, target, knobs={"q_tile": 16})):
        assert products_on(kernel, "dot") == {"QKᵀ", "P·V"} and not products_on(kernel, "tiles"), kernel.schedule


# d_k = 3: QKᵀ and P·V cannot take the dot products, so any vdpbf16ps is the projections'
LAYER = AttentionSpec(batch=1, seq_len=32, num_heads=16, head_dim=3, d_model=48, causal=True, dtype="bfloat16")


@pytest.mark.parametrize("seq_len,dtype", every_other_slow([32, 100, 1, "n"], ["bfloat16", "float16"]))
def test_layer_projections_on_amx_tiles(seq_len, dtype):
    """W_Q, W_K, W_V and W_O on tile products where the target has AMX (fp16 in bf16 parts), from 16
    rows (static ones padded to whole blocks of 32, as symbolic ones); a one-token step keeps its
    projections widened."""
    # d_k = 16: the core cannot take the tiles, so any tdpbf16ps is the projections'
    spec = LAYER.replace(seq_len=seq_len, num_heads=2, head_dim=16, v_head_dim=32, d_model=64, dtype=dtype)
    kernel = tvmattn.compile(spec, {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}, knobs={})
    assert ("tdpbf16ps" in kernel.source()) == (seq_len != 1)
    assert (products_on(kernel, "tiles") == {"W_Q", "W_K", "W_V", "W_O"}) == (seq_len != 1)
    if HOST_HAS_AMX:
        for n in (1, 17, 40) if seq_len == "n" else (None,):
            assert_matches_oracle(kernel, {"n": n} if n else None)


@pytest.mark.parametrize("mcpu,has_dot", [("znver4", True), ("znver3", False)])
@pytest.mark.parametrize("seq_len", [32, 1, "n"])
def test_layer_projections_on_the_bf16_dot_instruction(mcpu, has_dot, seq_len):
    """W_Q, W_K, W_V and W_O on vdpbf16ps (W packed into pairs once per call) where the target has it,
    from 16 rows (a one-token step keeps its projections widened, reading W once), symbolic rows in
    whole blocks of 16."""
    spec = LAYER.replace(seq_len=seq_len)
    kernel = tvmattn.compile(spec, {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}, knobs={})
    assert ("vdpbf16ps" in kernel.source()) == (has_dot and (seq_len == "n" or seq_len >= 16))
    if HOST_HAS_BF16_DOT or not has_dot:
        for n in (1, 17, 40) if seq_len == "n" else (None,):
            assert_matches_oracle(kernel, {"n": n} if n else None)


@needs_bf16_dot
@settings(max_examples=10, deadline=None)
@given(specs(dtype="bfloat16", projections=True, symbolic=False, max_len=48), st.data())
def test_layers_with_projections_on_the_bf16_dot_products_match_the_oracle(spec, data):
    """Every axis of a full layer with model widths in whole vectors and at least 16 rows: its
    projections on the dot products wherever their reduction comes in whole pairs (odd head widths
    straddle heads in W_O's)."""
    spec = spec.replace(d_model=data.draw(st.sampled_from((16, 32, 48))), seq_len=max(spec.n_q, 16))
    assert_matches_oracle(compiled(spec, NO_AMX))


def test_bf16_without_the_instruction_matches_the_oracle():
    """The fp32 FMA path a CPU without AVX512-BF16 takes (AVX2 code runs on any x86-64 here)."""
    kernel = tvmattn.compile(SPEC.replace(causal=True), {"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    assert "vdpbf16ps" not in kernel.source()
    assert_matches_oracle(kernel)


AVX2_REGISTERS = 16


def _stack_vector_operands(asm: str) -> int:
    """Vector instructions that read or write the stack: register tiles that did not fit, spilled."""
    return sum(1 for line in asm.splitlines() if "(%rsp)" in line and re.search(r"%[xyz]mm\d", line))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal,projections", [(False, False), (True, False), (True, True)])
def test_16bit_kernels_without_the_instructions_keep_their_tiles_in_avx2_registers(dtype, causal, projections):
    """With AVX2's 16 vector registers, a 16-bit kernel widened to fp32 FMAs spills about as much as
    the fp32 kernel of the same spec: at most a register file (16 operands) more, as its loop nest
    may differ (head tasks, `CpuPlan.per_head`: a few more hoisted mask vectors on the stack); 16-bit
    tiles sized for AVX-512's 32 registers spilled 400 stack operands against fp32's 23 (0.32× its
    speed). And it matches the oracle (fp16's P·V converts V in the micro-kernel there, not in a
    pass)."""
    target = {"kind": "llvm", "mcpu": "znver3", "num-cores": 2}
    spec = AttentionSpec(batch=1, seq_len=256, num_heads=8, head_dim=64, d_model=512, causal=causal,
                         projections=projections)
    fp32 = _stack_vector_operands(tvmattn.compile(spec, target, tuned=False).source())
    kernel = tvmattn.compile(spec.replace(dtype=dtype), target, tuned=False)
    assert _stack_vector_operands(kernel.source()) <= fp32 + AVX2_REGISTERS
    assert_matches_oracle(kernel)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("seq_len,kv_seq_len", [(32, None), ("n", None), (16, 24)])
def test_widened_projections_broadcast_x_in_fp32(seq_len, kv_seq_len, dtype):
    """A 16-bit layer without the bf16 instructions: x (x_kv, W_O's merged heads) is widened once,
    before the projections (padded rows as they are padded), so no register tile broadcasts a 16-bit
    x and converts it (vpbroadcastw, then vcvtph2ps, per element and row: 0.85× fp32, where widened
    x gives 1.1×)."""
    spec = AttentionSpec(batch=2, seq_len=seq_len, kv_seq_len=kv_seq_len, num_heads=2, head_dim=16, d_model=32,
                         causal=kv_seq_len is None, dtype=dtype)
    kernel = tvmattn.compile(spec, {"kind": "llvm", "mcpu": "znver3", "num-cores": 2}, tuned=False)
    if dtype == "float16":
        assert "vpbroadcastw" not in kernel.source()
    for n in (1, 17, 40) if seq_len == "n" else (None,):
        assert_matches_oracle(kernel, {"n": n} if n else None)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv_heads,key_padding,head_dim", [(8, False, 64), (2, True, 128), (8, True, 40)])
def test_half_width_kv_decode_matches_the_oracle(dtype, kv_heads, key_padding, head_dim):
    """One query against a long 16-bit cache (the memory-bound case: half the bytes of fp32); P·V
    tiles of a whole V row (`plan._one_pass_vecs`): 8 vectors, 16 (spilling AVX2's registers), 4 and a tail of 1."""
    spec = AttentionSpec(batch=2, seq_len=1, kv_seq_len=600, num_heads=8, num_kv_heads=kv_heads, head_dim=head_dim,
                         key_padding=key_padding, projections=False, dtype=dtype)
    assert_matches_oracle(compiled(spec))


@pytest.mark.slow  # an AMX sweep of 27–55 s on 2 cores; quick AMX cases and the sweep above run by default
@needs_amx
@settings(max_examples=10, deadline=None)
@given(specs(dtype="float16", symbolic=None, intermediate=False, projections=False, max_len=60), st.data())
def test_fp16_on_amx_tiles_in_bf16_parts_matches_the_oracle(spec, data):
    """fp16 cores of 256 keys or more (or symbolic) on AMX's bf16 tiles, every operand split into two
    bf16 parts, every product three tile products: every spec axis but a window (of a few keys: the
    widened path), lengths padded to blocks of 32."""
    spec = spec.replace(head_dim=data.draw(st.sampled_from((32, 64))), v_head_dim=None, window=None,
                        kv_seq_len=spec.kv_seq_len if spec.symbolic_dims else data.draw(st.sampled_from((256, 300))),
                        seq_len=spec.seq_len if spec.symbolic_dims else max(spec.n_q, 2))
    kernel = compiled(spec)
    assert products_on(kernel, "tiles"), kernel.schedule
    for seed, n in enumerate((7, 70) if spec.symbolic_dims else (None,)):
        assert_matches_oracle(kernel, {name: 2 if name == "B" else n for name in spec.symbolic_dims}, seed=seed)


@needs_amx
@pytest.mark.parametrize("causal", [False, True])
def test_fp16_in_bf16_parts_is_as_accurate_as_widened_fp16(causal):
    """The parts are exact for fp16 (8 + 3 significant bits) and P keeps about 16 bits, so the tiles'
    result is as close to the oracle as fp32 FMAs of the widened values are; one part lost (hi alone)
    would be bf16's error, 5–9e-3 here, which fp16's tolerance of 1e-2 lets through."""
    spec = AttentionSpec(batch=1, seq_len=256, num_heads=2, head_dim=64, causal=causal, projections=False,
                         dtype="float16")
    on_tiles, widened = compiled(spec), compiled(spec, NO_AMX)
    assert products_on(on_tiles, "tiles") and not products_on(widened, "tiles")
    for seed in range(3):
        tiles_error, widened_error = (check(k, None, seed, {}).max_rel for k in (on_tiles, widened))
        assert tiles_error <= max(1.5 * widened_error, 1e-3), (tiles_error, widened_error)


@needs_amx
@pytest.mark.parametrize("seq_len,kv_seq_len", [(64, None), (48, 256)])
def test_fp16_layers_in_bf16_parts_are_as_accurate_as_widened_fp16(seq_len, kv_seq_len):
    """The projections' parts, x's and W's, are exact, so a layer on the tiles (its core too, at 256
    keys) is as close to the oracle as one of widened fp32 FMAs; x's or W's lo part lost would be
    bf16's error."""
    spec = AttentionSpec(batch=2, seq_len=seq_len, kv_seq_len=kv_seq_len, num_heads=4, head_dim=32, d_model=128,
                         causal=kv_seq_len is None, dtype="float16")
    on_tiles, widened = compiled(spec), compiled(spec, NO_AMX)
    parts = {"merged_hi", "merged_lo", "w_o_hi_o", "w_o_lo_o"}  # W_O's x and W as bf16 hi + lo (W's packed)
    assert "W_O" in products_on(on_tiles, "tiles") and parts <= block_names(on_tiles)
    assert not products_on(widened, "tiles")
    for seed in range(3):
        tiles_error, widened_error = (check(k, None, seed, {}).max_rel for k in (on_tiles, widened))
        assert tiles_error <= max(1.5 * widened_error, 1e-3), (tiles_error, widened_error)


HALF = AttentionSpec(batch=1, seq_len=64, num_heads=2, head_dim=64, projections=False, dtype="float16")


@pytest.mark.parametrize("target,spec,keys", [
    (("cpu", "sapphirerapids"), HALF, 32),  # AVX512-FP16; 64 keys: no bf16 parts on the tiles
    (("cpu", "sapphirerapids"), HALF.replace(kv_seq_len=256), 0),  # the tiles, fp16 as bf16 parts
    (("cpu", "znver4"), HALF, 0),  # no fp16 arithmetic
    (("aarch64", "neoverse-v2"), HALF, 32), (("aarch64", "cortex-a76"), HALF, 32),
    (("aarch64", "neoverse-v2"), HALF.replace(causal=True), 16),  # a mask bounds the tiles' keys
    (("aarch64", "neoverse-v1"), HALF.replace(head_dim=48), 32),  # SVE-256's 16 fp16 lanes: 48 = 3 vectors
    (("aarch64", "neoverse-v1"), HALF.replace(head_dim=40), 0),  # d_v in no whole vectors
    (("aarch64", "aarch64"), HALF, 0),  # a generic aarch64: no FEAT_FP16
    (("aarch64", "neoverse-v2"), HALF.replace(kv_seq_len=48), 0),  # keys in no whole blocks
    (("aarch64", "neoverse-v2"), HALF.replace(kv_seq_len="m"), 0),  # symbolic keys
    (("aarch64", "neoverse-v2"), HALF.replace(seq_len="n", kv_seq_len=64, causal=True), 16),  # symbolic queries
    (("aarch64", "neoverse-v2"), HALF.replace(seq_len="n", kv_seq_len=64, window=8), 0),  # … a window: not lowered
    (("aarch64", "neoverse-v2"), HALF.replace(seq_len=1, kv_seq_len=64), 0),  # decode: along d_k
    (("aarch64", "neoverse-v2"), HALF.replace(dtype="bfloat16"), 0),
    (("aarch64", "neoverse-v2"), HALF.replace(output="weights"), 0),  # no P·V
    (("aarch64", "neoverse-v2"), HALF.replace(d_model=128, head_dim=None, causal=True), 16),  # a layer
])
def test_fp16_pv_on_fp16_fmas_exactly_where_the_cpu_has_them(target, spec, keys):
    """P·V of an fp16 core on the CPU's fp16 FMAs (FEAT_FP16, AVX512-FP16) in blocks of 32 keys (16 where
    masked), where nothing else takes it; QKᵀ keeps fp32 sums everywhere."""
    arch, mcpu = target
    resolved = resolve_target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2}) if arch == "cpu" else \
        resolve_target(arch, mcpu=mcpu)
    plan = plan_of(spec, resolved)
    assert plan.half_keys == keys
    assert not (plan.widen_v and keys)


@pytest.mark.skipif(not isa_of(HOST).half_math, reason="this CPU has no fp16 arithmetic (AVX512-FP16)")
@settings(max_examples=8, deadline=None)
@given(specs(dtype="float16", symbolic=None, intermediate=False, max_len=80, max_head_dim=64), st.data())
def test_fp16_pv_on_fp16_fmas_matches_the_oracle(spec, data):
    """Every axis with P·V on this CPU's fp16 FMAs: keys static in whole blocks of 32 (a symbolic query
    length at lengths inside and past a query tile, its tail tile computed whole)."""
    d = data.draw(st.sampled_from((32, 64)))
    window = None if spec.window is None or spec.symbolic_dims else data.draw(st.integers(1, 32))
    spec = spec.replace(kv_seq_len=data.draw(st.sampled_from((32, 64, 96))), head_dim=d, v_head_dim=None,
                        d_model=spec.h * d, window=window, seq_len=max(spec.n_q, 2) if not spec.symbolic_dims else "n")
    kernel = compiled(spec)
    assert "P·V on fp16 FMAs" in kernel.schedule, kernel.schedule
    for i, n in enumerate((1, 37, 70) if spec.symbolic_dims else (None,)):
        assert_matches_oracle(kernel, {name: 2 if name == "B" else n for name in spec.symbolic_dims}, seed=i)


@settings(max_examples=8, deadline=None)
@given(specs(dtype="float16", symbolic=False, intermediate=False, max_len=80))
def test_fp16_widened_operands_match_the_oracle(spec):
    """fp16 keys widened a register tile at a time and fp32 query panels (`query_tiles._widen_keys`)."""
    assert_matches_oracle(compiled(spec.replace(seq_len=max(spec.n_q, 16))))
