"""Schedule rules for the PrimFuncs of an imported model other than the attention (TVM dlight's model:
ordered rules, each ``apply(func, target, tunable) -> Schedule | None``, the first that applies wins;
a rule's ``passes`` run on what it scheduled, then `passes.polynomial_math`).

TVM's stock CPU pipeline leaves these functions unscheduled: single-threaded scalar loops. After
legalisation and operator fusion (a MatMul with its bias and GELU is one function), `ScheduleFunctions`
gives every function not scheduled yet (tvmattn's attention kernels are) the first rule that applies:

    matmul-bf16 a bf16 GEMM (``import_onnx(dtype="bfloat16")``) on AMX's tiles or the bf16 dot products
    matmul      a fused GEMM / batch GEMM: the attention layer's register-tiled micro-kernel
                (`micro_kernels.gemm`)
    gemv-bf16   a bf16 GEMV by a constant weight on the bf16 dot products (`micro_kernels.gemv`'s tiles)
    gemv        the same with one row (a decode step): column tiles of vectors (`micro_kernels.gemv`)
    dlight-gemv TVM dlight's CPU GEMV: the reduction runs along contiguous memory
    reduction   row reductions (LayerNorm, RMSNorm, softmax) with their neighbours: parallel rows, vector lanes
    injective   elementwise, broadcasts, transposes, gathers, concat: inlined, parallel, vectorised
    reduce      any other reduction (an integer mask's row sums, a min over a stacked axis): parallel over
                its output, producers inlined
    scan        TVM's own loops (cumsum's scan), already parallel over rows: kept as written
    fallback    whatever is left: parallel over each block's outermost spatial loop

and reports the functions a Relax rewrite wrote scheduled under their own name (``experts``: `experts`).

CUDA models take TVM's dlight GPU rules (Relax's CUDA pipeline applies them).
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight
from tvm.target import Target

from tvmattn.compiler.annotations import IS_SCHEDULED, WRITTEN_AS
from tvmattn.compiler.isa.record import Isa
from tvmattn.compiler.passes import polynomial_math
from tvmattn.compiler.work import TirWork, tir_work
from tvmattn.schedules.ops.columns import SymbolicColumns
from tvmattn.schedules.ops.conv import conv_as_gemm
from tvmattn.schedules.ops.einsum import einsum_as_matmul
from tvmattn.schedules.ops.experts import gathered_matmuls
from tvmattn.schedules.ops.fallback import Fallback, Scan
from tvmattn.schedules.ops.gemv import Gemv
from tvmattn.schedules.ops.injective import Injective
from tvmattn.schedules.ops.layout import cancel_transposes, same_concats
from tvmattn.schedules.ops.matmul import CONSTANT_PARAMS, Matmul, pack
from tvmattn.schedules.ops.matmul_bf16 import GemvPairs, MatmulPairs
from tvmattn.schedules.ops.powers import small_powers
from tvmattn.schedules.ops.reduction import Reduce, RowReduction
from tvmattn.schedules.ops.reshapes import elementwise_before_reshapes
from tvmattn.schedules.ops.sizes import named_sizes
from tvmattn.schedules.ops.tiles import constant_tiles

RULES: tuple[tuple[str, dlight.ScheduleRule], ...] = (
    ("matmul-bf16", MatmulPairs()),
    ("matmul", Matmul()),
    ("gemv-bf16", GemvPairs()),
    ("gemv", Gemv()),
    ("dlight-gemv", dlight.cpu.GEMV()),
    ("matmul-columns", SymbolicColumns()),
    ("reduction", RowReduction()),
    ("injective", Injective()),
    ("reduce", Reduce()),
    ("scan", Scan()),
    ("fallback", Fallback()),
)


# the Relax rewrites before legalisation into what the rules schedule: a mixture of experts' matmuls by
# gathered weights as one kernel over the weights in place, einsums as batched matmuls, convolutions as
# GEMMs, x**2 as x·x, transpositions that undo each other (the convolutions' channels-first output
# transposed straight back),
# each concatenation once, elementwise operators before the reshapes that split their GEMM's rows
# (the transpositions elementwise_before_reshapes brings together cancelled after it)
def before_legalize(dtype: str | None = None, row_block: int | None = None,
                    isa: Isa | None = None) -> list[tvm.transform.Pass]:
    """Those rewrites, for an import whose matmuls run in ``dtype`` (None: fp32) and pad their rows to
    whole blocks of ``row_block`` (`conv.conv_as_gemm`), on the instruction set ``isa``."""
    return [constant_tiles, gathered_matmuls(dtype, isa), einsum_as_matmul, conv_as_gemm(dtype, row_block),
            small_powers, cancel_transposes, same_concats, elementwise_before_reshapes, cancel_transposes]


def is_scheduled(func: tirx.PrimFunc) -> bool:
    return bool(func.attrs and func.attrs.get(IS_SCHEDULED, False))


@tvm.transform.module_pass(opt_level=0, name="tvmattn.ScheduleFunctions")
class ScheduleFunctions:
    """Schedule every PrimFunc not scheduled yet with the first rule of `RULES` that applies;
    ``rule_of`` says which rule took each function (by its name in the module).

    A rule may lay out a parameter that every call passes a constant (a weight) as it likes to read it
    (`matmul.pack`): the functions see which parameters are constants (``CONSTANT_PARAMS``), and the
    calls then pass the constants packed, at compile time. ``tuned`` gives the GEMM rules the knobs of
    a tuning record (`tvmattn.compiler.tuning.lookup.tuned_knobs`) for the functions that have one.
    """

    def __init__(self, target: Target, tuned: Callable[[tirx.PrimFunc, str], dict | None] | None = None) -> None:
        self.target = target
        self.tuned = tuned  # (function as a rule gets it, rule name) → a tuning record's knobs, or None
        self.rule_of: dict[str, str] = {}
        self.tuned_functions: list[str] = []
        self.work: dict[str, TirWork] = {}  # name → its FLOPs as a function of its arguments' shapes

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = mod.clone()  # a pass leaves its input as it was
        packed, tuned, work = {}, [], {}
        rule_of = {gvar: str(func.attrs[WRITTEN_AS]) for gvar, func in mod.functions_items()
                   if isinstance(func, tirx.PrimFunc) and func.attrs is not None and WRITTEN_AS in func.attrs}
        for gvar, func in unscheduled(mod):
            mod[gvar] = func.without_attr(CONSTANT_PARAMS)  # its sizes named: the packing compares with it
            work[gvar] = tir_work(func)
            chosen = first_rule(func, self.target, self.tuned)
            if chosen is None:
                continue
            name, sch, knobs = chosen
            rule = dict(RULES)[name]
            lowering = [*getattr(rule, "passes", ()), polynomial_math()]
            scheduled = tvm.transform.Sequential(lowering)(sch.mod)["main"]
            scheduled = scheduled.without_attr(CONSTANT_PARAMS).with_attr(IS_SCHEDULED, True)
            if _signature(scheduled) == _signature(func):
                mod[gvar] = scheduled
            else:
                packed[gvar] = scheduled
            rule_of[gvar] = name
            if knobs:
                tuned.append(gvar)
        packer = _PackConstants(mod, packed)
        mod = packer.run()
        self.rule_of = {packer.new.get(g, g).name_hint: name for g, name in rule_of.items()}
        self.tuned_functions = [packer.new.get(g, g).name_hint for g in tuned]
        self.work = {packer.new.get(g, g).name_hint: w for g, w in work.items() if w is not None}
        return mod


def first_rule(func: tirx.PrimFunc, target: Target,
               tuned: Callable[[tirx.PrimFunc, str], dict | None] | None = None):
    """The first rule of `RULES` that schedules ``func``: (its name, the schedule, the tuned knobs it was
    given or None), or None. The one place a function's rule is chosen (the build and the tuner ask it)."""
    for name, rule in RULES:
        knobs = tuned(func, name) if tuned and isinstance(rule, Matmul) else None
        try:
            sch = rule.apply(func, target, False, knobs) if knobs else rule.apply(func, target, False)
        except RuntimeError:  # TVM refused a step of the rule (ScheduleError, InternalError): the next rule
            continue
        if sch is not None:
            return name, sch, knobs
    return None


def unscheduled(mod: tvm.IRModule) -> list[tuple[tvm.ir.GlobalVar, tirx.PrimFunc]]:
    """The PrimFuncs a rule is to schedule, as the rules get them (and the tuner measures them): their
    composite sizes named (`sizes.named_sizes`), marked with the parameters that every call passes a
    constant (``CONSTANT_PARAMS``)."""
    constants = _constant_params(mod)
    out = []
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and not is_scheduled(func):
            func = named_sizes(func)
            marked = func.with_attr(CONSTANT_PARAMS, sorted(constants[gvar])) if constants.get(gvar) else func
            out.append((gvar, marked))
    return out


def _signature(func: tirx.PrimFunc) -> list:
    return [list(p.ty.shape) if hasattr(p.ty, "shape") else None for p in func.params]


def _call_sites(mod: tvm.IRModule):
    """(callee, args) of every call_tir in the module's Relax functions."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            for binding in (b for block in func.body.blocks for b in block.bindings):
                value = binding.value
                if isinstance(value, relax.Call) and value.op.same_as(call_tir):
                    yield value.args[0], list(value.args[1].fields)


def _constant_params(mod: tvm.IRModule) -> dict:
    """PrimFunc → the indices of the parameters that every call passes a constant."""
    out: dict = {}
    for gvar, args in _call_sites(mod):
        here = {i for i, a in enumerate(args) if isinstance(a, tvm.ir.GenericConst)}
        out[gvar] = out[gvar] & here if gvar in out else here
    return out


@relax.expr_functor.mutator
class _PackConstants(relax.PyExprMutator):
    """Functions whose parameters a rule re-laid out replace the old ones (under new GlobalVars: a
    GlobalVar keeps its function's type), and their calls pass the constants packed (`matmul.pack`)."""

    def __init__(self, mod: tvm.IRModule, relaid: dict) -> None:
        super().__init__(mod)
        self.mod_, self.relaid = mod, relaid
        self.new = {old: self.builder_.add_func(func, old.name_hint) for old, func in relaid.items()}
        self.call_tir = tvm.ir.Op.get("relax.call_tir")

    def run(self) -> tvm.IRModule:
        if not self.relaid:
            return self.mod_
        for gvar, func in self.mod_.functions_items():
            if isinstance(func, relax.Function):
                self.builder_.update_func(gvar, self.visit_expr(func))
        out = self.builder_.get()
        return tvm.IRModule({g: f for g, f in out.functions_items() if g not in self.relaid}, attrs=out.attrs)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not call.op.same_as(self.call_tir) or call.args[0] not in self.relaid:
            return call
        relaid, original = self.relaid[call.args[0]].params, self.mod_[call.args[0]].params
        args = [relax.const(pack(a.value.numpy(), [int(x) for x in p.ty.shape]))
                if hasattr(p.ty, "shape") and list(p.ty.shape) != list(q.ty.shape) else a
                for a, p, q in zip(call.args[1].fields, relaid, original)]
        return relax.Call(call.op, [self.new[call.args[0]], relax.Tuple(args), *call.args[2:]], call.attrs,
                          call.ty_args)
