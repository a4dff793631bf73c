"""Every variant of the CPU schedule against the oracle: knobs at their extremes, tails, masks, GQA,
cross-attention, both layouts, symbolic lengths, and the decode paths (one query; split-K)."""

import re

import pytest
import tvm_ffi
from helpers import assert_matches_oracle, compiled, every_other_slow
from tvm.s_tir import SBlock
from tvm.tirx import For, ForKind

import tvmattn
from tvmattn import AttentionSpec
from tvmattn.compiler.build import lower, schedule_attention
from tvmattn.compiler.target import isa_of, resolve_target, vector_lanes
from tvmattn.models.presets import PRESETS
from tvmattn.schedules import cpu, default_knobs
from tvmattn.schedules.micro_kernels import PANEL_BYTES

EXTREMES = [
    dict(q_tile=8, qk_keys=1, pv_rows=1, pv_vecs=1),
    dict(q_tile=64, qk_keys=8, pv_rows=6, pv_vecs=16),
    dict(q_tile=24, qk_keys=3, pv_rows=3, pv_vecs=3),
]
SHAPES = [
    AttentionSpec(batch=2, seq_len=77, num_heads=4, num_kv_heads=2, head_dim=32, causal=True, projections=False),
    AttentionSpec(batch=1, seq_len=50, kv_seq_len=93, num_heads=3, head_dim=24, window=17, key_padding=True,
                  causal=True, causal_align="bottom_right", layout="BSHD", projections=False),
    AttentionSpec(batch=2, seq_len="n", d_model=40, num_heads=2, causal=True),
]


@pytest.mark.parametrize("spec,knobs", every_other_slow(SHAPES, EXTREMES, ids=[
    f"{shape}-{'-'.join(f'{n}{v}' for n, v in k.items())}"
    for shape in ("gqa-causal-tail", "cross-window-padding-bshd", "layer-symbolic") for k in EXTREMES]))
def test_knob_extremes(spec, knobs):
    layer_knobs = dict(gemm_rows=8, gemm_vecs=4) if knobs["q_tile"] == 64 else dict(gemm_rows=1, gemm_vecs=1)
    kernel = compiled(spec, knobs=tuple(sorted({**knobs, **layer_knobs}.items())))
    for sizes in ([{"n": 1}, {"n": 65}] if spec.symbolic_dims else [{}]):
        assert_matches_oracle(kernel, sizes)


DECODE = [
    AttentionSpec(batch=1, seq_len=1, kv_seq_len=1024, num_heads=32, head_dim=64, causal=True,
                  causal_align="bottom_right", projections=False),  # many heads: one task per head
    AttentionSpec(batch=1, seq_len=1, kv_seq_len=1000, num_heads=2, num_kv_heads=1, head_dim=64, key_padding=True,
                  layout="BSHD", projections=False),  # few heads: split-K
    AttentionSpec(batch=1, seq_len=1, kv_seq_len=700, num_heads=1, head_dim=48, window=100, causal=True,
                  causal_align="bottom_right", projections=False),  # split-K with a window
    AttentionSpec(batch=2, seq_len=3, kv_seq_len=300, num_heads=2, head_dim=16, causal=True,
                  causal_align="bottom_right", projections=False),  # a few queries
]


@pytest.mark.parametrize("spec", DECODE, ids=["many-heads", "split-k-gqa-padding", "split-k-window", "three-queries"])
@pytest.mark.parametrize("chunks", [2, 32])
def test_decode_paths(spec, chunks):
    assert_matches_oracle(compiled(spec, knobs=(("key_chunks", chunks),)), seed=chunks)


def block_names(kernel) -> set[str]:
    names = set()
    tvm_ffi.structural_walk(kernel.module["main"].body, [(SBlock, lambda b: names.add(b.name_hint))])
    return names


def loop_extents(kernel, kind: ForKind) -> list[int]:
    """The extents of the scheduled kernel's loops of ``kind`` (parallel, vectorized…)."""
    found = []
    tvm_ffi.structural_walk(kernel.module["main"].body, [
        (For, lambda f: found.append(int(f.extent)) if f.kind == kind else None)])
    return found


AVX2 = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
SPLIT_K = {"row_max_rf", "row_sum_rf", "pv_rf_update"}  # per-chunk partials (rfactor) of the key reductions


@pytest.mark.parametrize("spec, chunks, split", [
    (DECODE[1], 8, 8),  # 2 heads: split-K over 8 chunks of the 1000 keys
    (DECODE[2], 32, 28),  # 1 head: the largest divisor of 700 up to 32
    (DECODE[0], 8, None),  # 32 heads: one task per head, the keys serial
], ids=["split-k-gqa-padding", "split-k-window", "many-heads"])
def test_decode_splits_the_keys_only_when_heads_are_few(spec, chunks, split):
    kernel = tvmattn.compile(spec, AVX2, knobs={"key_chunks": chunks})  # 2 cores, whatever this machine has
    blocks, parallel = block_names(kernel), loop_extents(kernel, ForKind.PARALLEL)
    if split:
        assert SPLIT_K <= blocks and parallel and set(parallel) == {split}, (blocks, parallel)
    else:
        assert not SPLIT_K & blocks and parallel == [spec.batch * spec.h], (blocks, parallel)



def _host_has(flag: str) -> bool:
    try:
        return flag in open("/proc/cpuinfo").read().split()
    except OSError:
        return False


@pytest.mark.skipif(not _host_has("avx2"), reason="this CPU cannot run AVX2 code")
@pytest.mark.parametrize("spec", SHAPES + DECODE[1:2], ids=["gqa-causal-tail", "cross-window-padding-bshd",
                                                             "layer-symbolic", "split-k"])
def test_eight_lane_vectors(spec):
    """An AVX2 target (8 fp32 lanes) whatever this machine has: CI and users may have either."""
    kernel = tvmattn.compile(spec, AVX2)
    assert max(loop_extents(kernel, ForKind.VECTORIZED)) == 8
    assert_matches_oracle(kernel, {name: 65 for name in spec.symbolic_dims})


def parallel_loops(kernel) -> list[tuple[int, set[str]]]:
    """The scheduled kernel's parallel loops: each one's extent and the blocks inside it."""
    found = []

    def visit(loop: For) -> None:
        if loop.kind == ForKind.PARALLEL:
            names: set[str] = set()
            tvm_ffi.structural_walk(loop.body, [(SBlock, lambda b: names.add(b.name_hint))])
            found.append((loop.extent, names))

    tvm_ffi.structural_walk(kernel.module["main"].body, [(For, visit)])
    return found


HALF = dict(seq_len=128, head_dim=32, projections=False)


@pytest.mark.skipif(not _host_has("avx2"), reason="this CPU cannot run AVX2 code")
@pytest.mark.parametrize("spec, tasks, per_head", [
    # 8 (batch, head) pairs on 2 cores: a task each, its 8 query tiles in turn
    (AttentionSpec(batch=1, num_heads=8, causal=True, dtype="float16", **HALF), "8", True),
    # GQA, BSHD: 2 × 2 (batch, KV head) pairs
    (AttentionSpec(batch=2, num_heads=8, num_kv_heads=2, layout="BSHD", dtype="bfloat16", **HALF), "4", True),
    (AttentionSpec(batch=2, num_heads=2, causal=True, dtype="bfloat16", **{**HALF, "seq_len": "n"}), "4", True),
    # a symbolic batch (the PyTorch drop-in's): b × 2 pairs split evenly at any b
    (AttentionSpec(batch="b", num_heads=4, num_kv_heads=2, dtype="float16", **{**HALF, "seq_len": "n"}), "b * 2",
     True),
    (AttentionSpec(batch=1, seq_len=64, num_heads=4, d_model=128, causal=True, dtype="bfloat16"), "4", True),  # a layer
    # 3 pairs on 2 cores would not split evenly: 3 × 8 query-tile tasks, after a pass widening K
    (AttentionSpec(batch=1, num_heads=3, window=20, causal=True, dtype="float16", **HALF), "24", False),
    (AttentionSpec(batch="b", num_heads=3, dtype="float16", **HALF), "b * 24", False),  # b × 3: not at every b
], ids=["fp16-causal", "bf16-gqa-bshd", "bf16-symbolic", "fp16-symbolic-batch", "bf16-layer", "fp16-uneven-window",
        "fp16-uneven-symbolic-batch"])
def test_16bit_cores_widen_k_and_v_once_in_a_task_per_head(spec, tasks, per_head):
    """A 16-bit core on fp32 FMAs (AVX2 here) widens K (bf16: V too) once: where its (batch, KV head)
    pairs split evenly over the cores, inside a task per pair that runs its query tiles in turn (no
    parallel pass before the tasks: a thread-pool start, and the fp32 copy written and read back;
    1.08–1.12× at (1, 8, 128, 64), Zen 3), else in a pass of its own before query-tile tasks."""
    kernel = tvmattn.compile(spec, AVX2, tuned=False)
    loops = parallel_loops(kernel)
    extent, inside = next((e, names) for e, names in loops if "scores_update" in names)
    assert str(extent) == tasks, kernel.schedule
    k, v = ("k_proj", "v_proj") if spec.projections else ("k", "v")
    copies = {k + "_global"} | ({v + "_global"} if spec.dtype == "bfloat16" else set())
    if per_head:
        assert copies <= inside, (copies, inside)
    else:
        assert not copies & inside and any(copies & names for _, names in loops), loops
    for sizes in ([{"b": 3, "n": 1}, {"b": 1, "n": 70}] if spec.symbolic_dims else [{}]):
        assert_matches_oracle(kernel, {name: size for name, size in sizes.items() if name in spec.symbolic_dims})


AVX512 = {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}  # with AVX512-BF16
DOTS = dict(seq_len=128, head_dim=32, projections=False, dtype="bfloat16")


SYMBOLIC_DOTS = {**DOTS, "seq_len": "n"}


@pytest.mark.parametrize("spec, tasks, per_head", [
    (AttentionSpec(batch=2, num_heads=8, num_kv_heads=2, layout="BSHD", **DOTS), "4", True),  # 2 × 2 pairs
    (AttentionSpec(batch=1, num_heads=4, causal=True, **DOTS), "4", True),
    (AttentionSpec(batch=1, num_heads=3, causal=True, **DOTS), "12", False),  # 3 pairs on 2 cores: 3 × 4 tiles
    # keys padded to whole blocks: V's padded rows (v_rows) copied in the head's task too
    # (and each task's serial loop over query tiles, with a tensorized block inside, kept whole:
    # `passes.peel_key_tails`)
    (AttentionSpec(batch=1, num_heads=2, **SYMBOLIC_DOTS), "2", True),
    (AttentionSpec(batch="b", num_heads=4, num_kv_heads=2, layout="BSHD", causal=True, attn_mask="bool",
                   attn_mask_dims="bt", **SYMBOLIC_DOTS), "b * 2", True),
], ids=["gqa-bshd", "causal", "uneven", "symbolic", "symbolic-batch-gqa-key-mask"])
def test_bf16_dot_cores_pack_v_in_pairs_once_in_a_task_per_head(spec, tasks, per_head):
    """On the bf16 dot products, V's pair panel (``v_global``) is packed inside a task per (batch, KV
    head) where those split evenly over the cores, as the widening cores do: no pass of its own
    before the tasks, and the head's panel still in cache for its next query tile; elsewhere in a
    parallel pass before query-tile tasks. Symbolic lengths too (GQA kernels 1.4–1.9× faster than with
    V's passes before query-tile tasks, Zen 4), at lengths inside and past a block of keys."""
    kernel = tvmattn.compile(spec, AVX512, tuned=False)
    loops = parallel_loops(kernel)
    extent, inside = next((e, names) for e, names in loops if "scores_update_o" in names)
    panel = "v_rows_global_o" if spec.symbolic_dims else "v_global_o"
    assert str(extent) == tasks and (panel in inside) == per_head, loops
    assert len(loops) == (1 if per_head else 2), loops
    if _host_has("avx512_bf16"):
        for sizes in ([{"b": 3, "n": 1}, {"b": 1, "n": 21}, {"b": 2, "n": 70}] if spec.symbolic_dims else [{}]):
            assert_matches_oracle(kernel, {name: size for name, size in sizes.items() if name in spec.symbolic_dims})
@pytest.mark.parametrize("n, rows, vecs", [(77, 7, 3), (50, 5, 4), (64, 4, 4)])
def test_bf16_layer_projections_take_register_tiles_of_rows_that_divide_n(n, rows, vecs):
    """A bf16 layer's projections on the dot products (no tail predicate) over a static n the knobs'
    4 rows do not divide take the register tile of 3–8 rows that divides it with the most accumulators
    (CLIP's 77 tokens: 7 rows × 3 vectors, 21 accumulators, where the largest divisor up to 4 gave 1 × 4:
    a (1, 77, 768) layer 1.9× faster, Zen 4); n = 64 keeps the knobs' 4 × 4."""
    spec = AttentionSpec(batch=2, seq_len=n, num_heads=3, head_dim=64, d_model=192, causal=True, dtype="bfloat16")
    kernel = tvmattn.compile(spec, AVX512, tuned=False)
    tiles = []  # each projection's accumulator: (B, n / rows, rows, width / columns, columns)
    tvm_ffi.structural_walk(kernel.module["main"].body, [(SBlock, lambda b: tiles.extend(
        [int(d) for d in buf.shape] for buf in b.alloc_buffers if buf.name.endswith("_acc_local")))])
    assert len(tiles) == 4 and all(t[2] == rows and t[4] == vecs * 16 for t in tiles), tiles
    if _host_has("avx512_bf16"):
        assert_matches_oracle(kernel)


PANEL_CASES = (("float32", "BHSD"), ("float16", "BSHD"), ("bfloat16", "BHSD"), ("bfloat16", "BSHD"))
PANELS = [AttentionSpec(batch=2, seq_len=64, num_heads=2, head_dim=64, projections=False, dtype=dtype,
                        layout=layout) for dtype, layout in PANEL_CASES]
PANELS += [AttentionSpec(batch=1, seq_len=64, num_heads=2, d_model=128, dtype=d) for d in ("float32", "bfloat16")]
PANELS += [AttentionSpec(batch=2, seq_len="n", num_heads=2, head_dim=64, projections=False, dtype="bfloat16")]


def _own_assembly(kernel) -> str:
    """The kernel's assembly without the runtime helpers every module carries (__extendhfsf2, …)."""
    functions = re.split(r"^(?=[A-Za-z_][\w.]*:)", kernel.source(), flags=re.M)  # at each function's label
    return "".join(f for f in functions if not f.startswith("__"))


@pytest.mark.parametrize("spec,target", every_other_slow(PANELS, [AVX2, AVX512], ids=[
    f"{name}-{isa}" for name in ("fp32", "fp16-bshd", "bf16", "bf16-bshd", "fp32-layer", "bf16-layer", "bf16-symbolic")
    for isa in ("avx2", "avx512")]))
def test_query_panel_is_transposed_in_registers(target, spec):
    """QKᵀ's query panel, (d_k, q_tile) or the bf16 dot products' (d_k/2, q_tile, 2), copied in blocks
    of lanes × lanes words shuffled in registers (`isa.panels`): with AVX-512, no scatter (fp32) nor
    16-bit extract per element (bf16 pairs) is left; and the kernel matches the oracle (symbolic
    lengths: rows in whole blocks, `_padding`, the last one clamped)."""
    kernel = tvmattn.compile(spec, target)
    if target is AVX512:
        asm = _own_assembly(kernel)
        assert "vscatter" not in asm and "vpextrw" not in asm
    needs = "avx2" if target is AVX2 else "avx512_bf16" if spec.dtype == "bfloat16" else "avx512bw"
    if _host_has(needs):
        assert_matches_oracle(kernel, {name: 37 for name in spec.symbolic_dims})


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("preset", ["gpt2-small", "llama-gqa", "t5-cross"])
def test_projection_defaults_fit_registers_and_l2(target, preset):
    """The default projection tile: its accumulators, W vectors and the broadcast x fit the vector
    registers (16 with AVX2, 32 with AVX-512), and a task's W panel fits PANEL_BYTES where it can."""
    spec, tgt = PRESETS[preset], resolve_target(target)
    lanes = vector_lanes(tgt)
    knobs = default_knobs(spec, tgt)
    registers = isa_of(tgt).registers
    assert registers == (32 if lanes == 16 else 16)
    assert knobs["gemm_rows"] * knobs["gemm_vecs"] + knobs["gemm_vecs"] + 1 <= registers
    panel = spec.d_model * knobs["gemm_block_cols"] * knobs["gemm_vecs"] * lanes * 4
    assert panel <= PANEL_BYTES or knobs["gemm_block_cols"] == 1


@pytest.mark.parametrize("mcpu, dense_tile, masked_tile, pv_vecs", [("znver5", 64, 32, 4), ("znver4", 16, 16, 2)])
def test_fp32_takes_the_wide_tiles_where_fmas_are_512_bits_wide(mcpu, dense_tile, masked_tile, pv_vecs):
    """Zen 5's full-width AVX-512 FMAs take fp32 the 16-bit kernels' 64-query tiles (32 where causal)
    and 4-vector P·V tiles; Zen 4's FMAs, two 256-bit halves each, keep 16-query tiles. The wide
    tiles' fp32 kernel is checked against the oracle on this machine."""
    target = resolve_target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    dense = AttentionSpec(batch=2, seq_len=150, num_heads=4, num_kv_heads=2, head_dim=32, projections=False)
    for spec, tile in ((dense, dense_tile), (dense.replace(causal=True, window=40), masked_tile)):
        knobs = default_knobs(spec, target)
        assert (knobs["q_tile"], knobs["pv_vecs"]) == (tile, pv_vecs)
        assert_matches_oracle(tvmattn.compile(spec, "cpu", knobs=knobs))


@pytest.mark.parametrize("dtype, mcpu", [("float32", "znver5"), ("bfloat16", "znver4"), ("float16", "znver5")])
@pytest.mark.parametrize("d_v", [32, 64, 128])
def test_wide_pv_tiles_hold_16_accumulators(dtype, mcpu, d_v):
    """The wide P·V register tile keeps 16 of AVX-512's 32 registers accumulating, whatever d_v: two
    pipes of FMAs or dot products, a few cycles of latency each, need that many in flight (a d_k = 32
    tile of 4 rows × 2 vectors ran bf16 at 0.85× the 8-row one). The narrow-d_v kernel is checked
    against the oracle on this machine."""
    target = resolve_target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    spec = AttentionSpec(batch=1, seq_len=96, num_heads=2, head_dim=d_v, projections=False, dtype=dtype)
    knobs = default_knobs(spec, target)
    assert knobs["pv_rows"] * min(knobs["pv_vecs"], d_v // 16) == 16
    if d_v == 32:
        assert_matches_oracle(tvmattn.compile(spec, "cpu", tuned=False))


@pytest.mark.parametrize("spec", PANELS[:3] + PANELS[4:6],
                         ids=["fp32", "fp16-bshd", "bf16", "fp32-layer", "bf16-layer"])
def test_qk_register_tile_is_stored_from_registers(spec):
    """QKᵀ's accumulators (``scores_local``) are read and written at constant indices only: the
    tile's store is unrolled like its update, so LLVM keeps the tile in registers. A store loop over
    the tile left it a stack array, zeroed before and spilled after every register tile: 32 extra
    stores per 16 accumulators, 7–10 % of a bf16 kernel at d_k = 32–64."""
    lowered = lower(*schedule_attention(spec, resolve_target(AVX512))[:1], resolve_target(AVX512)).script()
    indices = re.findall(r"scores_local\[([^\]]*)\]", lowered)
    assert indices and all(index.isdigit() for index in indices), sorted(set(indices))


@pytest.mark.parametrize("case,dtype", every_other_slow([
    (128, None, 2, {"w_q", "w_k", "w_v", "w_o"}), ("n", None, 1, {"w_q", "w_k", "w_v", "w_o"}),
    (40, 136, 2, {"w_k", "w_v"}), (64, None, 2, set())], ["float32", "float16", "bfloat16"]))
def test_avx2_projections_read_w_in_register_tile_panels(case, dtype):
    """With AVX2, a projection of 128 rows or more (or symbolic) copies its W into panels of the
    register tile's 3 vectors of columns, one run of memory along the reduction; fewer rows read W in
    place (the copy would cost more than it saves). A bf16 panel keeps W's 16 bits (TVM widens a
    function's own bf16 buffers to fp32). Either way, the oracle's result."""
    seq_len, kv_seq_len, kv_heads, panels = case
    spec = AttentionSpec(batch=1, seq_len=seq_len, kv_seq_len=kv_seq_len, num_heads=2, num_kv_heads=kv_heads,
                         head_dim=24, d_model=48, causal=kv_seq_len is None, dtype=dtype)
    target = resolve_target(AVX2)
    mod = schedule_attention(spec, target, tuned=False)[0]
    copied = {w for w in ("w_q", "w_k", "w_v", "w_o")
              if re.search(rf"{w}_global = T.sblock_alloc_buffer\(\(\d+, 48, 24\)", mod.script())}
    assert copied == panels
    widened = re.search(r'w_\w_global = T.alloc_buffer\(\(\d+,\), "float32', lower(mod, target).script())
    assert dtype != "bfloat16" or not widened
    kernel = tvmattn.compile(spec, target, tuned=False)
    for n in (1, 17, 130) if seq_len == "n" else (None,):
        assert_matches_oracle(kernel, {"n": n} if n else None)



def on(mcpu: str) -> dict:
    return {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}


NAMED = [(spec, "cpu") for spec in DECODE + SHAPES] + [
    (SHAPES[0].replace(dtype="bfloat16"), on("znver4")),  # bf16 dot products (vdpbf16ps)
    (SHAPES[0].replace(dtype="bfloat16"), on("sapphirerapids")),  # AMX tiles
    (DECODE[0].replace(dtype="float16", head_dim=128), "cpu"),  # a 16-bit V row in one pass
]


NAMED_IDS = ["many-heads", "split-k-gqa-padding", "split-k-window", "three-queries", "gqa-causal-tail",
             "cross-window-padding-bshd", "layer-symbolic", "bf16-dots", "bf16-amx", "fp16-decode"]
# 20, 12, 13, 7 and 7 s: -m slow (the last two shapes run in the default run's knob extremes)
SLOW_NAMED = ("layer-symbolic", "bf16-amx", "bf16-dots", "gqa-causal-tail", "cross-window-padding-bshd")


@pytest.mark.parametrize("spec,target", [pytest.param(*case, id=name, marks=[pytest.mark.slow] if name in SLOW_NAMED
                                                      else []) for case, name in zip(NAMED, NAMED_IDS)])
def test_schedule_names_the_knobs_its_kernel_reads(spec, target):
    """`kernel.schedule` lists a knob only if another of its choices builds another kernel (the
    scheduled TIR's hash), so a user reading it knows what a tuning record changes."""
    target = resolve_target(target)
    base = default_knobs(spec, target)
    named = set(re.findall(r"(\w+)=", schedule_attention(spec, target, base)[1]))
    for knob in cpu.KNOBS:
        hashes = {tvm_ffi.structural_hash(schedule_attention(spec, target, {**base, knob.name: c})[0])
                  for c in knob.choices}
        assert (len(hashes) > 1) == (knob.name in named), knob.name


@pytest.mark.parametrize("spec,target,lanes", [
    (DECODE[0], "cpu", None),  # a task per head
    (DECODE[1], "cpu", None),  # split-K, key padding
    (DECODE[2].replace(dtype="bfloat16"), "cpu", None),  # d_k = 48: 16 lanes (AVX-512) or 8
    (DECODE[0].replace(dtype="float16", head_dim=40), "cpu", None),  # d_k = 40: 8 lanes
    (DECODE[0].replace(kv_seq_len="L"), AVX2, 8),  # a symbolic KV cache
])
def test_decode_scores_sum_their_lanes_in_a_tree(spec, target, lanes):
    """A decode key's partial sums along d_k are added by halves (`isa.lane_sums`): log2(lanes) rounds
    of shuffles in the scheduled TIR, no serial reduction over the lanes; and the oracle's result."""
    target = resolve_target(target)
    lanes = lanes or min(vector_lanes(target), max(w for w in (16, 8, 4, 2) if spec.d_k % w == 0))
    script = schedule_attention(spec, target, tuned=False)[0].script()
    halves = [len(m.split(",")) for m in re.findall(r"\], \[([0-9, ]+)\]\)", script)]
    assert sorted(set(halves)) == [lanes >> r for r in range(lanes.bit_length() - 1, 0, -1)]
    assert not re.search(r"scores\[[^]]*\] \+ scores_rf\[", script)  # (the serial sum's update)
    kernel = tvmattn.compile(spec, target, tuned=False)
    assert_matches_oracle(kernel, {"L": 77} if spec.n_kv == "L" else None)
