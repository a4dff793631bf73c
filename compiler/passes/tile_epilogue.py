"""A tile GEMM's epilogue interleaved with the next block's products (`interleave_tile_epilogues`)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Call, StringImm, TensorLoad
from tvm.tirx import For, ForKind, PrimFunc

from tvmattn.compiler.annotations import TILE_BLOCKS
from tvmattn.compiler.passes.ir import substitute

_CALLERS = {"tirx.call_extern", "tirx.call_pure_extern", "tirx.call_llvm_intrin", "tirx.call_llvm_pure_intrin"}


def interleave_tile_epilogues() -> tvm.transform.Pass:
    """A loop marked ``TILE_BLOCKS`` (`tiles.tile_gemm`) runs one accumulator block an iteration, lowered as

        zero the tiles; for s < S: products (step s); store the tiles to acc; for r < R: epilogue(acc)

    The epilogue's vector work (a GELU's ~20 operations a vector) cannot start before its block's
    products finish, and the next block's products enter the reorder window only once most of it has
    retired: the tiles and the vector units take turns. Rewritten, step s of block j's products is
    followed by rows [s·R/S, (s+1)·R/S) of block j − 1's epilogue, which reads acc before block j's
    store overwrites it, and the last block's epilogue follows the loop.

    It applies only where that is the same computation: the block is calls and binds, the products'
    loop, calls (the stores) and one epilogue loop of constant extent; nothing before the stores writes
    memory but through the tiles (no buffer store, no address before the products' loop, and that loop
    calls no store instruction), and
    the epilogue calls none of the block's instructions and writes no buffer the block reads. Run after
    TVM's pipeline (vectorised, flat loops), before `stack_tiles`."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.InterleaveTileEpilogues")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        found = []
        tvm_ffi.structural_walk(func.body, [(For, lambda n: found.append(1) if TILE_BLOCKS in n.annotations else None)])
        if not found:
            return func
        return func.with_body(tvm_ffi.structural_map(func.body, [(For, _interleaved)]))

    return transform


def _interleaved(loop: For):
    if TILE_BLOCKS not in loop.annotations or not isinstance(loop.extent, tirx.IntImm) or loop.extent.value < 2:
        return loop
    stmts = list(loop.body.seq) if isinstance(loop.body, tirx.SeqStmt) else [loop.body]
    at = next((i for i, st in enumerate(stmts) if isinstance(st, For)), None)
    if at is None or at + 1 >= len(stmts):
        return loop
    products, after = stmts[at], stmts[at + 1:]
    split = next((i for i, st in enumerate(after) if not isinstance(st, (tirx.Evaluate, tirx.Bind))), None)
    if split is None or split + 1 != len(after) or not isinstance(after[split], For):
        return loop  # one epilogue loop after the stores, nothing after it
    head, stores, epilogue = stmts[:at], after[:split], after[split]
    if not all(isinstance(st, (tirx.Evaluate, tirx.Bind)) for st in head) or not _sliceable(products, epilogue):
        return loop
    block = [*head, products, *stores]
    if not stores or _calls(*block) & _calls(epilogue) or _written(*head, products) or _touched(*head) or \
            _calls(*stores) & _calls(products) or _written(epilogue) & _touched(*block):
        return loop  # the products write only the tiles; the epilogue neither the tiles nor their operands
    # block j − 1's epilogue, its bindings (the block's index arithmetic) inlined
    bound: dict = {}
    for st in (*head, *stores):
        if isinstance(st, tirx.Bind):
            bound[st.var] = substitute(st.value, bound)
    previous = substitute(substitute(epilogue, bound), {loop.loop_var: loop.loop_var - 1})
    last = _fresh(substitute(substitute(epilogue, bound), {loop.loop_var: loop.min + loop.extent - 1}))
    step = products.loop_var
    rows, steps = epilogue.extent.value, products.extent.value
    at_step = step - products.min
    dtype = str(epilogue.loop_var.ty.dtype)
    if str(at_step.ty.dtype) != dtype:
        at_step = tirx.Cast(dtype, at_step)
    lo = epilogue.min + tirx.floordiv(at_step * rows, steps)
    hi = epilogue.min + tirx.floordiv((at_step + 1) * rows, steps)
    part = For(previous.loop_var, lo, hi - lo, ForKind.SERIAL, previous.body)
    interleaved = For(step, products.min, products.extent, products.kind,
                      tirx.SeqStmt([products.body, tirx.IfThenElse(loop.loop_var > loop.min, part, None)]),
                      products.thread_binding, products.annotations)
    body = tirx.SeqStmt([*head, interleaved, *stores])
    return tirx.SeqStmt([For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
                             loop.annotations), last])


def _sliceable(products, epilogue: For) -> bool:
    return all(isinstance(x, tirx.IntImm) for x in (products.extent, epilogue.extent)) and \
        products.kind == ForKind.SERIAL and epilogue.kind == ForKind.SERIAL


def _calls(*stmts) -> set:
    """The functions and instructions ``stmts`` call, by name (TIR's own operators, an address, left out)."""
    names = set()

    def on_call(call: Call) -> None:
        if str(getattr(call.op, "name", "")) in _CALLERS:
            names.add(str(call.args[0].value if isinstance(call.args[0], StringImm) else call.args[0]))

    for stmt in stmts:
        tvm_ffi.structural_walk(stmt, [(Call, on_call)])
    return names


def _written(*stmts) -> set:
    """The buffers ``stmts`` write, by their data's name (a flattened buffer's loads and stores may hold
    different variables of one name)."""
    out = set()
    for stmt in stmts:
        tvm_ffi.structural_walk(stmt, [(tirx.BufferStore, lambda s: out.add(_memory(s.buffer)))])
    return out


def _touched(*stmts) -> set:
    """The buffers ``stmts`` read or write (a tile load's or store's operand is an address)."""
    out = set()
    for stmt in stmts:
        tvm_ffi.structural_walk(stmt, [(tirx.BufferStore, lambda s: out.add(_memory(s.buffer))),
                                       (TensorLoad, lambda s: out.add(_memory(s.source)))])
    return out


def _memory(buffer) -> str:
    data = buffer.data
    return data.name if isinstance(data, tirx.Var) else str(data)


def _fresh(stmt):
    """``stmt`` with its loop and bound variables renamed: a copy may stand beside the original."""
    defined = []
    tvm_ffi.structural_walk(stmt, [(For, lambda n: defined.append(n.loop_var)),
                                   (tirx.Bind, lambda n: defined.append(n.var))])
    return substitute(stmt, {v: tirx.Var(v.name, v.ty) for v in defined})
