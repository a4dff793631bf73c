"""Maths as vectorisable polynomials: exp, log, sigmoid, tanh, erf and small powers before vectorisation
(`polynomial_math`), fp32 exp2 after it (`vector_exp2`, the instruction set's where it has one)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import Call
from tvm.ir.expr import Expr as PrimExpr
from tvm.tirx import PrimFunc

from tvmattn.compiler.annotations import EXP2_COEFFICIENTS
from tvmattn.compiler.passes.ir import element_dtype
from tvmattn.compiler.target import isa_of

_EXP, _EXP2, _LOG, _SIGMOID, _TANH, _ERF, _POW = (tvm.ir.Op.get(f"tirx.{name}") for name in
                                                   ("exp", "exp2", "log", "sigmoid", "tanh", "erf", "pow"))
SMALL_POWER = 4  # x**k by multiplication up to this k (GPT-2's GELU cubes its input)


# 2^r on [0, 1), fitted to the relative error (Remez), highest power first: degree 5, 1.6e-7 in fp32;
# degree 3, 7.5e-5, for bf16 kernels: they round every result to 8 significant bits (half an ulp is
# 2e-3), P for P·V as well, so two fewer FMAs per vector cost nothing visible (3–5 % of a kernel).
EXP2_P = (1.8775766751932426e-3, 8.989340090486452e-3, 5.58263180533071e-2, 0.24015361704436922,
          0.6931530732001702, 0.9999999250635262)
EXP2_P_BF16 = (7.802452264047931e-2, 0.22606715542748335, 0.6958335404947529, 0.9999252185627155)


def polynomial_math(exp2_coefficients: tuple[float, ...] = EXP2_P) -> tvm.transform.Pass:
    """fp32 exp, log, sigmoid, tanh and erf as vectorisable polynomials, and x**k for a small integer k
    as products: LLVM would otherwise call scalar libm (``expf``, ``logf``, ``tanhf``, ``erff``,
    ``powf``) per lane.
    exp2 is left for `vector_exp2`, after vectorisation, with ``exp2_coefficients`` (a shorter p where
    the result is rounded coarser, `EXP2_P_BF16`) recorded on the function.

    exp(x) = 2^n · p(r), n = round(x·log2 e), r = x - n·ln 2 (Cody–Waite), p of degree 6: relative
    error about 2e-7 on [-87, 88]; larger inputs are clamped to 88, smaller ones give 0 (a logit of
    -inf has weight 0, not exp(-87) ≈ 1.6e-38), and NaN stays NaN (the clamp's min/max would turn it
    into a number: a NaN input must show in the output). log is Cephes' ``logf`` as Eigen vectorises
    it (`_log_f32`), within an ulp. sigmoid(x) = 1 / (1 + exp(-x)). tanh and erf
    are the odd rational approximations Eigen and TVM's ``fast_tanh``/``fast_erf`` use (a few ulp).
    erf's argument divided by a constant (GELU's x / √2) is multiplied by its reciprocal (`_scaled`).
    """

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.PolynomialMath")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        def on_call(call):
            if str(getattr(call.ty, "dtype", "")) != "float32":  # (a pointer, an AMX tile's address, has none)
                return call
            if call.op.same_as(_EXP):
                return _exp_f32(call.args[0])
            if call.op.same_as(_LOG):
                return _log_f32(call.args[0])
            if call.op.same_as(_SIGMOID):
                return tirx.const(1.0, "float32") / (tirx.const(1.0, "float32") + _exp_f32(-call.args[0]))
            if call.op.same_as(_TANH):
                return _odd_rational(call.args[0], 9.0, TANH_P, TANH_Q)
            if call.op.same_as(_ERF):
                return _odd_rational(_scaled(call.args[0]), 4.0, ERF_P, ERF_Q)
            if call.op.same_as(_POW) and isinstance(call.args[1], tirx.FloatImm):
                k = call.args[1].value
                if k == int(k) and 1 <= k <= SMALL_POWER:
                    out = call.args[0]
                    for _ in range(int(k) - 1):
                        out = out * call.args[0]
                    return out
            return call

        func = tvm_ffi.structural_map(func, [(Call, on_call)])
        return func.with_attr(EXP2_COEFFICIENTS, [float(c) for c in exp2_coefficients])

    return transform


def vector_exp2() -> tvm.transform.Pass:
    """fp32 exp2, after vectorisation (in the CPU pipeline, `build._cpu_pipeline`), as
    2^x = 2^⌊x⌋ · p(x − ⌊x⌋), p of `polynomial_math`'s coefficients on [0, 1).

    A vector of a whole register takes the lowering of the target's instruction set where it has one
    (`Isa.exp2`: AVX-512's is exact at the edges with no clamp or test of its own, a third of the
    softmax's instructions in the attention kernels). Elsewhere 2^⌊x⌋ is written into the exponent
    field of x clamped to [-127, 128] (0 from -127: no denormals; +inf from 128), and NaN is passed
    by a select."""

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvmattn.VectorExp2")
    def transform(func: PrimFunc, _mod, _ctx) -> PrimFunc:
        coefficients = tuple(float(c) for c in func.attrs.get(EXP2_COEFFICIENTS, EXP2_P)) \
            if func.attrs is not None else EXP2_P
        target = func.attrs.get("target") if func.attrs is not None else None
        isa = isa_of(target) if target is not None else None
        lowered = isa.exp2 if isa is not None else None

        def on_call(call):
            if not call.op.same_as(_EXP2) or element_dtype(call) != "float32":
                return call
            if lowered is not None and call.ty.dtype.lanes == isa.lanes:
                x = call.args[0]
                return lowered(x, lambda r: _polynomial(r, coefficients, _constant_like(x)))
            return _exp2_f32(call.args[0], coefficients)

        return tvm_ffi.structural_map(func, [(Call, on_call)])

    return transform


# tanh(x) ≈ x·P(x²)/Q(x²) on [-9, 9] (±1 to fp32 beyond); erf(x) likewise on [-4, 4]. Highest power first.
TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
          1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)
TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)
ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
         -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
         -1.42647390514189e-02)


def _scaled(arg: PrimExpr) -> PrimExpr:
    """x / c as x · (1/c), within an ulp, for a normal c with a normal reciprocal: `vdivps` issues one
    every 5–16 cycles on one port, and an erf-GELU over 6.5 M elements with the export's x / √2 took
    1.64 ms against 1.24 ms (ONNX Runtime's GELU multiplies by 1/√2 too). Only in erf's argument, where
    an ulp moves the result by about one: elsewhere a quotient may be truncated (T5's and DeBERTa's
    position buckets divide logs, and an ulp below a whole number is the bucket below)."""
    c = arg.b if isinstance(arg, tirx.Div) else None
    if isinstance(c, tirx.FloatImm) and str(arg.ty.dtype) == "float32" and 1.2e-38 < abs(c.value) < 8.5e37:
        return arg.a * tirx.const(1.0 / c.value, "float32")
    return arg


def _odd_rational(arg: PrimExpr, limit: float, p: tuple, q: tuple) -> PrimExpr:
    f = lambda v: tirx.const(v, "float32")  # noqa: E731
    x = tirx.min(tirx.max(arg, f(-limit)), f(limit))
    x2 = x * x
    num, den = f(p[0]), f(q[0])
    for c in p[1:]:
        num = num * x2 + f(c)
    for c in q[1:]:
        den = den * x2 + f(c)
    return tirx.Select(_is_nan(arg), arg, x * num / den)


def _exp2_f32(arg: PrimExpr, coefficients: tuple[float, ...]) -> PrimExpr:
    f = _constant_like(arg)
    # 2^-127 has a zero exponent field: exactly 0, so -inf needs no test of its own (exp's does); 2^128,
    # all ones: +inf
    x = tirx.min(tirx.max(arg, f(-127.0)), f(128.0))
    n = tirx.floor(x)
    r = x - n  # exact
    return tirx.Select(_is_nan(arg), arg, _polynomial(r, coefficients, f) * _two_to(n))


def _polynomial(r: PrimExpr, coefficients: tuple[float, ...], f) -> PrimExpr:
    """p(r), highest power first, by Horner's rule (``f``: a constant of r's lanes)."""
    p = f(coefficients[0])
    for coeff in coefficients[1:]:
        p = p * r + f(coeff)
    return p


def _constant_like(x: PrimExpr):
    """fp32 constants of ``x``'s lane count (a Broadcast for a vector)."""
    lanes = x.ty.dtype.lanes
    return lambda v: tirx.const(v, "float32") if lanes == 1 else tirx.Broadcast(tirx.const(v, "float32"), lanes)


def _is_nan(x: PrimExpr) -> PrimExpr:
    """x is NaN. Before vectorisation, from its bits (exponent all ones, mantissa not zero): TVM's
    vectoriser has no vector form of ``tirx.isnan`` (a loop that contains it would run one lane at a
    time, and LLVM re-vectorise it at half the width), and the simplifier folds ``x != x`` to false. A
    vector (after vectorisation, `vector_exp2`) keeps ``isnan``: one unordered compare."""
    if x.ty.dtype.lanes > 1:
        return tirx.isnan(x)
    return tirx.bitwise_and(tirx.reinterpret("int32", x), tirx.const(0x7FFFFFFF, "int32")) > \
        tirx.const(0x7F800000, "int32")


def _two_to(n: PrimExpr) -> PrimExpr:
    """2^n for an integral fp32 n in [-127, 128]: n + 127 written into the exponent field."""
    lanes = n.ty.dtype.lanes
    typed = lambda t: t if lanes == 1 else f"{t}x{lanes}"  # noqa: E731
    word = lambda c: tirx.const(c, "int32") if lanes == 1 else tirx.Broadcast(tirx.const(c, "int32"), lanes)  # noqa: E731
    return tirx.reinterpret(typed("float32"), tirx.shift_left(tirx.Cast(typed("int32"), n) + word(127), word(23)))


def _exp_f32(arg: PrimExpr) -> PrimExpr:
    f = lambda v: tirx.const(v, "float32")  # noqa: E731
    x = tirx.min(tirx.max(arg, f(-87.0)), f(88.0))
    n = tirx.floor(x * f(1.44269504088896341) + f(0.5))
    r = x - n * f(0.693359375) + n * f(2.12194440e-4)  # ln 2 split in two for exactness
    p = f(1.9875691500e-4)
    for coeff in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(coeff)
    p = p * r * r + r + f(1.0)
    # the clamp at 88 keeps 2^n finite; above fp32's largest exp (88.72) the result is +inf
    return tirx.Select(arg < f(-87.0), f(0.0), tirx.Select(arg > f(88.7228394), f(float("inf")),
                                                          tirx.Select(_is_nan(arg), arg, p * _two_to(n))))


# log(1 + x) ≈ x - x²/2 + x³·P(x) on [√½ - 1, √2 - 1] (Cephes' logf), highest power first
LOG_P = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
         -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)


def _log_f32(arg: PrimExpr) -> PrimExpr:
    """log(x) = e·ln 2 + log(m), x = m·2^e with m in [√½, √2) (from the bits: exponent field and
    mantissa), log(m) by `LOG_P`; ln 2 split in two for exactness. A denormal x is scaled by 2^23 first;
    0 gives -inf, a negative x NaN, +inf and NaN themselves. Each value that is read more than once is
    bound to a variable: written out, the polynomial would repeat the input's expression at every read."""
    f = lambda v: tirx.const(v, "float32")  # noqa: E731
    word = lambda c: tirx.const(c, "int32")  # noqa: E731
    a, x, bits, e, r, r2 = (tirx.Var(name, dtype) for name, dtype in (
        ("log_a", "float32"), ("log_x", "float32"), ("log_bits", "int32"), ("log_e", "float32"),
        ("log_r", "float32"), ("log_r2", "float32")))
    denormal = a < f(1.17549435e-38)
    exponent = tirx.Cast("float32", tirx.shift_right(bits, word(23)) - word(126)) \
        - tirx.Select(denormal, f(23.0), f(0.0))
    # m in [0.5, 1) from the bits; below √½ the reduction takes 2m (one less in the exponent)
    m = tirx.reinterpret("float32", tirx.bitwise_or(tirx.bitwise_and(bits, word(0x007FFFFF)), word(0x3F000000)))
    low = m < f(0.707106781186547524)  # (not a bound variable: TVM cannot vectorise a boolean one)
    y = _polynomial(r, LOG_P, f) * r * r2 + e * f(-2.12194440e-4) - r2 * f(0.5)
    out = tirx.Select(a == f(0.0), f(float("-inf")), tirx.Select(a == f(float("inf")), a, r + y + e * f(0.693359375)))
    out = tirx.Select(_is_nan(a) | (a < f(0.0)), tirx.Select(_is_nan(a), a, f(float("nan"))), out)
    for var, value in reversed(((a, arg), (x, tirx.Select(denormal, a * f(8388608.0), a)),  # 2^23
                                (bits, tirx.reinterpret("int32", x)),
                                (e, exponent - tirx.Select(low, f(1.0), f(0.0))),
                                (r, tirx.Select(low, m + m, m) - f(1.0)), (r2, r * r))):
        out = tirx.Let(var, value, out)
    return out
