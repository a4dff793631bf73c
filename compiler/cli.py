"""The ``tvmattn`` command: flags → AttentionSpec → library call → printed result.

Every user-facing error is a TvmAttnError, printed as one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

from tvmattn.compiler.errors import TvmAttnError, first_line
from tvmattn.compiler.spec import ALIBI_KINDS, AttentionSpec

# spec flag → AttentionSpec field; `None` defaults mean "not given" so a preset's value stands.
SPEC_FLAGS = {
    "batch": "batch", "seq": "seq_len", "kv_seq": "kv_seq_len", "d_model": "d_model", "heads": "num_heads",
    "kv_heads": "num_kv_heads", "head_dim": "head_dim", "v_head_dim": "v_head_dim", "causal": "causal",
    "causal_align": "causal_align", "window": "window", "key_padding": "key_padding", "layout": "layout",
    "dtype": "dtype", "projections": "projections", "scale": "scale", "alibi": "alibi",
}
DEFAULT_SPEC = {"d_model": 512, "num_heads": 8}  # when neither a preset nor a width is given


def _dim(text: str):
    """A size: an integer, or a name for a symbolic size."""
    return int(text) if text.lstrip("-").isdigit() else text


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("attention (or --preset NAME; flags given override the preset)")
    g.add_argument("--preset", help="a real configuration: gpt2-small, bert-base, llama-gqa, t5-cross, decode-4k")
    g.add_argument("--batch", type=_dim, help="B (an integer, or a name for a symbolic size)")
    g.add_argument("--seq", type=_dim, help="n, the query length (integer or name)")
    g.add_argument("--kv-seq", type=_dim, help="n_kv, the key/value length: cross-attention (integer or name)")
    g.add_argument("--d-model", type=int, help="d, the model width")
    g.add_argument("--heads", type=int, help="h, query heads")
    g.add_argument("--kv-heads", type=int, help="h_kv, key/value heads (GQA; 1 = MQA)")
    g.add_argument("--head-dim", type=int, help="d_k (default d_model / heads)")
    g.add_argument("--v-head-dim", type=int, help="d_v (default d_k)")
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, help="causal mask")
    g.add_argument("--causal-align", choices=["top_left", "bottom_right"], help="where query 0 sits when n != n_kv")
    g.add_argument("--window", type=int, help="sliding window W")
    g.add_argument("--key-padding", action=argparse.BooleanOptionalAction,
                   help="per-sequence valid key counts, an argument at run time")
    g.add_argument("--layout", choices=["BHSD", "BSHD"], type=str.upper, help="Q/K/V/O layout of the core kernel")
    g.add_argument("--dtype", help="float32 | float16 | bfloat16 (accumulation is always fp32)")
    g.add_argument("--projections", action=argparse.BooleanOptionalAction,
                   help="the full layer X → W_O (default), or --no-projections: the core Q,K,V → O kernel")
    g.add_argument("--scale", type=float, help="softmax scale (default 1/sqrt(d_k))")
    g.add_argument("--alibi", choices=ALIBI_KINDS, help="ALiBi: each head's slope (an argument at run time) times "
                   "the distance, signed slope·(j − i) (BLOOM) or symmetric −slope·|j − i| (FlashAttention)")


def spec_from_args(args: argparse.Namespace) -> AttentionSpec:
    given = {field: getattr(args, flag) for flag, field in SPEC_FLAGS.items() if getattr(args, flag) is not None}
    if args.preset:
        from tvmattn.models.presets import preset
        return preset(args.preset).replace(**given)
    if "d_model" not in given and "head_dim" not in given:
        given = {**DEFAULT_SPEC, **given}
    given.setdefault("num_heads", DEFAULT_SPEC["num_heads"])
    return AttentionSpec(**given)


def add_target_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="cpu", help="cpu (this machine's CPU), cuda, aarch64 or riscv64 "
                   "(cross-compiled; run under qemu-user here)")
    p.add_argument("--arch", help="CUDA arch for --target cuda (default sm_90)")
    p.add_argument("--mcpu", help="CPU for --target aarch64 (neoverse-n1, neoverse-v1, neoverse-v2, cortex-a76, "
                   "apple-m2; default: generic NEON) or riscv64 (spacemit-x60: VLEN 256; default: VLEN 128)")


def target_of(args: argparse.Namespace, runs_here: bool = False):
    """The target the flags name (a foreign CPU's resolved by `target.resolve_target`). ``runs_here``:
    the command measures kernels, which a foreign CPU's cannot be here."""
    if getattr(args, "mcpu", None) is None and args.target not in ("aarch64", "riscv64"):
        return args.target
    if runs_here:
        over_rpc = " (or, for tune, measure there over RPC: --rpc HOST:PORT --device-key KEY)" \
            if args.command == "tune" else ""
        raise TvmAttnError(f"--target {args.target}: {args.command} measures kernels, which tvmattn cannot do here "
                           f"for another CPU (emulation times nothing): run it on that CPU with --target cpu{over_rpc}")
    from tvmattn.compiler.target import resolve_target

    return resolve_target(args.target, args.arch, args.mcpu)


def _log_dir(text: str) -> str:
    """A directory of tuning logs: it need not exist yet, but it must not be a file."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a file: --log-dir takes a directory of tuning logs")
    return text


def add_log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-dir", action="append", default=[], type=_log_dir,
                   help="tuning logs to search before the user's and the shipped ones (repeatable)")
    p.add_argument("--default-schedule", action="store_true", help="ignore tuning logs: the default schedule")


def build_from_args(args: argparse.Namespace, spec: AttentionSpec):
    from tvmattn.compiler.build import compile_attention

    return compile_attention(spec, target_of(args), arch=args.arch, log_dirs=args.log_dir,
                             tuned=not args.default_schedule)


def parse_sizes(items: list[str] | None) -> dict[str, int]:
    """``--at n=128 --at m=512`` → {"n": 128, "m": 512}."""
    sizes: dict[str, int] = {}
    for item in items or []:
        for part in item.split(","):
            name, _, value = part.partition("=")
            if not value.isdigit() or int(value) <= 0:
                raise TvmAttnError(f"--at {part!r}: write NAME=SIZE with a positive integer size, e.g. --at n=128")
            sizes[name.strip()] = int(value)
    return sizes


# ---- commands ---------------------------------------------------------------------------------------
def cmd_compile(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    kernel = build_from_args(args, spec)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    lib = out / "attention.so"
    kernel.export_library(str(lib))
    print(f"spec:     {spec.describe()}")
    print(f"target:   {kernel.target}")
    print(f"schedule: {kernel.schedule}")
    print(f"compiled in {kernel.compile_seconds:.2f} s → {lib}")
    if kernel.target.kind.name == "cuda":
        from tvmattn.compiler.cuda.tools import (
            compile_cubin,
            compile_ptx,
            with_dynamic_shared,
        )
        arch = str(kernel.target.attrs.get("arch", "sm_90"))
        source = kernel.source()
        (out / "attention.cu").write_text(source)
        (out / "attention.ptx").write_text(compile_ptx(source, arch))
        cubin, resources = compile_cubin(source, arch)
        resources = with_dynamic_shared(resources, kernel.module, kernel.target)
        (out / "attention.cubin").write_bytes(cubin)
        print(f"CUDA source, PTX and cubin ({arch}) → {out}/attention.{{cu,ptx,cubin}}; ptxas:")
        for r in resources:
            print(f"  {r.line()}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from tvmattn.compiler.verify import check, sizes_to_check

    spec = spec_from_args(args)
    start = time.perf_counter()
    kernel = build_from_args(args, spec)
    print(f"spec:     {spec.describe()}")
    print(f"schedule: {kernel.schedule} (compiled in {kernel.compile_seconds:.2f} s)")
    ok = True
    for sizes in sizes_to_check(spec, parse_sizes(args.at)):
        result = check(kernel, sizes, seed=args.seed)
        print(result.line())
        ok &= result.ok
    print(f"verify took {time.perf_counter() - start:.2f} s")
    return 0 if ok else 1


def cmd_explain(args: argparse.Namespace) -> int:
    from tvmattn.compiler.explain import report

    spec = spec_from_args(args)
    print(spec.describe())
    print(report(spec, parse_sizes(args.at)))
    return 0


def parse_shapes(items: list[str] | None) -> dict[str, tuple[int | str, ...]]:
    """``--shape input_ids=1xn`` → {"input_ids": (1, "n")}."""
    shapes = {}
    for item in items or []:
        name, sep, dims = item.rpartition("=")
        if not sep or not name or not dims:
            raise TvmAttnError(f"--shape {item!r}: write NAME=DIMS, e.g. --shape input_ids=1xn")
        shapes[name] = tuple(int(d) if d.isdigit() else d for d in dims.split("x"))
    return shapes


def cmd_import(args: argparse.Namespace) -> int:
    from tvmattn.compiler.onnx.compare import compare_with_ort, model_feed, random_feed
    from tvmattn.compiler.onnx.importer import import_onnx, load

    model = load(args.model)  # read and checked once
    imported = import_onnx(model, target_of(args), arch=args.arch, shapes=parse_shapes(args.shape), dtype=args.dtype,
                           cache_dtype=args.cache_dtype)
    print(imported.report)
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        lib = out / (Path(args.model).stem + ".so")
        imported.export_library(str(lib))
        print(f"library → {lib}")
    if not args.check:
        return 0
    sizes = parse_sizes(args.at)
    feed = model_feed(imported, random_feed(imported.inputs, sizes, args.seed))  # the model's dtypes, as ORT takes them
    checks = compare_with_ort(model.proto, imported, feed, sizes)
    for c in checks:
        print(c.line())
    return 0 if all(c.ok for c in checks) else 1


def cmd_export_onnx(args: argparse.Namespace) -> int:
    import onnx

    from tvmattn.compiler.onnx.export import export_onnx

    spec = spec_from_args(args)
    model, _ = export_onnx(spec, args.opset, args.seed)
    out = Path(args.output)
    if out.parent != Path("."):
        out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    how = "the Attention op" if args.opset >= 23 else "decomposed MatMul/Softmax ops"
    print(f"spec:   {spec.describe()}")
    print(f"opset {args.opset} ({how}), inputs {', '.join(i.name for i in model.graph.input)} → {out}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from tvmattn.compiler.tuning.measure import RemoteDevices
    from tvmattn.compiler.tuning.progress import clock
    from tvmattn.compiler.tuning.tuner import log_path, tune

    if args.model:
        return _tune_model(args)
    spec = spec_from_args(args)
    remote = RemoteDevices.parse(args.rpc, args.device_key) if args.rpc else None
    if args.device_key and not args.rpc:
        raise TvmAttnError("--device-key is for --rpc HOST:PORT (the tracker the servers registered with)")
    points = [parse_sizes([item]) for item in args.at or []]
    print(f"spec:     {spec.describe()}")
    try:
        report = tune(spec, target_of(args, runs_here=remote is None), trials=args.trials, at=points, arch=args.arch,
                      log_dir=args.log_dir, remote=remote, seed=args.seed)
    except KeyboardInterrupt:
        print(f"tvmattn: interrupted: every completed round is kept in "
              f"{log_path(spec, args.target, args.arch, args.log_dir)}; run the same command again to continue",
              file=sys.stderr)
        return 130
    print(f"target:   {report.target}")
    again = f" (+ {report.confirmations} confirming the fastest)" if report.confirmations else ""
    print(f"tuned:    {report.measured_now} trial(s) this run{again} in {clock(report.seconds)} → {report.log_file}")
    for point in report.points:
        at = " ".join(f"{k}={v}" for k, v in point.at.items())
        print(f"  {'at ' + at + ': ' if at else ''}{point.trials} trial(s) recorded")
        if point.best is None:
            print("    no successful measurement: see the errors in the log")
            continue
        print(f"    best:    {_latency(point.best)}  {_knobs(point.best)}")
        if point.default is not None:
            print(f"    default: {_latency(point.default)}  → tuned is "
                  f"{point.default.latency_us / point.best.latency_us:.2f}× the default's speed")
    if report.stopped:
        print("tvmattn: stopped early on Ctrl-C: run the same command again to continue", file=sys.stderr)
        return 130
    return 0


def _tune_model(args: argparse.Namespace) -> int:
    from tvmattn.compiler.tuning.model import tune_model

    try:
        reports, path = tune_model(args.model, target_of(args, runs_here=True), trials=args.trials,
                                   at=parse_sizes(args.at), shapes=parse_shapes(args.shape), log_dir=args.log_dir,
                                   seed=args.seed)
    except KeyboardInterrupt:
        print("tvmattn: interrupted: every measurement so far is kept; run the same command again to continue",
              file=sys.stderr)
        return 130
    print(f"records → {path}")
    for r in reports:
        if r.best_us is None:
            print(f"  {r.task.name} ({r.task.rule}): no successful measurement (see the errors in the log)")
            continue
        speedup = f" → {r.default_us / r.best_us:.2f}× the default's speed" if r.default_us else ""
        print(f"  {r.task.name} ({r.task.rule}): best {r.best_us:,.1f} µs {_knobs_text(r.best_knobs)}; default "
              f"{r.default_us:,.1f} µs{speedup}" if r.default_us else f"  {r.task.name}: best {r.best_us:,.1f} µs")
    return 0


def _knobs_text(knobs: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in knobs.items())


def _latency(record) -> str:
    rate = f" ({record.gflops:.1f} GFLOP/s)" if record.gflops else ""
    return f"{record.latency_us:,.1f} µs{rate}"


def _knobs(record) -> str:
    return " ".join(f"{k}={v}" for k, v in record.knobs.items())


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line too."""

    def error(self, message: str):
        self.exit(2, f"tvmattn: error: {message} (see {self.prog} --help)\n")


def cmd_bench(args: argparse.Namespace) -> int:
    from tvmattn.compiler import bench
    from tvmattn.compiler.peak import peak_gflops

    if args.model:
        return _bench_model(args)
    specs = bench.suite(args.suite, args.dtype or "float32") if args.suite else [spec_from_args(args)]
    peers = tuple(p for p in args.peers.split(",") if p) if args.peers is not None else bench.default_peers()
    unknown = set(peers) - set(bench.PEERS)
    if unknown:
        raise TvmAttnError(f"unknown peer(s) {sorted(unknown)}: choose from {', '.join(bench.PEERS)}")
    peak, measured_with = peak_gflops(specs[0].dtype)
    print(f"{bench.cpu_cores()} threads; %peak of {peak:.0f} GFLOP/s ({measured_with}, {specs[0].dtype} "
          f"values); GFLOP/s counts the (query, key) pairs a query sees; tvmattn × = peer time / tvmattn time")
    results = []
    target = target_of(args, runs_here=True)
    for spec in specs:
        rows = bench.bench(spec, peers, args.budget, target, args.log_dir, not args.default_schedule)
        print(bench.table(rows, peak), flush=True)
        results += rows
    if args.json:
        bench.write_json(results, peak, measured_with, args.json)
    if args.plot:
        bench.plot(results, args.plot)
    return 0


def _bench_model(args: argparse.Namespace) -> int:
    from tvmattn.compiler.onnx.bench import bench_model
    from tvmattn.compiler.onnx.compare import model_feed, random_feed
    from tvmattn.compiler.onnx.importer import import_onnx, load

    model = load(args.model)  # read and checked once
    imported = import_onnx(model, target_of(args), arch=args.arch, shapes=parse_shapes(args.shape), dtype=args.dtype,
                           cache_dtype=args.cache_dtype)
    print(imported.report, flush=True)
    feed = model_feed(imported, random_feed(imported.inputs, parse_sizes(args.at), args.seed))
    print(bench_model(model.proto, imported, feed, args.budget, Path(args.model).name).table())
    if args.profile:
        from tvmattn.compiler.onnx.profile import profile
        from tvmattn.compiler.peak import peak_gflops

        print("tvmattn by function (its profile):")
        print(profile(imported, feed, peak_gflops=peak_gflops()[0]).table(args.profile))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tvmattn", description=__doc__.splitlines()[0].strip())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("compile", help="build the kernel for a target and write the library")
    add_spec_flags(p)
    add_target_flags(p)
    add_log_flags(p)
    p.add_argument("-o", "--output", default="tvmattn_out", help="output directory")
    p.set_defaults(run=cmd_compile)

    p = sub.add_parser("verify", help="build, run on seeded random data, compare with the NumPy oracle")
    add_spec_flags(p)
    add_target_flags(p)
    add_log_flags(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--at", action="append", help="values of symbolic sizes, e.g. --at n=100 (default 1, 37, 128)")
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser("bench", help="time tvmattn against PyTorch, ONNX Runtime, OpenVINO and NumPy in one process; "
                       "with a model.onnx: the imported model against ONNX Runtime and OpenVINO (fp32)")
    p.add_argument("model", nargs="?", help="an .onnx file: bench the whole model instead of one attention")
    p.add_argument("--shape", action="append", help="(model) bind an input's dimensions, e.g. --shape input_ids=1x128")
    p.add_argument("--at", action="append", help="(model) sizes of named dimensions, e.g. --at seq=128 (default 4)")
    p.add_argument("--seed", type=int, default=0, help="(model) seed of the random inputs")
    p.add_argument("--profile", type=int, nargs="?", const=25, default=0, metavar="N",
                   help="(model) also time each compiled function: the N slowest (default 25) with their "
                   "schedule rule, GFLOP/s and GB/s")
    p.add_argument("--cache-dtype", help="(model) bf16 | fp16: a decoder's KV cache inputs and outputs (past_* → "
                   "present_*) in that dtype: half the bytes a decode step reads")
    add_spec_flags(p)
    add_target_flags(p)
    add_log_flags(p)
    p.add_argument("--suite", help="a benchmark suite instead of one spec: default")
    p.add_argument("--peers", help="comma-separated subset of torch,onnxruntime,openvino,numpy ('' for none; "
                   "default: all, openvino where installed)")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed runs per implementation")
    p.add_argument("--json", help="write the results to this JSON file")
    p.add_argument("--plot", help="draw GFLOP/s against sequence length to this PNG (needs matplotlib)")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("tune", help="search the schedule's knobs with MetaSchedule; later compiles use the best; "
                       "with a model.onnx: its GEMMs' knobs, which import_onnx then uses")
    p.add_argument("model", nargs="?", help="an .onnx file: tune the model's GEMM functions (CPU)")
    p.add_argument("--shape", action="append", help="(model) bind an input's dimensions, e.g. --shape input_ids=1xn")
    add_spec_flags(p)
    add_target_flags(p)
    p.add_argument("--trials", type=int, default=64,
                   help="measurements per workload in total: a re-run measures only what is missing (default 64)")
    p.add_argument("--at", action="append",
                   help="a representative point of a symbolic spec, e.g. --at n=512; repeat for several")
    p.add_argument("--log-dir", type=_log_dir, help="where records go (default ~/.cache/tvmattn/tuning_logs)")
    p.add_argument("--rpc", metavar="HOST:PORT", help="measure on the servers of this RPC tracker")
    p.add_argument("--device-key", help="the key the RPC servers registered with (python -m tvm.exec.rpc_server --key)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search")
    p.set_defaults(run=cmd_tune)

    p = sub.add_parser("explain", help="the shape trace: each stage's shape, FLOPs and bytes")
    add_spec_flags(p)
    p.add_argument("--at", action="append", help="values of symbolic sizes for the counts, e.g. --at n=1024")
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser("import", help="import an ONNX model: its attention on tvmattn kernels, the rest by TVM")
    p.add_argument("model", help="the .onnx file")
    add_target_flags(p)
    p.add_argument("-o", "--output", help="directory for the compiled library")
    p.add_argument("--check", action="store_true", help="run on seeded random inputs and compare with ONNX Runtime")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--at", action="append", help="sizes of named dimensions for --check, e.g. --at seq=128 (default 4)")
    p.add_argument("--shape", action="append", help="bind an input's dimensions (sizes or names), e.g. "
                   "--shape input_ids=1xn (repeatable)")
    p.add_argument("--dtype", help="bf16 | fp16: the matmuls by the model's weights in that precision "
                   "(fp32 accumulation; inputs and outputs keep the model's dtypes)")
    p.add_argument("--cache-dtype", help="bf16 | fp16: a decoder's KV cache inputs and outputs (past_* → "
                   "present_*) in that dtype: half the bytes a decode step reads")
    p.set_defaults(run=cmd_import)

    p = sub.add_parser("export-onnx", help="write the attention layer as a standard ONNX model with its weights")
    add_spec_flags(p)
    p.add_argument("-o", "--output", default="attention.onnx", help="the .onnx file to write")
    p.add_argument("--opset", type=int, default=23, help="23 or later: ONNX's Attention op; 17: decomposed ops")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.set_defaults(run=cmd_export_onnx)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        try:
            return args.run(args)
        except (TvmAttnError, OSError, MemoryError) as err:  # the user's input, files or machine: one line
            print(f"tvmattn: error: {_one_line(err)}", file=sys.stderr)
            if os.environ.get("TVMATTN_DEBUG"):
                raise
            return 2
        except Exception as err:  # our bug: still one line, and how to see the rest
            print(f"tvmattn: internal error: {type(err).__name__}: {_one_line(err)} (TVMATTN_DEBUG=1 shows "
                  f"the traceback; please report it)", file=sys.stderr)
            if os.environ.get("TVMATTN_DEBUG"):
                raise
            return 1


def _one_line(err: BaseException) -> str:
    if isinstance(err, MemoryError):
        return "out of memory: use smaller inputs, or free memory on this machine"
    return first_line(err)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"tvmattn: warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
