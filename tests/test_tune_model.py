"""`tvmattn tune model.onnx`: the GEMM tasks of an imported model tuned into records that the next
import uses, and the model still matches ONNX Runtime built from them."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tvmattn
from tvmattn.compiler.onnx.compare import random_feed
from tvmattn.compiler.target import resolve_target
from tvmattn.compiler.tuning import model as tune
from tvmattn.compiler.tuning.lookup import TUNED_RULES
from tvmattn.models.onnx_models import gpt2_block

ort = pytest.importorskip("onnxruntime")


def test_tuned_records_rebuild_the_model(tmp_path, monkeypatch):
    model = gpt2_block()  # x (batch, seq, 64): QKV and output projections, an MLP
    tasks = tune.tasks(model, resolve_target("cpu"))
    assert tasks and len({t.key for t in tasks}) == len(tasks) and {t.rule for t in tasks} <= set(TUNED_RULES)

    reports, path = tune.tune_model(model, trials=3, at={"batch": 2, "seq": 17}, log_dir=tmp_path, progress=False)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    # the default and two more points each, then the default and the two fastest again, alternately
    confirmations = tune.CONFIRM_ROUNDS * (1 + tune.FINALISTS)
    assert len(lines) == (3 + confirmations) * len(tasks) and all(r["latency_us"] for r in lines)
    assert all(r.best_us <= r.default_us for r in reports)
    again, _ = tune.tune_model(model, trials=3, at={"batch": 2, "seq": 17}, log_dir=tmp_path, progress=False)
    assert all(r.measured_now == 0 for r in again)  # nothing left to measure

    monkeypatch.setenv("TVMATTN_TUNING_LOGS", str(tmp_path))
    imported = tvmattn.import_onnx(model)
    assert len(imported.report.tuned) == len(tasks) and "from tuning records" in str(imported.report)
    feed = random_feed(imported.inputs, {"batch": 2, "seq": 9})
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = imported.run(feed)[0]
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))


