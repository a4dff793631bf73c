"""Kernels, imported models and `tvmattn.torch` shared between threads, and used after a fork and in
spawned children (`compiler.concurrency`); TVM's log lines on `logging` (`compiler.logs`).

Each call made from several threads at once must give what the same call gives alone (bit for bit:
the same kernel on the same inputs). Children run in a subprocess with a timeout, so a hang or a
crash fails the test instead of stopping the suite. Nothing here is timed.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import onnx
import psutil
import pytest
from onnx import TensorProto
from onnx import helper as oh

import tvmattn
from tvmattn.models import onnx_models

THREADS = 4
ROOT = Path(__file__).resolve().parents[1]


def assert_threads_match_serial(call, cases: list, repeats: int = 15) -> None:
    """``call(case)`` from `THREADS` threads at once, thread i running case i % len(cases) ``repeats``
    times: every result equal to the serial run's; no exception, no thread left hanging."""
    serial = [np.array(call(c), copy=True) for c in cases]
    failures: list[str] = []

    def work(i: int) -> None:
        case = i % len(cases)
        try:
            for _ in range(repeats):
                got = np.asarray(call(cases[case]))
                if not np.array_equal(got, serial[case]):
                    failures.append(f"thread {i}: case {case} differs from the serial run by "
                                    f"{np.abs(got.astype(np.float64) - serial[case]).max():.3g}")
                    return
        except Exception as err:  # noqa: BLE001 (reported below, on the test's thread)
            failures.append(f"thread {i}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not failures, failures


def run_child(script: str, timeout: float = 300) -> str:
    """Run ``script`` in a fresh interpreter (a file, so spawned children can import its functions);
    it must exit 0 within ``timeout`` seconds. Returns its stdout and stderr."""
    path = Path(__import__("tempfile").mkdtemp(prefix="tvmattn-child-")) / "child.py"
    path.write_text(textwrap.dedent(script))
    try:
        done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the child hung (no exit in {timeout} s): {err.stdout!s:.2000}")
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def _x(rng, b: int, n: int, d: int = 64) -> np.ndarray:
    return rng.standard_normal((b, n, d)).astype(np.float32)


# ---- imported models from threads ---------------------------------------------------------------

def _model_cases(kind: str):
    rng = np.random.default_rng(0)
    if kind == "decoder":  # a causal mask from GPT-2's tril buffer
        return tvmattn.import_onnx(onnx_models.gpt2_block()), [{"x": _x(rng, b, n)} for b, n in
                                                                ((1, 5), (2, 33), (1, 64), (3, 17))]
    if kind == "encoder":  # a (B, n) padding mask
        feeds = []
        for b, n in ((1, 9), (2, 40), (3, 16), (2, 7)):
            lens = rng.integers(1, n + 1, b)
            feeds.append({"x": _x(rng, b, n), "attention_mask": (np.arange(n) < lens[:, None]).astype(np.int64)})
        return tvmattn.import_onnx(onnx_models.bert_block()), feeds
    hd = pytest.importorskip("tvmattn.models.hf_decoders")  # a decode step against a KV cache
    model = hd.decoder("gpt2")
    inputs, _ = hd.names(model, past=True)
    feeds = [{"input_ids": rng.integers(0, hd.VOCAB, (1, 1)).astype(np.int64)}
             | {name: rng.standard_normal(hd.cache_shape(model, past)).astype(np.float32) for name in inputs[1:]}
             for past in (3, 17, 40, 8)]
    return tvmattn.import_onnx(hd.export(model, "torchscript", past=True)), feeds


@pytest.mark.parametrize("kind", ["decoder", "encoder", "kv-cache decoder"])
def test_imported_model_from_threads(kind):
    model, feeds = _model_cases(kind)
    assert_threads_match_serial(lambda feed: model.run(feed)[0], feeds)


def test_model_runs_leave_memory_flat():
    """A few thousand runs at changing shapes: the resident memory after them is what it was after the
    first few hundred (the VM's pooled allocator reuses its buffers; nothing is kept per run)."""
    model, feeds = _model_cases("encoder")
    process = psutil.Process()
    for i in range(300):
        model.run(feeds[i % len(feeds)])
    before = process.memory_info().rss
    for i in range(3000):
        model.run(feeds[i % len(feeds)])
    grown = process.memory_info().rss - before
    assert grown < 8 << 20, f"resident memory grew {grown / 2**20:.1f} MiB over 3000 runs"


def test_runs_release_the_gil():
    """While a model runs on one thread, Python code runs on another (a call holding the GIL would
    stop it until the call returns)."""
    model, _ = _model_cases("decoder")
    feed = {"x": _x(np.random.default_rng(1), 4, 256)}
    started, done = threading.Event(), threading.Event()

    def runs() -> None:
        started.set()
        for _ in range(20):
            model.run(feed)
        done.set()

    thread = threading.Thread(target=runs)
    thread.start()
    started.wait()
    steps = 0
    while not done.is_set():
        steps += 1
    thread.join()
    assert steps > 1000, f"the other thread ran {steps} steps during the model's runs"


# ---- kernels from threads -----------------------------------------------------------------------

KERNELS = {  # spec, the sizes of each case (symbolic lengths)
    "core": (tvmattn.AttentionSpec(batch=2, seq_len=96, num_heads=4, head_dim=32, causal=True,
                                   projections=False), [{}]),
    "core, symbolic n": (tvmattn.AttentionSpec(seq_len="n", num_heads=4, num_kv_heads=2, head_dim=32,
                                               projections=False), [{"n": 7}, {"n": 64}, {"n": 130}]),
    "layer": (tvmattn.AttentionSpec(batch=1, seq_len="n", d_model=64, num_heads=4, causal=True),
              [{"n": 20}, {"n": 65}]),
    "decode": (tvmattn.AttentionSpec(batch=2, seq_len=1, kv_seq_len="m", num_heads=8, num_kv_heads=2,
                                     head_dim=64, causal=True, causal_align="bottom_right", projections=False),
               [{"m": 100}, {"m": 513}]),
    "bf16": (tvmattn.AttentionSpec(batch=1, seq_len=64, num_heads=4, head_dim=64, dtype="bfloat16",
                                   projections=False), [{}]),
}


@pytest.mark.parametrize("kind", list(KERNELS))
def test_kernel_from_threads(kind):
    from tvmattn.compiler.verify import random_inputs

    spec, sizes = KERNELS[kind]
    kernel = tvmattn.compile(spec)
    cases = [random_inputs(spec, at, seed) for seed, at in enumerate(sizes * (1 + (len(sizes) < 2)))]
    assert_threads_match_serial(lambda args: kernel(*args.values()), cases)


def test_torch_sdpa_from_threads():
    """The drop-in from threads, each compiling shapes of its own as it goes (one kernel per key)."""
    torch = pytest.importorskip("torch")
    from tvmattn.torch import scaled_dot_product_attention

    gen = torch.Generator().manual_seed(0)
    cases = [tuple(torch.randn(b, h, n, 32, generator=gen) for _ in range(3)) + (causal,)
             for b, h, n, causal in ((1, 4, 17, True), (2, 2, 64, False), (1, 4, 5, False), (3, 2, 40, True))]
    assert_threads_match_serial(
        lambda c: scaled_dot_product_attention(c[0], c[1], c[2], is_causal=c[3]).numpy(), cases, repeats=5)


# ---- processes ----------------------------------------------------------------------------------

_SETUP = """
    import multiprocessing as mp, os, sys
    import numpy as np
    import tvmattn
    from tvmattn.models import onnx_models

    SPEC = tvmattn.AttentionSpec(batch=1, seq_len="n", num_heads=4, head_dim=32, causal=True, projections=False)
    rng = np.random.default_rng(0)
    QKV = [rng.standard_normal((3, 1, 4, n, 32)).astype(np.float32) for n in (16, 100, 37, 64)]
    X = [rng.standard_normal((1, n, 64)).astype(np.float32) for n in (5, 40, 12, 64)]
"""


def test_fork_children_use_kernels_and_models():
    """Run in the parent (TVM's pool starts there), then in forked children: a multiprocessing pool
    and a bare os.fork, each child's results equal to the parent's."""
    out = run_child(_SETUP + """
    KERNEL = tvmattn.compile(SPEC)
    MODEL = tvmattn.import_onnx(onnx_models.bert_block())

    def kernel(i):
        return KERNEL(*QKV[i])

    def model(i):
        mask = np.ones(X[i].shape[:2], np.int64)
        return MODEL.run({"x": X[i], "attention_mask": mask})[0]

    if __name__ == "__main__":
        for fn in (kernel, model):
            want = [fn(i) for i in range(4)]
            with mp.get_context("fork").Pool(2) as pool:
                got = pool.map(fn, range(4))
            assert all(np.array_equal(g, w) for g, w in zip(got, want)), fn.__name__
            pid = os.fork()
            if pid == 0:  # the forking thread itself ran the kernel in the parent
                os._exit(0 if all(np.array_equal(fn(i), want[i]) for i in range(4)) else 3)
            assert os.waitpid(pid, 0)[1] == 0, fn.__name__
        print("children ok")
    """)
    assert "children ok" in out


def test_first_kernels_of_a_process_compiled_from_threads():
    """Tensor intrinsics are registered on first use (`isa.intrinsics`), not at import: in a fresh
    process, four threads compile kernels at once, each the first to use some of them."""
    out = run_child("""
    import threading
    from tvm.s_tir import TensorIntrin
    import tvmattn
    from tvmattn.compiler.isa import x86_amx, x86_bf16
    from tvmattn.compiler.verify import check

    assert all(TensorIntrin.get(name, allow_missing=True) is None for name in (x86_bf16.DOT_16x2, x86_amx.STORE))
    SPECS = [tvmattn.AttentionSpec(batch=1, seq_len=n, num_heads=2, head_dim=d, dtype=dt, layout=layout,
                                   projections=False)
             for n, d, dt, layout in ((64, 64, "bfloat16", "BHSD"), (48, 32, "bfloat16", "BSHD"),
                                      (40, 64, "float32", "BSHD"), ("n", 32, "bfloat16", "BHSD"))]
    errors = []

    def work(spec):
        try:
            result = check(tvmattn.compile(spec), {"n": 70} if spec.seq_len == "n" else None)
            assert result.ok, result.line()
        except BaseException as err:  # noqa: BLE001 (reported by the main thread)
            errors.append(repr(err))

    threads = [threading.Thread(target=work, args=(spec,)) for spec in SPECS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    print("threads ok")
    """)
    assert "threads ok" in out


@pytest.mark.slow  # (12-28 s on 2 cores: each child imports and compiles anew; forks are in the default run)
def test_spawn_children_build_their_own():
    out = run_child(_SETUP + """
    def kernel(i):
        return tvmattn.compile(SPEC)(*QKV[i])

    if __name__ == "__main__":
        want = [kernel(i) for i in range(2)]
        with mp.get_context("spawn").Pool(1) as pool:
            got = pool.map(kernel, range(2))
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
        print("children ok")
    """)
    assert "children ok" in out


def test_fork_after_openmp_kernels_falls_back_to_one_thread():
    """tvmattn.torch's kernels run on torch's OpenMP threads, which a forked child cannot restart:
    the child runs them on one thread, says so once, and answers as the parent does."""
    pytest.importorskip("torch")
    out = run_child("""
    import os
    import torch
    from tvmattn.torch import scaled_dot_product_attention as sdpa

    q = torch.randn(2, 4, 100, 32)
    want = sdpa(q, q, q, is_causal=True)
    pid = os.fork()
    if pid == 0:
        got = [sdpa(q, q, q, is_causal=True) for _ in range(2)]
        os._exit(0 if all(torch.equal(g, want) for g in got) else 3)
    assert os.waitpid(pid, 0)[1] == 0
    print("children ok")
    """, timeout=240)
    assert "children ok" in out
    assert out.count("forked after running kernels on OpenMP threads") == 1, out


# ---- TVM's log lines ----------------------------------------------------------------------------

def test_tvm_warnings_go_to_logging(capfd, caplog):
    """x³ (tanh-GELU's) makes TVM warn on stderr as it lowers the power; the import routes that line
    to the ``tvmattn.tvm`` logger at DEBUG (tvmattn rewrites the power), and stderr stays clean."""
    node = oh.make_node("Pow", ["x", "three"], ["y"])
    graph = oh.make_graph([node], "cube", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
                          initializer=[onnx.numpy_helper.from_array(np.float32(3.0), "three")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    with caplog.at_level(logging.DEBUG, logger="tvmattn.tvm"):
        imported = tvmattn.import_onnx(model)
    x = np.linspace(-2, 2, 24, dtype=np.float32).reshape(3, 8)
    np.testing.assert_allclose(imported.run({"x": x})[0], x.astype(np.float64) ** 3, rtol=1e-5, atol=1e-6)
    assert "Detected pow" not in capfd.readouterr().err
    records = [r for r in caplog.records if r.name == "tvmattn.tvm" and "Detected pow" in r.getMessage()]
    assert records and all(r.levelno == logging.DEBUG for r in records)
