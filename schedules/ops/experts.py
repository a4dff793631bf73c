"""A mixture of experts' matmul by gathered weights, rewritten in Relax before legalisation.

transformers' exportable MoE forward (``experts_implementation="batched_mm"``: Mixtral, Qwen2-MoE, GPT-OSS
exported by dynamo) selects each routed token's expert weights and multiplies them one token at a time:

    W_s = W[expert_ids]              gather_nd (or take): (S, O, K), a copy of an expert's matrix per token
    y   = W_s @ x_s                  (S, O, K) · (S, K, 1), or x_s (S, 1, K) · W_s (S, K, O)

The copy is S times an expert's weights (Mixtral's 2 × 128 tokens × top-2: 1.5 GB a layer), then a
batched GEMV reads it once: ~700 ms of Mixtral's 800 (ONNX Runtime and OpenVINO copy it too). Rewritten,
no copy is made (`_experts_gemv`): each expert's weights stay where they are (one constant, in 16 bits
for a 16-bit import or export) and a tile of up to 64 outputs of expert e is computed for the tokens
routed to e while the tile is in cache. The rows are sorted by expert first (in the kernel), so that a
pass over the tile serves a block of an expert's rows: each weight vector loaded once for that many
products. A bf16 one on the record's dot product (`Isa.dot`: ``vdpbf16ps``; W packed in pairs), else
widened to fp32 FMAs; a 16-bit import rounds x as its GEMMs round their activations. The indices arrive
checked in range (`run_checks.gather_nd`, `gather`); a row whose index named no expert would be left
unwritten, never read from outside W.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from tvmattn.compiler.annotations import IS_SCHEDULED, OP_PATTERN, OPAQUE, WRITTEN_AS
from tvmattn.compiler.isa.record import Dot, Isa
from tvmattn.schedules.ops.rewrite import dims, rewrite_functions

LANES = 16  # fp32 lanes of the widest vectors this targets (a tile is 1–4 of them)
MAX_ROWS = 8  # an expert's rows per pass over a tile's weights, at most (the accumulators take half the registers)
_GATHERS = ("relax.gather_nd", "relax.take")
_FLOATS = ("float32", "float16", "bfloat16")  # the graph's (a 16-bit export's weights and activations too)
_STORED = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}  # a 16-bit import's fp32 weights, converted


def gathered_matmuls(dtype: str | None = None, isa: Isa | None = None) -> tvm.transform.Pass:
    """The pass rewriting matmuls by expert weights gathered per token (a constant (E, ·, ·) gathered along
    its experts) into `_experts_gemv` for the instruction set ``isa``; with ``dtype`` "bfloat16", the
    weights are stored in bf16."""

    @tvm.transform.module_pass(opt_level=0, name="tvmattn.GatheredMatmuls")
    def transform(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return _GatheredMatmuls(mod, dtype, isa).run()

    return transform


@relax.expr_functor.mutator
class _GatheredMatmuls(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, dtype: str | None, isa: Isa | None) -> None:
        super().__init__(mod)
        self.mod_, self.dtype, self.isa = mod, dtype, isa

    def run(self) -> tvm.IRModule:
        return rewrite_functions(self, self.mod_)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") != "relax.matmul" or str(call.ty.dtype) not in _FLOATS:
            return call
        a, b = call.args
        for gathered, x, left in ((a, b, True), (b, a, False)):
            found = self._experts(gathered)
            if found is None:
                continue
            weights, ids = found
            rows = dims(x)
            # left: W_s (S, O, K) · x (S, K, 1); right: x (S, 1, K) · W_s (S, K, O)
            k = weights.shape[2] if left else weights.shape[1]
            if rows is None or len(rows) != 3 or str(x.ty.dtype) != str(call.ty.dtype) \
                    or not _is(rows[2 if left else 1], 1) or not _is(rows[1 if left else 2], k) \
                    or not tvm.sym.Analyzer().can_prove_equal(rows[0], dims(ids)[0]):
                continue
            panel = weights.transpose(0, 2, 1) if left else weights  # (E, K, O)
            if panel.shape[2] % LANES:
                continue
            return self._gemv(x, ids, panel, rows[0], left)
        return call

    def _experts(self, gathered: relax.Expr) -> tuple[np.ndarray, relax.Expr] | None:
        """(W (E, ·, ·), the per-token expert ids (S,)) where ``gathered`` is W[ids] of a constant W."""
        value = self.lookup_binding(gathered) if isinstance(gathered, relax.Var) else gathered
        if not isinstance(value, relax.Call) or getattr(value.op, "name", "") not in _GATHERS:
            return None
        w, ids = value.args
        if not isinstance(w, tvm.ir.GenericConst) or len(w.ty.shape) != 3 or str(w.ty.dtype) not in _FLOATS:
            return None
        sizes = dims(ids)
        if value.op.name == "relax.gather_nd":  # ids (S, 1): one coordinate, the expert
            if int(value.attrs.batch_dims) != 0 or sizes is None or len(sizes) != 2 or not _is(sizes[1], 1):
                return None
            ids = self.builder_.emit(relax.op.reshape(ids, [sizes[0]]))
        elif int(value.attrs.axis) != 0 or sizes is None or len(sizes) != 1:  # take(W, ids (S,), axis=0)
            return None
        if str(ids.ty.dtype) not in ("int32", "int64"):
            return None
        return w.value.numpy(), ids

    def _gemv(self, x: relax.Expr, ids: relax.Expr, panel: np.ndarray, rows, left: bool) -> relax.Expr:
        experts, k, o = panel.shape
        tile = next(t for t in (4 * LANES, 2 * LANES, LANES) if o % t == 0)  # (8 vectors: slower, out of L1)
        narrow = panel.dtype == np.float32 and self.dtype in _STORED
        stored = panel.astype(_STORED[self.dtype]) if narrow else panel
        dot = self.isa.dot if self.isa is not None else None
        paired = dot is not None and stored.dtype == ml_dtypes.bfloat16 and k % dot.pair == 0 and tile % dot.lanes == 0
        pair = dot.pair if paired else 1
        # (E, O / tile, K / pair, tile, pair): a tile's weights contiguous (strided by O, its rows shared a
        # cache set), a dot product's pairs of the reduction side by side
        packed = stored.reshape(experts, k // pair, pair, o // tile, tile).transpose(0, 3, 1, 4, 2)
        flat = self.builder_.emit(relax.op.reshape(x, [rows, k]))
        if narrow:  # a 16-bit import's activations: rounded as its GEMMs round theirs (`precision.matmuls_in`)
            flat = self.builder_.emit(relax.op.astype(flat, self.dtype))
        lanes, registers = (self.isa.bits // 32, self.isa.registers) if self.isa is not None else (LANES, 32)
        block = max(1, min(MAX_ROWS, registers // 2 // max(1, tile // lanes)))
        func = _experts_gemv(experts, k, o, tile, str(stored.dtype), str(ids.ty.dtype), str(flat.ty.dtype),
                             block, dot if paired else None)
        gv = self.builder_.add_func(func, "experts_gemv")
        out = self.builder_.emit(relax.call_tir(gv, [flat, ids, relax.const(np.ascontiguousarray(packed))],
                                                relax.TensorType([rows, o], "float32")))
        if str(x.ty.dtype) != "float32":  # (a 16-bit graph: its product in its dtype, summed in fp32)
            out = self.builder_.emit(relax.op.astype(out, str(x.ty.dtype)))
        return relax.op.reshape(out, [rows, o, 1] if left else [rows, 1, o])


def _experts_gemv(experts: int, k: int, o: int, tile: int, w_dtype: str, id_dtype: str, x_dtype: str,
                  block: int, dot: Dot | None) -> tirx.PrimFunc:
    """out[s, :] = x[s, :] · W[ids[s]], W (E, K, O) packed as w (E, O / tile, K / pair, tile, pair): the rows
    sorted by expert (``order``; expert e's are order[start[e]:start[e + 1]]), then per tile of outputs
    (parallel), per expert, per ``block`` of its rows, one pass over the tile's weights; ``dot``: on its
    instruction (pairs of bf16), else fp32 FMAs."""
    pair, lanes = (dot.pair, dot.lanes) if dot is not None else (1, LANES)
    vectors, steps = tile // lanes, k // pair

    def product(acc, x, row, c, w, e, t, v):
        """acc + x[row, c-th pair] · w[e, t, c, v-th vector of the tile] (``lanes`` fp32 lanes)."""
        weights = w.vload([e, t, c, v * lanes, 0], f"{w_dtype}x{lanes * pair}")
        if dot is None:
            return acc + T.broadcast(T.Cast("float32", x[row, c]), lanes) * T.Cast(f"float32x{lanes}", weights)
        words = T.reinterpret(x.vload([row, c * pair], f"bfloat16x{pair}"), dtype="int32")
        return T.call_pure_extern(f"float32x{lanes}", dot.function, acc,
                                  T.reinterpret(weights, dtype=f"int32x{lanes}"), T.broadcast(words, lanes))

    @T.prim_func(private=True, s_tir=True)
    def gemv(x_h: T.handle, ids_h: T.handle, w_h: T.handle, out_h: T.handle):
        s = T.int64()
        x = T.match_buffer(x_h, (s, k), x_dtype)
        ids = T.match_buffer(ids_h, (s,), id_dtype)
        w = T.match_buffer(w_h, (experts, o // tile, steps, tile, pair), w_dtype)
        out = T.match_buffer(out_h, (s, o), "float32")
        with T.sblock("root"):
            order = T.sblock_alloc_buffer((s,), "int64")
            start = T.sblock_alloc_buffer((experts + 1,), "int64")
            with T.sblock("sort"):  # each expert's rows side by side, in order (a row of no expert in none)
                T.reads(ids[0:s])  # (declared: inferred, they would name the block's own buffers)
                T.writes(order[0:s], start[0:experts + 1])
                placed = T.sblock_alloc_buffer((1,), "int64", scope="local")
                placed[0] = T.int64(0)
                for e in range(experts):
                    start[e] = placed[0]
                    for r in range(s):
                        if ids[r] == T.Cast(id_dtype, e):
                            order[placed[0]] = r
                            placed[0] = placed[0] + T.int64(1)
                start[experts] = placed[0]
            for t in T.parallel(o // tile, annotations={"pragma_import_llvm": dot.llvm} if dot is not None else {}):
                for e in range(experts):
                    for b in range((start[e + 1] - start[e] + block - 1) // block):
                        with T.sblock("rows"):
                            T.reads(order[0:s], start[0:experts + 1], x[0:s, 0:k], w[e, t, 0:steps, 0:tile, 0:pair])
                            T.writes(out[0:s, t * tile:t * tile + tile])
                            acc = T.sblock_alloc_buffer((block, tile), "float32", scope="local")
                            row = T.sblock_alloc_buffer((block,), "int64", scope="local")
                            for i in T.unroll(block):  # a block's last row repeated past the expert's end
                                row[i] = order[T.min(start[e] + b * block + i, start[e + 1] - 1)]
                            for i in T.unroll(block):
                                for j in T.vectorized(tile):
                                    acc[i, j] = T.float32(0)
                            for c in range(steps):
                                for v in T.unroll(vectors):
                                    for i in T.unroll(block):
                                        acc[i, T.ramp(v * lanes, 1, lanes)] = product(
                                            acc[i, T.ramp(v * lanes, 1, lanes)], x, row[i], c, w, e, t, v)
                            for i in T.unroll(block):
                                if start[e] + b * block + i < start[e + 1]:
                                    for j in T.vectorized(tile):
                                        out[row[i], t * tile + j] = acc[i, j]

    # opaque: Relax's fusion must not look into it; scheduled: the rules leave it as written
    return gemv.with_attr(OP_PATTERN, OPAQUE).with_attr(IS_SCHEDULED, True).with_attr(WRITTEN_AS, "experts")


def _is(d, n: int) -> bool:
    return isinstance(d, tirx.IntImm) and int(d) == n
