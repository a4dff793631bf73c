"""CUDA schedule of the online-softmax attention template (`tvmattn.compiler.flash`).

One thread block per (batch, KV head, q_rows rows, key split); ``warps`` warps. Memory:

    shared.dyn   Q (q_rows, d_k), K and V tiles (kv_tile, ·), S (q_rows, kv_tile) fp32, PV (q_rows, d_v)
    shared       P (q_rows, kv_tile), the row statistics m, l, tile_max, tile_sum, alpha …
    registers    O, O_new: each thread owns the same (rows, columns) tile in every O stage

fp16/bf16 run both GEMMs on tensor cores (wmma 16×16×16, fp32 accumulation: S_acc and PV_acc are
accumulator fragments stored to S and PV); fp32 runs them on CUDA cores, each thread accumulating a
register tile. Row maxima and sums are warp reductions (a warp per row at a time, shuffles). With
``stages`` = 2 the K/V loads of tile j+1 are issued (cp.async on sm_80+) while tile j is computed.

Why two kinds of shared memory: TVM's barrier planner treats every shared.dyn buffer as one, so a
stage that reads one shared.dyn buffer and writes another gets a barrier per loop iteration, and a
thread-dependent branch writing shared.dyn cannot be synchronised at all. Stages that write under a
branch (one lane per row) or read S while writing P therefore use static shared buffers.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from types import ModuleType
from typing import Mapping

import tvm
from tvm import tirx
from tvm.s_tir import Schedule, TensorIntrin, dlight
from tvm.target import Target

from tvmattn.compiler.errors import TvmAttnError
from tvmattn.compiler.flash import FlashTiles, flash_attention
from tvmattn.compiler.layer import layer_around
from tvmattn.compiler.paged import PagedSpec
from tvmattn.compiler.spec import AttentionSpec
from tvmattn.compiler.te_attention import AttentionTE, attention_te
from tvmattn.schedules.knobs import Knob, KnobValue
from tvmattn.schedules.rule import AttentionRule

KNOBS = (
    Knob("q_rows", (16, 32, 64, 128), 64, "rows (query, query head of the KV group) per thread block",
         shapes_workload=True),
    Knob("kv_tile", (16, 32, 64, 128), 64, "keys per online-softmax step", shapes_workload=True),
    Knob("kv_splits", (1, 2, 4, 8, 16, 32, 64), 1,
         "thread blocks sharing one row block's keys (split-K, for decode)", shapes_workload=True),
    Knob("warps", (1, 2, 4, 8), 4, "warps per thread block"),
    Knob("stages", (1, 2), 2, "K/V tiles in flight (2: double-buffered, async copies on sm_80+)",
         shapes_workload=True),
)

WARP = 32
DECODE_ROWS = 16  # at most this many (query, head) rows: the split-K decode variant
ROW_STATS = ("m", "l", "m_new", "l_new", "alpha", "tile_max", "tile_sum")
_SHARED_DYN = ("Q", "K", "V", "S", "PV")
PIPELINED_LOADS = ("k_load", "v_load")  # the template blocks of a key step that run one tile ahead


class CudaFlashAttention(AttentionRule):
    name = "cuda"  # the name tuning records carry
    target_kind = "cuda"
    KNOBS = KNOBS

    def defaults(self, spec: AttentionSpec, target: Target) -> dict[str, int]:
        """Knobs by arch, dtype and head width. Shared memory per block: sm_80 163 KiB, sm_89 99 KiB,
        sm_90 227 KiB; the K/V tiles are double-buffered, S and PV are fp32."""
        sm, width, half = _sm(target), max(spec.d_k, spec.d_v), spec.dtype != "float32"
        knobs = {"q_rows": 64, "kv_tile": 64 if half else 32, "kv_splits": 1, "warps": 4,
                 "stages": 1 if spec.key_padding else 2}
        if isinstance(spec.n_q, int) and spec.n_q * spec.group <= DECODE_ROWS:
            n_kv = spec.n_kv if isinstance(spec.n_kv, int) else 4096
            splits = max(1, min(32, n_kv // (4 * knobs["kv_tile"])))  # ≥ 4 key tiles per split
            knobs.update(q_rows=DECODE_ROWS, kv_splits=1 << (splits.bit_length() - 1))  # a knob choice
        elif width > 64:
            knobs.update(warps=4 if half else 8)
            if sm in (86, 87, 89):  # 99 KiB of shared memory: smaller K/V tiles
                knobs.update(kv_tile=32 if half else 16)
        return knobs

    def describe(self, spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue]) -> str:
        """Which kernel ``apply`` builds for ``spec``, with its knobs."""
        gemms = "wmma tensor cores" if tensor_cores(spec, knobs) else "CUDA cores"
        kind = "split-K decode" if int(knobs["kv_splits"]) > 1 else "online softmax"
        layer = " + dlight projections" if spec.projections else ""
        return f"flash {kind} on {gemms}{layer}: " + " ".join(f"{k.name}={knobs[k.name]}" for k in KNOBS)

    def apply(self, sch: Schedule, spec: AttentionSpec, target: Target,
              knobs: Mapping[str, KnobValue]) -> Schedule | None:
        """Schedule the template made by `workload` with the same knobs (in place); for a full layer,
        return the layer built around it (`layer_around`, dlight GEMMs)."""
        if not self.applies(spec, target):
            return None
        if int(knobs["stages"]) > 1 and spec.key_padding:
            raise TvmAttnError("stages=2 needs a key-tile count TVM's software pipeliner can analyse; key "
                               "padding makes it depend on kv_lens: use stages=1")
        k = _Kernel(sch, spec, knobs)
        if tensor_cores(spec, knobs) and k.rows % (16 * k.threads // WARP):
            raise TvmAttnError(f"tensor cores give each warp 16-row tiles: q_rows={k.rows} cannot be shared by "
                               f"{k.threads // WARP} warps; use q_rows a multiple of {16 * k.threads // WARP} "
                               f"or fewer warps")
        k.thread_blocks()
        k.loads()
        k.row_stages()
        if tensor_cores(spec, knobs):
            k.tensor_core_gemm("s_gemm", "s_store", ("Q", "K"), transposed_b=True)
            k.tensor_core_gemm("pv", "pv_store", ("P", "V"), transposed_b=False)
        else:
            k.register_gemm("s_gemm", "s_store")
            k.register_gemm("pv", "pv_store")
        k.output_stages()
        if int(knobs["stages"]) > 1:
            k.pipeline(async_copy=_sm(target) >= 80)
        if int(knobs["kv_splits"]) > 1:
            k.combine_stages()
        if spec.projections:
            return Schedule(layer_around(spec, _layer_te(spec), sch.mod["main"], gemm=lambda f: _matmul(f, target)))
        return sch

    def workload(self, spec: AttentionSpec, target: Target, knobs: Mapping[str, KnobValue]) -> tirx.PrimFunc:
        """The core template these knobs shape, with this schedule's buffer placement; for a full layer
        it reads and writes packed heads, with the layer's symbolic sizes."""
        tiles = FlashTiles(int(knobs["q_rows"]), int(knobs["kv_tile"]), int(knobs["kv_splits"]), int(knobs["stages"]))
        dims = _layer_te(spec).dims if spec.projections else None
        return flash_attention(spec, tiles, packed=spec.projections, scopes=scopes(spec, knobs), dims=dims)


def schedule_paged(paged: PagedSpec, target: Target) -> tuple[tvm.IRModule, str]:
    """A paged cache's kernel on CUDA: the template reading K and V through the block table
    (`flash_attention(paged=…)`), scheduled as the dense attention of the same spec (`paged.attention`:
    key padding, so one stage: the key tiles a sequence has depend on its length), default knobs."""
    rule, spec = CudaFlashAttention(), paged.attention
    knobs = rule.defaults(spec, target)
    tiles = FlashTiles(int(knobs["q_rows"]), int(knobs["kv_tile"]), int(knobs["kv_splits"]), int(knobs["stages"]))
    sch = Schedule(tvm.IRModule({"main": flash_attention(spec, tiles, scopes=scopes(spec, knobs), paged=paged)}))
    rule.apply(sch, spec, target, knobs)
    return sch.mod, f"paged {paged.kv_layout} page={paged.page_size}, " + rule.describe(spec, target, knobs)


def tensor_cores(spec: AttentionSpec, knobs: Mapping[str, KnobValue]) -> bool:
    """fp16/bf16 GEMMs on wmma tensor cores, which need 16-row tiles per warp (not for decode)."""
    return spec.dtype in ("float16", "bfloat16") and int(knobs["q_rows"]) > DECODE_ROWS


def scopes(spec: AttentionSpec, knobs: Mapping[str, KnobValue]) -> dict[str, str]:
    """Where each template buffer lives (see the module docstring)."""
    out = {name: "shared.dyn" for name in _SHARED_DYN}
    out.update({name: "shared" for name in ROW_STATS + ("P",)})
    acc = "wmma.accumulator" if tensor_cores(spec, knobs) else "local"
    out.update(S_acc=acc, PV_acc=acc, O="local", O_new="local")
    if not tensor_cores(spec, knobs):
        out["PV"] = "local"
    return out


def _matmul(func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc:
    """dlight's Matmul rule, on CUDA cores: its tensor-core variant fails on the fp32→fp16 cast
    epilogue of a projection in TVM 0.27."""
    with target:
        rules = dlight.ApplyDefaultSchedule(dlight.gpu.Matmul(), dlight.gpu.Fallback())
        return rules(tvm.IRModule({"main": func.with_attr("dlight.do_not_tensorize", True)}))["main"]


@functools.lru_cache(maxsize=16)
def _layer_te(spec: AttentionSpec) -> AttentionTE:
    """The layer's tensor expression, once per spec: its projections and the core template then share
    one set of symbolic size variables."""
    return attention_te(spec)


class _Kernel:
    """The schedule steps, sharing the schedule and the thread shape."""

    def __init__(self, sch: Schedule, spec: AttentionSpec, knobs: Mapping[str, KnobValue]) -> None:
        self.sch, self.spec, self.knobs = sch, spec, knobs
        self.warps = knobs["warps"]  # a plain int, or a sampled variable: it goes into splits only
        self.threads = WARP * (self.warps if isinstance(self.warps, int) else int(sch.get(self.warps)))
        self.rows, self.kv_tile = int(knobs["q_rows"]), int(knobs["kv_tile"])
        self.vec = _vector_lanes(spec)

    def loops(self, block: str, inner: int) -> list:
        return self.sch.get_loops(self.sch.get_sblock(block))[-inner:]

    def bind(self, loop, vec: int = 1) -> None:
        """Spread ``loop`` over all threads of the block (``vec`` consecutive iterations per thread)."""
        parts = self.sch.split(loop, [None, self.warps, WARP] + ([vec] if vec > 1 else []))
        self.sch.bind(parts[1], "threadIdx.y")
        self.sch.bind(parts[2], "threadIdx.x")
        if vec > 1:
            self.sch.vectorize(parts[3])

    def thread_blocks(self) -> None:
        flash = self.sch.get_sblock("flash")
        self.sch.bind(self.sch.fuse(*self.sch.get_loops(flash)), "blockIdx.x")

    def loads(self) -> None:
        for name in ("q_load", "k_load", "v_load"):
            self.bind(self.sch.fuse(*self.loops(name, 2)), self.vec)

    def row_stages(self) -> None:
        for name in ("init_state", "rescale", "l_update", "state_update"):
            self.bind(self.loops(name, 1)[0])
        for name in ("row_max", "row_sum"):  # a warp per row, lanes along the keys, shuffles to combine
            r, t = self.loops(name, 2)
            r_out, r_warp = self.sch.split(r, [None, self.warps])
            t_out, t_lane = self.sch.split(t, [None, WARP])
            self.sch.reorder(r_warp, r_out, t_out, t_lane)
            self.sch.bind(r_warp, "threadIdx.y")
            self.sch.bind(t_lane, "threadIdx.x")
        self.bind(self.sch.fuse(*self.loops("probs", 2)))

    def thread_tile(self, name: str, width: int, reduction: bool = False):
        """Each thread owns a (tr, tc) tile of a (q_rows, width) stage, the same in every stage of
        that width, so values stay in the owner's registers; returns the block and its k loop."""
        tr, tc = _thread_tile(self.rows, width, self.threads)
        block = self.sch.get_sblock(name)
        loops = self.sch.get_loops(block)
        (x, y), k = (loops[-3:-1], loops[-1]) if reduction else (loops[-2:], None)
        xo, xi = self.sch.split(x, [None, tr])
        yo, yi = self.sch.split(y, [None, tc])
        if reduction:
            self.sch.reorder(xo, yo, k, xi, yi)
        else:
            self.sch.reorder(xo, yo, xi, yi)
        ty, tx = self.sch.split(self.sch.fuse(xo, yo), [self.warps, WARP])
        self.sch.bind(ty, "threadIdx.y")
        self.sch.bind(tx, "threadIdx.x")
        self.sch.unroll(xi)
        self.sch.unroll(yi)
        return block, k

    def register_gemm(self, gemm: str, store: str) -> None:
        width = self.kv_tile if gemm == "s_gemm" else self.spec.d_v
        block, k = self.thread_tile(gemm, width, reduction=True)
        self.sch.decompose_reduction(block, k)
        self.thread_tile(store, width)

    def tensor_core_gemm(self, gemm: str, store: str, operands: tuple[str, str], transposed_b: bool) -> None:
        """C = A·B (or A·Bᵀ) in 16×16×16 wmma tiles: warps split the row tiles, each warp keeps the
        accumulators of its rows × all columns and loads every A fragment once per k step."""
        sch = self.sch
        block = sch.get_sblock(gemm)
        i, j, k = sch.get_loops(block)[-3:]
        i0, i1 = sch.split(i, [None, 16])
        j0, j1 = sch.split(j, [None, 16])
        k0, k1 = sch.split(k, [None, 16])
        sch.reorder(i0, k0, j0, i1, j1, k1)
        tile = sch.blockize(i1)
        warp, i0 = sch.split(i0, [self.warps, None])
        sch.bind(warp, "threadIdx.y")
        place = scopes(self.spec, self.knobs)
        group = wmma_intrinsics(self.spec.dtype, place[operands[0]], place[operands[1]], place[_written(sch, store)],
                                transposed_b=transposed_b)
        a, b = (_read_index(sch, tile, name) for name in operands)
        frag_a = sch.cache_read(tile, a, "wmma.matrix_a", consumer_blocks=[tile])
        frag_b = sch.cache_read(tile, b, "wmma.matrix_b", consumer_blocks=[tile])
        sch.compute_at(frag_a, k0)
        sch.compute_at(frag_b, j0)
        for frag, name in ((frag_a, "load_a"), (frag_b, "load_b")):
            sch.tensorize(sch.get_loops(frag)[-2], group[name])
        init = sch.decompose_reduction(tile, k0)
        sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], group["init"])
        sch.tensorize(sch.get_loops(block)[-3], group["compute"])
        x, y = self.loops(store, 2)
        x0, x1 = sch.split(x, [None, 16])
        y0, y1 = sch.split(y, [None, 16])
        sch.reorder(x0, y0, x1, y1)
        warp, x0 = sch.split(x0, [self.warps, None])
        sch.bind(warp, "threadIdx.y")
        sch.tensorize(x1, group["store"])

    def output_stages(self) -> None:
        names = ["o_init", "o_update", "o_copy", "o_store" if int(self.knobs["kv_splits"]) == 1 else "o_partial"]
        for name in names:
            self.thread_tile(name, self.spec.d_v)
        if int(self.knobs["kv_splits"]) > 1:
            self.bind(self.loops("ml_partial", 1)[0])

    def pipeline(self, async_copy: bool) -> None:
        """Load K/V tile j+1 while tile j is computed: the loads in stage 0, the rest of the step in 1."""
        step = self.sch.get_sblock("kv_step")
        j = self.sch.get_loops(step)[-1]
        names = [self.sch.get(block).name_hint for block in self.sch.get_child_blocks(step)]
        self.sch.annotate(j, "software_pipeline_stage", [0 if name in PIPELINED_LOADS else 1 for name in names])
        self.sch.annotate(j, "software_pipeline_order", list(range(len(names))))
        if async_copy:
            self.sch.annotate(j, "software_pipeline_async_stages", [0])

    def combine_stages(self) -> None:
        for name, inner in (("split_max", 4), ("split_sum", 4), ("split_combine", 5), ("split_store", 4)):
            loops = self.loops(name, inner)
            spatial = loops[:-1] if name != "split_store" else loops
            fused = self.sch.fuse(*spatial)
            block_x, thread_x = self.sch.split(fused, [None, WARP * 4])
            self.sch.bind(block_x, "blockIdx.x")
            self.sch.bind(thread_x, "threadIdx.x")


def wmma_intrinsics(dtype: str, a_scope: str, b_scope: str, c_scope: str, transposed_b: bool) -> dict[str, str]:
    """Names of the 16×16×16 wmma intrinsics for A (a_scope) · B or Bᵀ (b_scope) → C (c_scope), fp32
    accumulation. TVM registers the fp16 ones; the bf16 ones (sm_80+) are made here from its generators."""
    intrin = _cuda_intrinsics()
    short = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    trans = "_trans" if transposed_b else ""
    names = {
        "load_a": (f"wmma_load_16x16x16_{short}_a_{_flat(a_scope)}",
                   lambda: intrin.get_wmma_load_intrin(16, 16, 16, dtype, a_scope, False, False)),
        "load_b": (f"wmma_load_16x16x16_{short}_b{trans}_{_flat(b_scope)}",
                   lambda: intrin.get_wmma_load_intrin(16, 16, 16, dtype, b_scope, True, transposed_b)),
        "compute": (f"wmma_sync_16x16x16_{short}{short}f32{trans}",
                    lambda: intrin.get_wmma_sync_intrin(16, 16, 16, dtype, "float32", transposed_b)),
        "init": ("wmma_fill_16x16x16_f32", None),
        "store": (f"wmma_store_16x16x16_f32_{_flat(c_scope)}", None),
    }
    for name, make in names.values():
        if make is not None and TensorIntrin.get(name, allow_missing=True) is None:
            TensorIntrin.register(name, *make())
    return {role: name for role, (name, _) in names.items()}


@functools.cache
def _cuda_intrinsics() -> ModuleType:
    """TVM's CUDA tensor intrinsics (``tvm.s_tir.tensor_intrin.cuda``), loaded on first use and
    without its package: the package imports every target's intrinsics, about a minute here, and
    ``import tvmattn`` must not pay even the CUDA module's few seconds."""
    name = "tvm.s_tir.tensor_intrin.cuda"
    if name not in sys.modules:  # registered under its own name: a later package import reuses it
        path = importlib.util.find_spec("tvm.s_tir").submodule_search_locations[0] + "/tensor_intrin/cuda.py"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    return sys.modules[name]


def _written(sch: Schedule, block: str) -> str:
    return sch.get(sch.get_sblock(block)).writes[0].source.name


def _read_index(sch: Schedule, block, buffer: str) -> int:
    return next(i for i, region in enumerate(sch.get(block).reads) if region.source.name == buffer)


def _flat(scope: str) -> str:
    return scope.replace(".", "_")


def _vector_lanes(spec: AttentionSpec) -> int:
    """Elements per load: 16 bytes, or fewer where the head widths are not a multiple of that."""
    lanes = 128 // tvm.DataType(spec.dtype).bits
    while spec.d_k % lanes or spec.d_v % lanes:
        lanes //= 2
    return lanes


def _thread_tile(rows: int, width: int, threads: int) -> tuple[int, int]:
    """(tr, tc) with (rows/tr)·(width/tc) = threads, tc a power of two up to 8."""
    per_thread = rows * width // threads
    if per_thread < 1 or rows * width % threads:
        raise TvmAttnError(f"a {rows}×{width} tile cannot be shared by {threads} threads: "
                           f"use more q_rows or fewer warps")
    tc = 1
    while tc < 8 and width % (tc * 2) == 0 and per_thread % (tc * 2) == 0:
        tc *= 2
    tr = per_thread // tc
    if rows % tr:
        raise TvmAttnError(f"a {rows}×{width} tile cannot be shared by {threads} threads")
    return tr, tc


def _sm(target: Target) -> int:
    arch = str(target.attrs.get("arch", "sm_90"))
    return int(arch[3:].rstrip("a"))
