"""The tvmattn command: each subcommand, presets with overrides, and every bad-input path."""

import subprocess
import sys

import pytest

from tvmattn.compiler.cli import build_parser, main, spec_from_args
from tvmattn.models.presets import PRESETS


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def spec_of(*argv):
    return spec_from_args(build_parser().parse_args(["explain", *argv]))


def test_preset_with_overrides():
    spec = spec_of("--preset", "gpt2-small", "--seq", "64", "--no-projections")
    assert (spec.seq_len, spec.d_model, spec.num_heads, spec.causal, spec.projections) == (64, 768, 12, True, False)
    assert not spec_of("--preset", "gpt2-small", "--no-causal").causal


def test_flags_without_preset_and_symbolic_sizes():
    spec = spec_of("--batch", "B", "--seq", "n", "--heads", "4", "--head-dim", "16", "--kv-heads", "2",
                   "--layout", "bshd", "--dtype", "fp16", "--window", "8", "--key-padding")
    assert (spec.batch, spec.seq_len, spec.layout, spec.dtype, spec.num_kv_heads) == ("B", "n", "BSHD", "float16", 2)
    assert spec_of().d_model == 512


def test_verify_passes_and_reports(capsys):
    code, out, _ = run(capsys, "verify", "--seq", "n", "--d-model", "32", "--heads", "2", "--causal",
                       "--at", "n=19")
    assert code == 0
    assert "PASS at n=19" in out and "max abs error" in out


def test_verify_alibi(capsys):
    code, out, _ = run(capsys, "verify", "--seq", "n", "--d-model", "32", "--heads", "2", "--causal", "--alibi",
                       "signed", "--at", "n=19")
    assert code == 0 and "PASS at n=19" in out and "alibi(signed)" in out


@pytest.mark.parametrize("name", [pytest.param(name, marks=[] if name in ("gpt2-small", "llama-gqa", "t5-cross")
                                                 else [pytest.mark.slow]) for name in PRESETS])
def test_verify_presets(capsys, name):  # (-m slow: every preset)
    code, out, _ = run(capsys, "verify", "--preset", name)
    assert code == 0 and "PASS" in out, out


def test_explain(capsys):
    code, out, _ = run(capsys, "explain", "--preset", "bert-base")
    assert code == 0 and "scores = q·kᵀ" in out and "(2, 12, 512, 512)" in out


def test_compile_cpu_writes_the_library(capsys, tmp_path):
    code, out, _ = run(capsys, "compile", "--seq", "16", "--d-model", "32", "--heads", "2", "-o", str(tmp_path))
    assert code == 0 and (tmp_path / "attention.so").stat().st_size > 0
    assert "default schedule" in out


def test_verify_a_layer_given_head_dim_not_d_model(capsys):
    """d_model left to num_heads · head_dim (the plan's GEMM tiles once read d_model itself: None)."""
    code, out, _ = run(capsys, "verify", "--seq", "16", "--heads", "2", "--head-dim", "16")
    assert code == 0 and "PASS" in out, out


@pytest.mark.parametrize("argv, words", [
    (["verify", "--d-model", "100", "--heads", "8"], "not divisible by num_heads"),
    (["verify", "--preset", "gpt3"], "unknown preset 'gpt3'"),
    (["verify", "--seq", "8", "--d-model", "16", "--target", "tpu"], "unknown target 'tpu'"),
    (["verify", "--seq", "8", "--d-model", "16", "--dtype", "int4"], "unknown dtype"),
    (["verify", "--seq", "n", "--d-model", "16", "--at", "n=zero"], "--at 'n=zero'"),
    (["verify", "--seq", "8", "--d-model", "16", "--heads", "2", "--kv-heads", "3"], "multiple of num_kv_heads"),
    (["compile", "--seq", "8", "--d-model", "16", "--target", "cuda", "--arch", "volta"], "unknown CUDA arch"),
    (["verify", "--seq", "0", "--d-model", "16"], "seq_len=0"),
    (["verify", "--seq", "n-1", "--d-model", "16"], "symbolic size must be a name"),
    (["verify", "--seq", "8", "--d-model", "16", "--heads", "2", "--scale", "-1"], "scale=-1"),
    (["verify", "--seq", "8", "--d-model", "16", "--heads", "2", "--window", "0"], "window=0"),
    (["verify", "--seq", "8", "--d-model", "16", "--heads", "2", "--causal-align", "bottom_right", "--kv-seq",
      "4", "--no-projections", "--scale", "nan"], "scale=nan"),
    (["import", "/nonexistent/model.onnx"], "cannot read ONNX model"),
    (["import", "/etc/hostname"], "not an ONNX model"),
    (["bench", "--seq", "8", "--d-model", "16", "--heads", "2", "--peers", "tensorflow"], "unknown peer"),
    (["bench", "--suite", "huge"], "suite"),
    (["tune", "--seq", "8", "--d-model", "16", "--heads", "2", "--trials", "0"], "--trials 0"),
    (["tune", "--seq", "8", "--d-model", "16", "--heads", "2", "--device-key", "x"], "--device-key is for --rpc"),
    (["tune", "--seq", "8", "--d-model", "16", "--heads", "2", "--rpc", "nohostport"], "HOST:PORT"),
    (["export-onnx", "--seq", "8", "--d-model", "16", "--heads", "2", "--opset", "20"], "--opset 20"),
    (["compile", "--seq", "8", "--d-model", "16", "--heads", "2", "-o", "/etc/hostname/out"], "Not a directory"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, words):
    code, out, err = run(capsys, *argv)
    assert code == 2 and words in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv, words", [
    (["verify", "--layout", "XYZW"], "--layout"), (["nosuch"], "invalid choice: 'nosuch'"), ([], "command"),
    (["--foo", "verify"], "--foo"), (["verify", "--foo"], "--foo"), (["verify", "--heads", "x"], "--heads"),
    (["verify", "--log-dir", "/etc/hostname"], "is a file"), (["tune", "--log-dir", "/etc/hostname"], "is a file"),
    (["verify", "--causal-align", "middle"], "--causal-align"), (["bench", "--budget", "soon"], "--budget"),
])
def test_argparse_errors_are_one_line_too(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tvmattn: error:") and err.count("\n") == 1 and words in err


def test_console_script_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "tvmattn.compiler.cli", "verify", "--heads", "7", "--d-model", "64"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("tvmattn: error: d_model=64 is not divisible by num_heads=7: "
                                   "choose num_heads dividing d_model, or give head_dim explicitly")


def test_bench_model_runs_it_against_onnx_runtime(capsys, tmp_path):
    """`tvmattn bench model.onnx`: the import report, the three timings and a line per operator class."""
    pytest.importorskip("onnxruntime")
    import onnx

    from tvmattn.models.onnx_models import gpt2_block

    path = tmp_path / "block.onnx"
    onnx.save(gpt2_block(), str(path))
    code, out, _ = run(capsys, "bench", str(path), "--at", "batch=1", "--at", "seq=16", "--budget", "0.05")
    assert code == 0 and "the rest of the model, by schedule rule: " in out and "x 1×16×64" in out
    classes = [line.split()[0] for line in out.splitlines() if line.startswith("    ") and line.endswith("%")]
    assert "attention" in classes and "matmul" in classes
    lines = [line.strip() for line in out.splitlines()]
    assert any(line.startswith("onnxruntime") and " ms " in line for line in lines)
    # OpenVINO where installed, else a line saying why not: never a crash
    assert any(line.startswith("openvino") and (" ms " in line or "not run:" in line) for line in lines)


def test_tune_model_writes_records_the_import_reports(capsys, tmp_path, monkeypatch):
    import onnx

    from tvmattn.models.onnx_models import gpt2_block

    path = tmp_path / "block.onnx"
    onnx.save(gpt2_block(), str(path))
    code, out, _ = run(capsys, "tune", str(path), "--trials", "1", "--at", "seq=8", "--log-dir", str(tmp_path / "logs"))
    assert code == 0 and "records → " in out and "(matmul): best " in out
    monkeypatch.setenv("TVMATTN_TUNING_LOGS", str(tmp_path / "logs"))
    code, out, _ = run(capsys, "import", str(path))
    assert code == 0 and "from tuning records" in out


def test_import_check_with_a_16_bit_cache(capsys, tmp_path):
    """`tvmattn import decoder.onnx --dtype bf16 --cache-dtype bf16 --check`: the cache stored in bf16,
    every output checked against ONNX Runtime (fed the fp32 cache) at bf16's tolerance."""
    pytest.importorskip("onnxruntime")
    import onnx

    from tvmattn.models import zoo

    path = tmp_path / "decode.onnx"
    onnx.save(zoo.get("falcon-decode").export(), str(path))
    code, out, _ = run(capsys, "import", str(path), "--dtype", "bf16", "--cache-dtype", "bf16", "--check",
                       "--at", "past=40")
    assert code == 0 and "KV cache in bfloat16 (4 pairs" in out, out
    checks = [line for line in out.splitlines() if "PASS" in line or "FAIL" in line]
    assert len(checks) == 5 and all("PASS" in line for line in checks), checks
