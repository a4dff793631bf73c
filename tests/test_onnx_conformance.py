"""ONNX's own conformance cases for the Attention operator, all 186, through tvmattn.import_onnx.

Each case is a model with inputs and expected outputs (computed by ONNX's reference implementation).
The ``_expanded`` half writes the same attention as MatMul/Softmax/Where… nodes: those must be found
by the decomposed-attention patterns. Every case must run its attention on a tvmattn kernel.

Tolerances: fp32 outputs at the case's own rtol/atol; fp16 and bf16 at one unit in the last place of
their precision (rtol = atol = 2⁻¹⁰ resp. 2⁻⁷), since the kernel accumulates in fp32 where the
reference rounds every intermediate to the input type. The default run takes every direct case and
a spread of expanded ones; ``-m slow`` runs the rest (`pytest -m slow tests/test_onnx_conformance.py`).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx_testing import kernels_used

import tvmattn

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # collecting every node's cases warns about unrelated casts
    from onnx.backend.test.case.node import collect_testcases

    CASES = collect_testcases(op_type="Attention")

HALF_ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
# Expanded cases in the default run: one per feature (GQA, masks, caches, softcap, windows, qk outputs,
# fully masked rows, half precision); the other expanded cases repeat these in other combinations.
DEFAULT_EXPANDED = {
    "test_attention_4d_gqa_expanded", "test_attention_4d_attn_mask_bool_4d_expanded",
    "test_attention_4d_attn_mask_3d_causal_expanded", "test_attention_4d_diff_heads_with_past_and_present_expanded",
    "test_attention_3d_gqa_causal_expanded", "test_attention_3d_softcap_expanded",
    "test_attention_4d_with_qk_matmul_softmax_expanded",
    "test_attention_23_boolmask_fullymasked_row_nan_robustness_expanded",
    "test_attention_4d_causal_nonpad_attn_mask_composition_expanded", "test_attention_local_window_with_past_expanded",
    "test_attention_bidirectional_window_expanded", "test_attention_4d_softcap_neginf_mask_poison_expanded",
    "test_attention_4d_gqa_causal_nonpad_decode_fp16_expanded", "test_attention_4d_padded_kv_bf16_expanded",
    "test_attention_3d_with_past_and_present_qk_matmul_bias_expanded",
    "test_attention_local_window_gqa_rank4_mask_expanded",
}


def _params():
    for case in CASES:
        slow = case.name.endswith("_expanded") and case.name not in DEFAULT_EXPANDED
        yield pytest.param(case, id=case.name, marks=[pytest.mark.slow] if slow else [])


def test_all_186_cases_are_collected():
    assert len(CASES) == 186
    assert sum(c.name.endswith("_expanded") for c in CASES) == 93


@pytest.mark.parametrize("case", list(_params()))
def test_conformance(case):
    imported = tvmattn.import_onnx(case.model)
    assert kernels_used(imported) == 1, str(imported.report)
    assert not imported.report.left_to_tvm, str(imported.report)
    for inputs, expected in case.data_sets:
        outputs = imported.run({i.name: x for i, x in zip(imported.inputs, inputs)})
        assert len(outputs) == len(expected)
        for got, want in zip(outputs, expected):
            eps = HALF_ULP.get(str(want.dtype))
            rtol, atol = (case.rtol, case.atol) if eps is None else (eps, eps)
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)
