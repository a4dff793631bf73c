"""How a CPU kernel is called: its arguments at any element offset (`element_aligned_arguments`), its
parallel loops in one launch of TVM's thread pool (`one_parallel_launch`), its register tiles on the
stack where asked (`stack_tiles`)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.tirx import For, ForKind, PrimFunc

from tvmattn.compiler.annotations import DISABLE_LOWER_BUILTIN, STACK_TILES
from tvmattn.compiler.passes.ir import uses, visit_blocks


def one_parallel_launch() -> tvm.transform.Pass:
    """Consecutive parallel loops of a statement list (a layer's projections and attention, a
    kernel's packing pass and its query tiles) run in one launch of the thread pool, with a barrier
    after each loop but the last, instead of one launch each. Every launch wakes the pool's workers,
    and TVM's workers sleep between launches when they do not spin (``TVM_THREAD_POOL_SPIN_COUNT=0``,
    as beside torch or ONNX Runtime): merged, a (1, 8, 128, 64) bf16 kernel of two loops went from
    0.152 to 0.124 ms, a one-token fp32 GPT-2 layer of 13 from 0.214 to 0.143 ms (0.97–1.11× from
    128 tokens, within this VM's noise). Each loop keeps its static split over the threads;
    the statements allowed between merged loops are `tirx.Bind`s (every thread evaluates them) and
    an LLVM import around a loop (it moves outside). Run after TVM's pipeline: the pragmas are read
    by TVM's CPU code generator only (TVM's thread pool: OpenMP's has no such barrier)."""

    def merged(stmts: list) -> list:
        out, i = [], 0
        while i < len(stmts):
            if _parallel_loop(stmts[i]) is None:
                out.append(stmts[i])
                i += 1
                continue
            j = i  # the run: loops, and bindings between them
            while j + 1 < len(stmts) and (_parallel_loop(stmts[j + 1]) is not None
                                          or isinstance(stmts[j + 1], tirx.Bind)):
                j += 1
            while _parallel_loop(stmts[j]) is None:
                j -= 1
            run, rest = stmts[i:j + 1], stmts[j + 1:]
            bound = [st.var for st in run if isinstance(st, tirx.Bind)]  # (a thread's own, inside the launch)
            loops = [st for st in run if _parallel_loop(st) is not None]
            if len(loops) < 2 or any(uses(later, var) for later in rest for var in bound):
                out.extend(run)
            else:
                body = [_parallel_loop(st) or st for st in run]
                body = [tirx.AttrStmt(_ONE, "pragma_parallel_barrier_when_finish", _ONE, st)
                        if isinstance(st, For) and k < len(body) - 1 else st for k, st in enumerate(body)]
                launch = tirx.AttrStmt(_ONE, "pragma_parallel_launch_point", _ONE, tirx.SeqStmt(body))
                for st in run:  # an LLVM import links its IR into the module, wherever it stands
                    if isinstance(st, tirx.AttrStmt):
                        launch = tirx.AttrStmt(st.node, st.attr_key, st.value, launch)
                out.append(launch)
            i = j + 1
        return out

    def on_seq(seq: tirx.SeqStmt):
        stmts = merged(list(seq.seq))
        return tirx.SeqStmt(stmts) if len(stmts) != len(seq.seq) else seq

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.OneParallelLaunch")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.SeqStmt, on_seq)]))

    return transform


_ONE = tirx.IntImm("int32", 1)


def _parallel_loop(stmt) -> For | None:
    """``stmt`` as a parallel loop: itself, or the loop an LLVM import wraps."""
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "pragma_import_llvm":
        stmt = stmt.body
    return stmt if isinstance(stmt, For) and stmt.kind == ForKind.PARALLEL else None


def element_aligned_arguments() -> tvm.transform.Pass:
    """Each argument buffer declared with an alignment of one element (see the module's docstring)."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.ElementAlignedArguments")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        relaxed = {}
        for p in func.params:
            t = p.ty
            element = isinstance(t, tirx.BufferType) and max(tvm.DataType(t.dtype.dtype).bits // 8, 1)
            if element and t.data_alignment > element:
                relaxed[p] = tirx.Var(p.name, tirx.BufferType(t.dtype, t.storage_scope, t.shape, t.strides,
                                                              t.elem_offset, element, t.offset_factor,
                                                              t.layout, t.allocated_addr))
        if not relaxed:
            return func
        body = tvm_ffi.structural_map(func.body, [(tirx.Var, lambda v: next(
            (new for old, new in relaxed.items() if old.same_as(v)), v))])
        return PrimFunc([relaxed.get(p, p) for p in func.params], body, func.ret_type, func.attrs)

    return transform


STACK_BYTES = 4096  # the largest tile `stack_tiles` puts on a thread's stack


def register_tiles_on_stack() -> tvm.transform.Pass:
    """Name every local buffer a scheduled PrimFunc allocates (a GEMM's register tiles) in its
    ``STACK_TILES``, for `stack_tiles`. In TVM's workspace LLVM could keep a tile in registers only
    while it proved the workspace apart from the operands: where the kernel's body was inlined into
    its argument-unpacking wrapper (a module of few functions) it stored every accumulator after each
    update, a symbolic-row bf16 GEMM at a third of its speed."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.RegisterTilesOnStack")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        names: list[str] = []

        def on_block(node, _loops) -> None:
            names.extend(b.name for b in node.block.alloc_buffers if b.scope() == "local")

        visit_blocks(func.body, on_block)
        if not names:
            return func
        known = [str(n) for n in (func.attrs.get(STACK_TILES, []) if func.attrs else [])]
        return func.with_attr(STACK_TILES, sorted(set(known + names)))

    return transform


def stack_tiles() -> tvm.transform.Pass:
    """The local buffers a function's ``STACK_TILES`` names (register tiles, `clamp_row_tails`), up to
    `STACK_BYTES`, allocated on the stack: TVM makes every other local allocation of a CPU kernel a
    workspace (heap) one, whose stores LLVM must keep, while an alloca it can keep in registers. Run
    after TVM's pipeline (its allocations are final), before the host's lowering of builtins."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.StackTiles")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        names = [str(n) for n in (func.attrs.get(STACK_TILES, []) if func.attrs else [])]
        if not names:
            return func

        def on_alloc(node: tirx.AllocBuffer):
            buffer = node.buffer
            size = buffer.shape[0] if len(buffer.shape) == 1 else None
            dtype = tvm.DataType(str(buffer.dtype))
            if buffer.name not in names or buffer.scope() != "local" or not isinstance(size, tirx.IntImm) \
                    or int(size) * dtype.bits * dtype.lanes // 8 > STACK_BYTES:
                return node
            return tirx.AllocBuffer(buffer, {**node.annotations, DISABLE_LOWER_BUILTIN: _ONE})

        return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.AllocBuffer, on_alloc)]))

    return transform
