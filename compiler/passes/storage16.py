"""16-bit operands as the CPU kernels store them: fp32 copies of 16-bit values read without a round
trip (`exact_widenings`), and a kernel's own bf16 buffers kept 16 bits wide (`keep_operands_16bit`)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.ir.expr import Expr as PrimExpr
from tvm.s_tir import SBlock
from tvm.tirx import PrimFunc

from tvmattn.compiler.annotations import KEEP_16BIT
from tvmattn.compiler.passes.ir import element_dtype


def exact_widenings() -> tvm.transform.Pass:
    """Cast(fp32, Cast(h, B[i])) → B[i] where every store to B (or to a tensorized block's view of
    it: `isa.panels`) is Cast(fp32, x) with x of the 16-bit dtype h: the fp32 panels the CPU schedule
    widens fp16/bf16 operands into once (`unsafe_set_dtype` leaves its readers narrowing back) hold
    values h represents exactly."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.ExactWidenings")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        widened: list[tuple[tirx.Buffer, str | None]] = []  # buffer, the 16-bit dtype of all its stores
        views: list[tuple[tirx.Buffer, tirx.Buffer]] = []  # a tensorized block's match buffer, its source

        def on_block(block: SBlock, visitor) -> None:
            views.extend((m.buffer, m.source.source) for m in block.match_buffers)
            visitor.default_visit(block)

        def on_store(store: tirx.BufferStore, visitor) -> None:
            v = store.value  # a scalar or a vector store (`isa.panels`): its element types
            narrow = element_dtype(v.value) if isinstance(v, tirx.Cast) and element_dtype(v) == "float32" \
                and element_dtype(v.value) in ("float16", "bfloat16") else None
            target = next((source for view, source in views if view.same_as(store.buffer)), store.buffer)
            for i, (buf, dtype) in enumerate(widened):
                if buf.same_as(target):
                    widened[i] = (buf, dtype if dtype == narrow else None)
                    break
            else:
                widened.append((target, narrow))
            visitor.default_visit(store)

        tvm_ffi.structural_visit(func.body, [(SBlock, on_block)])
        tvm_ffi.structural_visit(func.body, [(tirx.BufferStore, on_store)])
        if not any(dtype for _, dtype in widened):
            return func

        def on_cast(cast: tirx.Cast):
            inner = cast.value
            if str(cast.ty.dtype) == "float32" and isinstance(inner, tirx.Cast) \
                    and isinstance(inner.value, TensorLoad):
                narrow = next((d for b, d in widened if b.same_as(inner.value.source)), None)
                if narrow is not None and narrow == str(inner.ty.dtype):
                    return inner.value
            return cast

        return tvm_ffi.structural_map(func, [(tirx.Cast, on_cast)])

    return transform


_REINTERPRET = tvm.ir.Op.get("tirx.reinterpret")
_ADDRESS_OF = tvm.ir.Op.get("tirx.address_of")


def keep_operands_16bit(readers: tuple[str, ...] = ()) -> tvm.transform.Pass:
    """Store a kernel's own bf16 buffers as their 16-bit patterns: those a block annotated `KEEP_16BIT`
    writes, and the packed operands of the calls named ``readers`` (the instruction set's dot products
    and tile loads, `Isa.packed_readers`), which read them as the bits they hold.

    TVM's BF16ComputeLegalize widens every bf16 buffer a function allocates to fp32, which would hand
    the instruction fp32 words where it reads bf16 pairs. Typed uint16 here, the buffers keep their
    bits; a store writes the bf16 value's bits, any load outside the instruction reads them back as
    bf16 (so the other stages compute exactly as before), and the instruction reads them as they are.
    Functions without such buffers are left alone."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.KeepDotOperands16Bit")
    def transform(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
        own = _own_bf16_buffers(func, readers)
        if not own:
            return func
        bits: list[tuple[tirx.Buffer, tirx.Buffer]] = []  # (bf16 buffer, its uint16 twin)

        def on_buffer(buf: tirx.Buffer) -> tirx.Buffer:
            if not any(buf.same_as(b) for b in own):
                return buf
            twin = next((t for b, t in bits if b.same_as(buf)), None)
            if twin is None:
                twin = buf.with_dtype("uint16")
                bits.append((buf, twin))
            return twin

        def as_bf16(load: TensorLoad) -> PrimExpr:
            lanes = load.ty.dtype.lanes
            return tirx.reinterpret("bfloat16" if lanes == 1 else f"bfloat16x{lanes}", load)

        def on_load(load: TensorLoad):
            if any(t.same_as(load.source) for _, t in bits):
                return as_bf16(tirx.BufferLoad(load.source, load.indices))
            return load

        def on_store(store: tirx.BufferStore):
            if any(t.same_as(store.buffer) for _, t in bits):
                return tirx.BufferStore(store.buffer, _bits_of(store.value), store.indices)
            return store

        def on_call(call: Call):
            inner = call.args[0] if call.args and isinstance(call.args[0], Call) else None
            reread = inner is not None and inner.op.same_as(_REINTERPRET) and "bfloat16" in str(inner.ty.dtype)
            if reread and call.op.same_as(_REINTERPRET):  # reinterpret(bits) of reinterpret(bf16) of a load: its bits
                return tirx.reinterpret(str(call.ty.dtype), inner.args[0])
            if reread and call.op.same_as(_ADDRESS_OF):  # an element's address (AMX's tile loads): the load's
                return tirx.address_of(inner.args[0])
            return call

        return tvm_ffi.structural_map(func, [(tirx.Buffer, on_buffer), (TensorLoad, on_load),
                                             (tirx.BufferStore, on_store), (Call, on_call)])

    return transform


def _bits_of(value: PrimExpr) -> PrimExpr:
    """The uint16 pattern of a bf16 ``value``, spelt out in fp32 and integer operations (a rounding of
    fp32 to nearest even, as the dot products' pair packing): BF16ComputeLegalize widens any bf16 value but a
    load of an argument to fp32, so a reinterpret of it would see 32 bits."""
    lanes = value.ty.dtype.lanes
    typed = lambda t: t if lanes == 1 else f"{t}x{lanes}"  # noqa: E731
    if isinstance(value, Call) and value.op.same_as(_REINTERPRET):  # the bits of a pack already
        return tirx.reinterpret(typed("uint16"), value.args[0])
    word = lambda c: tirx.const(c, "uint32") if lanes == 1 else tirx.Broadcast(tirx.const(c, "uint32"), lanes)  # noqa: E731
    if isinstance(value, tirx.Cast) and str(value.value.ty.dtype) == typed("float32"):
        x = tirx.reinterpret(typed("uint32"), value.value)
        x = x + word(0x7FFF) + ((x >> word(16)) & word(1))
    else:  # a bf16 value (exact in fp32, whatever the legaliser makes of it): its top 16 bits
        x = tirx.reinterpret(typed("uint32"), tirx.Cast(typed("float32"), value))
    return tirx.Cast(typed("uint16"), x >> word(16))


def _own_bf16_buffers(func: tirx.PrimFunc, readers: tuple[str, ...]) -> list[tirx.Buffer]:
    """The bf16 buffers ``func`` allocates that one of ``readers`` reads or a block annotated
    `KEEP_16BIT` writes, and every view (match buffer) of them."""
    allocated: list[tirx.Buffer] = []
    operands: list[tirx.Buffer] = []

    def on_block(block: SBlock, visitor) -> None:
        allocated.extend(b for b in block.alloc_buffers if str(b.dtype) == "bfloat16")
        if block.match_buffers and any(reader in block.body.script() for reader in readers):
            operands.extend(m.source.source for m in block.match_buffers)
        if KEEP_16BIT in block.annotations:
            operands.extend(w.source for w in block.writes)
        visitor.default_visit(block)

    tvm_ffi.structural_visit(func.body, [(SBlock, on_block)])
    own = [b for b in allocated if any(b.same_as(x) for x in operands)]
    views: list[tirx.Buffer] = []

    def on_views(block: SBlock, visitor) -> None:
        views.extend(m.buffer for m in block.match_buffers if any(m.source.source.same_as(b) for b in own))
        visitor.default_visit(block)

    tvm_ffi.structural_visit(func.body, [(SBlock, on_views)])
    return own + views
