"""A fixed corpus of scheduled kernels, hashed: the proof that a restructuring of the schedules changed
no kernel.

Each entry is an attention kernel (every dtype × core/layer × static/symbolic lengths × causal,
decode, masks, key padding, a window, GQA) on an explicit CPU (AVX2 ``znver3``, AVX-512 without bf16
``skylake-avx512``, AVX512-BF16 ``znver4``, AMX ``sapphirerapids``, full-width AVX-512 ``znver5``), or
a fused GEMM as `schedules.ops.matmul` schedules it. For each, the scheduled TIR with tvmattn's
lowering passes (`build.schedule_attention`, default knobs, no tuning record), the TIR code generation
would see (`build.lower`) and the schedule's description are hashed. Nothing is run: AMX and AVX-512
code is only compiled to TIR.

    python scripts/tir_corpus.py --save scripts/tir_corpus.json    # the baseline
    python scripts/tir_corpus.py --check scripts/tir_corpus.json   # exit 1, naming the kernels that differ
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

CPUS = {"avx2": "znver3", "avx512": "skylake-avx512", "bf16": "znver4", "amx": "sapphirerapids", "zen5": "znver5"}
CORES = 8


def _attention_specs() -> dict[str, dict]:
    """Name → AttentionSpec keywords."""
    core = dict(projections=False)
    out: dict[str, dict] = {}
    for dtype in ("float32", "float16", "bfloat16"):
        t = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[dtype]
        specs = {
            f"core-{t}-causal": dict(batch=1, seq_len=256, num_heads=8, head_dim=64, causal=True, **core),
            f"core-{t}-gqa-bshd": dict(batch=2, seq_len=128, num_heads=8, num_kv_heads=2, head_dim=64,
                                       layout="BSHD", **core),
            f"core-{t}-sym-causal": dict(batch="B", seq_len="n", num_heads=4, head_dim=64, causal=True, **core),
            # (2 × 4 KV heads: a task per head on the corpus's 8 cores)
            f"core-{t}-sym-gqa-heads": dict(batch=2, seq_len="n", num_heads=16, num_kv_heads=4, head_dim=64,
                                            causal=True, **core),
            f"core-{t}-decode-splitk": dict(batch=1, seq_len=1, kv_seq_len=4096, num_heads=4, head_dim=128,
                                            causal=True, causal_align="bottom_right", **core),
            f"core-{t}-decode-padded": dict(batch=4, seq_len=1, kv_seq_len=600, num_heads=8, num_kv_heads=2,
                                            head_dim=128, key_padding=True, **core),
            f"core-{t}-mask-bool": dict(batch=2, seq_len=64, kv_seq_len=96, num_heads=2, head_dim=32,
                                        attn_mask="bool", **core),
            f"core-{t}-sym-mask-add": dict(batch="B", seq_len="n", kv_seq_len="m", num_heads=2, head_dim=32,
                                           attn_mask="additive", attn_mask_dims="bst", **core),
            f"core-{t}-window-pad": dict(batch=2, seq_len=96, num_heads=2, head_dim=32, window=9, key_padding=True,
                                         **core),
            f"layer-{t}-causal": dict(batch=1, seq_len=128, num_heads=4, head_dim=32, d_model=128, causal=True),
            f"layer-{t}-cross-gqa": dict(batch=2, seq_len=48, kv_seq_len=80, num_heads=4, num_kv_heads=2,
                                         head_dim=32, d_model=128),
            f"layer-{t}-sym": dict(batch=1, seq_len="n", num_heads=2, head_dim=32, d_model=64, causal=True),
            # (77 rows a sequence: bf16's projections in register tiles of 7 rows on the dot products)
            f"layer-{t}-ragged": dict(batch=2, seq_len=77, num_heads=3, head_dim=64, d_model=192),
            f"layer-{t}-decode": dict(batch=1, seq_len=1, kv_seq_len=256, num_heads=4, head_dim=64, d_model=256),
        }
        out |= {name: kw | {"dtype": dtype} for name, kw in specs.items()}
    out |= {
        "core-f32-odd": dict(batch=1, seq_len=37, kv_seq_len=45, num_heads=3, head_dim=20, causal=True, **core),
        "core-f32-three-queries": dict(batch=2, seq_len=3, kv_seq_len=200, num_heads=4, head_dim=64, **core),
        "core-bf16-sym-decode": dict(dtype="bfloat16", batch=1, seq_len=1, kv_seq_len="m", num_heads=8, head_dim=64,
                                     **core),
        "core-f16-long": dict(dtype="float16", batch=1, seq_len=64, kv_seq_len=256, num_heads=2, head_dim=64, **core),
        "core-bf16-d16": dict(dtype="bfloat16", batch=1, seq_len=64, num_heads=2, head_dim=16, **core),
        "core-bf16-vit": dict(dtype="bfloat16", batch=2, seq_len=197, num_heads=6, head_dim=64, layout="BSHD", **core),
        "core-f32-weights": dict(batch=1, seq_len=64, num_heads=2, head_dim=32, output="weights", **core),
        "core-f32-sinks-softcap": dict(batch=1, seq_len=64, num_heads=2, head_dim=32, sinks=True, softcap=30.0,
                                       **core),
        "layer-f16-wide": dict(dtype="float16", batch=2, seq_len=64, kv_seq_len=256, num_heads=4, head_dim=32,
                               d_model=128),
        "layer-bf16-odd-head": dict(dtype="bfloat16", batch=1, seq_len=32, num_heads=16, head_dim=3, d_model=48,
                                    causal=True),
    }
    return out


def _gemm_funcs() -> dict[str, object]:
    """Name → a fused GEMM PrimFunc, as Relax legalises and fuses them (int64 shapes)."""
    from tvm import te, tirx

    from tvmattn.schedules.ops.matmul import CONSTANT_PARAMS

    i64 = lambda n: tirx.IntImm("int64", n)  # noqa: E731

    def gemm(m, k: int, n: int, batch: tuple = ()):
        a = te.placeholder((*map(i64, batch), m, i64(k)), name="A")
        b = te.placeholder((i64(k), i64(n)), name="B")
        r = te.reduce_axis((i64(0), i64(k)), name="k")
        c = te.compute((*a.shape[:-1], i64(n)), lambda *i: te.sum(a[(*i[:-1], r)] * b[r, i[-1]], axis=r),
                       name="matmul")
        return a, b, c

    def bias_gelu(m, k: int, n: int):
        a, b, c = gemm(m, k, n)
        bias = te.placeholder((i64(n),), name="bias")
        h = te.compute(c.shape, lambda i, j: c[i, j] + bias[j], name="add")
        s = math.sqrt(2 / math.pi)
        g = te.compute(c.shape, lambda i, j: 0.5 * h[i, j] * (1 + te.tanh(s * (h[i, j] + 0.044715 * te.power(
            h[i, j], tirx.const(3.0, "float32"))))), name="gelu")
        return [a, b, bias, g]

    def bias_only(m, k: int, n: int):
        a, b, c = gemm(m, k, n)
        bias = te.placeholder((i64(n),), name="bias")
        return [a, b, bias, te.compute(c.shape, lambda i, j: c[i, j] + bias[j], name="add")]

    def half(m, k: int, n: int, dtype: str, accumulate: str):
        a = te.placeholder((m, i64(k)), name="A", dtype=dtype)
        b = te.placeholder((i64(k), i64(n)), name="B", dtype=dtype)
        r = te.reduce_axis((i64(0), i64(k)), name="k")
        c = te.compute((m, i64(n)), lambda i, j: te.sum(a[i, r].astype(accumulate) * b[r, j].astype(accumulate),
                                                          axis=r), name="matmul")
        return [a, b, te.compute(c.shape, lambda i, j: c[i, j].astype(dtype), name="cast")]

    def bf16_projection(m, k: int, n: int):  # as the bf16 import writes one: bf16 x · W, + bias, SiLU, bf16
        x = te.placeholder((m, i64(k)), name="A", dtype="bfloat16")
        w = te.placeholder((i64(k), i64(n)), name="B", dtype="bfloat16")
        bias = te.placeholder((i64(n),), name="bias")
        r = te.reduce_axis((i64(0), i64(k)), name="k")
        c = te.compute((m, i64(n)), lambda i, j: te.sum(x[i, r].astype("float32") * w[r, j].astype("float32"),
                                                          axis=r), name="matmul")
        h = te.compute(c.shape, lambda i, j: c[i, j] + bias[j], name="add")
        g = te.compute(c.shape, lambda i, j: te.sigmoid(h[i, j]) * h[i, j], name="silu")
        return [x, w, bias, te.compute(c.shape, lambda i, j: g[i, j].astype("bfloat16"), name="cast")]

    rows = tirx.Var("m", "int64")
    funcs = {
        "gemm-bf16-silu-packed-sym": (bf16_projection(rows, 96, 128), (1,)),
        "gemm-bf16-silu-packed-ragged": (bf16_projection(i64(70), 64, 64), (1,)),
        "gemm-bf16-silu-packed-few": (bf16_projection(i64(6), 64, 64), (1,)),  # a decode step's batch of 6
        "gemm-bf16-silu-packed-gemv": (bf16_projection(i64(1), 96, 128), (1,)),
        "gemm-bias-gelu": (bias_gelu(i64(19), 96, 80), ()),
        "gemm-bias-gelu-sym-packed": (bias_gelu(rows, 96, 80), (1,)),
        "gemm-bias-packed-tail": (bias_only(i64(33), 128, 17), (1,)),
        "gemm-sym-packed": (list(gemm(rows, 256, 1000)), (1,)),
        "gemm-batch": (list(gemm(i64(13), 64, 72, (3,))), ()),
        "gemm-wide": (list(gemm(i64(37), 32, 8200)), (1,)),
        "gemv-packed": (list(gemm(i64(1), 64, 48)), (1,)),
        "gemm-f16-in-f32-acc": (half(i64(19), 96, 80, "float16", "float32"), ()),
        "gemm-bf16-in-f32-acc-sym": (half(rows, 96, 80, "bfloat16", "float32"), ()),
        "gemm-f16-acc": (half(i64(40), 64, 96, "float16", "float16"), (1,)),
    }
    out = {}
    for name, (args, constants) in funcs.items():
        func = te.create_prim_func(args)
        out[name] = func.with_attr(CONSTANT_PARAMS, list(constants)) if constants else func
    return out


def entries() -> list[tuple[str, str, str]]:
    """(kind, name, isa) of every kernel of the corpus."""
    out = []
    for name in _attention_specs():
        for isa in ("avx2", "avx512", "bf16", "amx"):
            out.append(("attention", name, isa))
    for name in ("core-f32-causal", "core-f16-causal", "core-bf16-gqa-bshd", "core-f32-decode-splitk",
                 "core-f16-decode-padded", "layer-f32-causal", "layer-f16-cross-gqa"):
        out.append(("attention", name, "zen5"))
    for name in _gemm_funcs():
        for isa in ("avx2", "avx512", "bf16") + (("amx",) if name.startswith("gemm-bf16") else ()):
            out.append(("gemm", name, isa))
    return out


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _target(isa: str):
    from tvm.target import Target

    return Target({"kind": "llvm", "mcpu": CPUS[isa], "num-cores": CORES})


def hash_entry(entry: tuple[str, str, str]) -> tuple[str, dict]:
    """The entry's key and its hashes: scheduled TIR, lowered TIR, description."""
    import tvm

    from tvmattn.compiler import build
    from tvmattn.compiler.spec import AttentionSpec

    kind, name, isa = entry
    target = _target(isa)
    key = f"{kind}/{name}/{isa}"
    try:
        if kind == "attention":
            spec = AttentionSpec(**_attention_specs()[name])
            mod, how = build.schedule_attention(spec, target, None, tuned=False)
        else:
            from tvmattn.compiler.passes import polynomial_math
            from tvmattn.schedules.ops import RULES

            func = _gemm_funcs()[name]
            how, sch = next((rule_name, s) for rule_name, r in RULES if (s := r.apply(func, target, False)) is not None)
            rule = dict(RULES)[how]
            mod = tvm.transform.Sequential([*getattr(rule, "passes", ()), polynomial_math()])(sch.mod)
        lowered = build.lower(mod, target)
        return key, {"scheduled": _digest(mod.script()), "lowered": _digest(lowered.script()), "how": how}
    except Exception as err:  # a kernel that no longer builds is a difference too
        return key, {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}


def build_corpus(jobs: int, only: str = "") -> dict[str, dict]:
    todo = [e for e in entries() if only in "/".join(e)]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            return dict(pool.map(hash_entry, todo, chunksize=4))
    return dict(map(hash_entry, todo))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", type=Path, help="write the corpus's hashes to this JSON file")
    what.add_argument("--check", type=Path, help="compare with this JSON file; exit 1 listing what differs")
    what.add_argument("--list", action="store_true", help="print the corpus's entries")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="processes building kernels (default 1)")
    parser.add_argument("--only", default="", help="entries whose key contains this string")
    args = parser.parse_args(argv)
    if args.list:
        for kind, name, isa in entries():
            print(f"{kind}/{name}/{isa}")
        return 0
    corpus = build_corpus(args.jobs, args.only)
    if args.save:
        lines = [f"{json.dumps(k)}: {json.dumps(corpus[k], ensure_ascii=False)}" for k in sorted(corpus)]
        args.save.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one kernel a line
        errors = [k for k, v in corpus.items() if "error" in v]
        print(f"{len(corpus)} kernels saved to {args.save}" + (f" ({len(errors)} failed to build)" if errors else ""))
        return 0
    saved = json.loads(args.check.read_text())
    if args.only:
        saved = {k: v for k, v in saved.items() if args.only in k}
    differ = []
    for key in sorted(set(saved) | set(corpus)):
        old, new = saved.get(key), corpus.get(key)
        if old != new:
            parts = [p for p in ("scheduled", "lowered", "how", "error")
                     if (old or {}).get(p) != (new or {}).get(p)] if old and new else ["missing" if new is None
                                                                                       else "new"]
            differ.append(f"{key}: {', '.join(parts)}")
            if old and new and old.get("how") != new.get("how"):
                differ.append(f"    how was {old.get('how')!r}\n    now     {new.get('how')!r}")
    if differ:
        print(f"{len([d for d in differ if not d.startswith(' ')])} of {len(corpus)} kernels differ:")
        print("\n".join(differ))
        return 1
    print(f"{len(corpus)} kernels identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
